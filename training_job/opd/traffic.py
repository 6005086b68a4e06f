"""Traffic in: the served requests under `$ADAFLASH_HOME/traffic/`, in both formats on the volume.

Each directory under `traffic/` belongs to one writer (a pod) and may hold

- the project's shards (`NNNNNNNN.jsonl`, `.jsonl.partial`), read with
  :func:`sglang_adaflash.serving.traffic.iter_records` (same schema check as the writer);
- SGLang's own request log (`<host>_<rank>.log` and its hourly renames `<...>.log.<date>_<hour>`),
  JSON lines ``[time] {"event": "request.finished", "rid", "obj", "out", ...}``.

Both become :class:`Sample` objects. Everything skipped lands in one
:class:`~sglang_adaflash.serving.traffic.ReadReport`, so the job can say how many lines it could
not use and why. A sample's key hashes its writer and its record's content; it stays the same
when SGLang renames a log file or a crashed writer's partial shard is closed, which is what lets
the job remember which records earlier rounds consumed (:class:`Ledger`) without file offsets.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import math
import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from sglang_adaflash.fsio import write_text_atomic
from sglang_adaflash.serving.traffic import (
    BAD_JSON,
    BAD_SCHEMA,
    BAD_UTF8,
    UNREADABLE,
    ReadReport,
    iter_records,
)

#: SGLang's TimedRotatingFileHandler file and its hourly renames.
SGLANG_LOG_RE = re.compile(r"^[^.].*_\d+\.log(\.[0-9][0-9_-]*)?$")
_SHARD_RE = re.compile(r"^\d{8}\.jsonl(\.partial)?$")
#: A line of SGLang's text request log: it holds Python reprs, not ids we can trust.
TEXT_FORMAT = "text_format"
#: Records the training job cannot use for this target, skipped and counted like damaged lines:
#: token ids at or past the target's vocabulary (another model's traffic on the volume), and
#: records whose ``target_digest`` names another target's config.
OUT_OF_VOCABULARY = "out_of_vocabulary"
OTHER_TARGET = "other_target"
#: Domain name for requests that carried no tag (an empty key would not survive Kubernetes).
UNTAGGED = "untagged"
FINISHED = "request.finished"


@dataclass(frozen=True)
class Sample:
    """One served request: a prompt and the target's response to it."""

    key: str
    source: str  # "traffic" (the project's shards) or "sglang" (SGLang's request log)
    writer: str
    id: str
    domain: str
    prompt_ids: list[int]
    output_ids: list[int]
    ts: float | None = None
    temperature: float | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> Sample:
        return cls(**{k: obj.get(k) for k in cls.__dataclass_fields__})

    def as_sequence(self) -> dict[str, Any]:
        """The form the offline recipe's helpers take (prompt_ids, output_ids)."""
        return {"id": self.key, "domain": self.domain, "prompt_ids": self.prompt_ids,
                "output_ids": self.output_ids}


def record_key(writer: str, record: dict[str, Any]) -> str:
    canonical = json.dumps(record, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(f"{writer}\n{canonical}".encode()).hexdigest()[:32]


def _ids(value: Any) -> tuple[list[int] | None, str | None]:
    """A flat list of token ids, or why it is not one."""
    if value is None:
        return None, "missing"
    if not isinstance(value, list):
        return None, f"a {type(value).__name__}, not a list"
    if value and isinstance(value[0], list):
        return None, "a batch of requests (one line per request is needed)"
    if any(v == "..." for v in value):
        return None, "truncated by the logger (use --log-requests-level 3)"
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value):
        return None, "not a list of token ids"
    return value, None


def _domain(value: Any) -> str:
    return value if isinstance(value, str) and value else UNTAGGED


def _timestamp(value: Any) -> float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str):
        try:
            return dt.datetime.fromisoformat(value).timestamp()
        except ValueError:
            return None
    return None


def sglang_sample(writer: str, obj: dict[str, Any]) -> tuple[Sample | None, str | None]:
    """A finished-request object of SGLang's JSON request log -> (sample, why not)."""
    rid = obj.get("rid")
    if not isinstance(rid, str) or not rid:
        return None, "rid is not one request id (batched request?)"
    req, out = obj.get("obj"), obj.get("out")
    if not isinstance(req, dict) or not isinstance(out, dict):
        return None, "obj and out must be objects"
    prompt, why = _ids(req.get("input_ids"))
    if prompt is None:
        return None, f"obj.input_ids is {why}"
    output, why = _ids(out.get("output_ids"))
    if output is None:
        return None, f"out.output_ids is {why}"
    sp = req.get("sampling_params") if isinstance(req.get("sampling_params"), dict) else {}
    custom = sp.get("custom_params") if isinstance(sp.get("custom_params"), dict) else {}
    temp = sp.get("temperature")
    temp = float(temp) if isinstance(temp, (int, float)) and not isinstance(temp, bool) else None
    return Sample(record_key(writer, obj), "sglang", writer, rid, _domain(custom.get("domain")),
                  prompt, output, _timestamp(obj.get("timestamp")), temp), None


def iter_sglang_log(path: Path, writer: str, report: ReadReport) -> Iterator[Sample]:
    """Finished requests of one SGLang request-log file; other events are passed over."""
    try:
        f = open(path, "rb")
    except OSError as e:
        report.skip(str(path), UNREADABLE, str(e))
        return
    with f:
        for lineno, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            if not raw.endswith(b"\n"):
                report.torn += 1  # SGLang is mid-line: the next round reads it whole
                continue
            where = f"{path}:{lineno}"
            head = raw[:200]
            if b"] Finish: " in head:
                report.skip(where, TEXT_FORMAT, "text request log; run SGLang with "
                            "--log-requests-format json")
                continue
            if FINISHED.encode() not in head:
                continue  # request.received and other events
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                report.skip(where, BAD_UTF8, f"byte {raw[e.start]:#04x} at column {e.start + 1}")
                continue
            start = text.find("{")
            try:
                obj = json.loads(text[start:]) if start >= 0 else None
            except (json.JSONDecodeError, RecursionError) as e:
                report.skip(where, BAD_JSON, str(e)[:200])
                continue
            if not isinstance(obj, dict):
                report.skip(where, BAD_JSON, "no JSON object after the time stamp")
                continue
            if obj.get("event") != FINISHED:
                continue
            sample, why = sglang_sample(writer, obj)
            if sample is None:
                report.skip(where, BAD_SCHEMA, why)
                continue
            report.records += 1
            yield sample


def traffic_sample(writer: str, record: dict[str, Any]) -> Sample:
    """A record of the project's format (already schema-checked by iter_records) -> Sample."""
    sampling = record.get("sampling") or {}
    temp = sampling.get("temperature")
    return Sample(record_key(writer, record), "traffic", writer, record["id"],
                  _domain(record.get("domain")), list(record["prompt_ids"]),
                  list(record["output_ids"]), _timestamp(record.get("ts")),
                  float(temp) if isinstance(temp, (int, float)) else None)


def foreign(sample: Sample, digest: str | None, vocab_size: int | None,
            target_digest: str | None) -> tuple[str, str] | None:
    """(reason, detail) when ``sample`` belongs to another target, else None."""
    if target_digest and digest and digest != target_digest:
        return OTHER_TARGET, (f"served by target {digest[:12]}..., not this one "
                              f"({target_digest[:12]}...)")
    if vocab_size is not None:
        top = max(max(sample.prompt_ids, default=0), max(sample.output_ids, default=0))
        if top >= vocab_size:
            return OUT_OF_VOCABULARY, (f"token id {top} is past the target's vocabulary of "
                                       f"{vocab_size}: traffic of another model?")
    return None


def scan_traffic(home: str | os.PathLike, report: ReadReport, include_partial: bool = True,
                 *, vocab_size: int | None = None,
                 target_digest: str | None = None) -> Iterator[Sample]:
    """Every usable record under `home/traffic/`, writer by writer, in file order.

    With ``vocab_size`` and ``target_digest`` (the target's config digest), records of another
    target are skipped into ``report`` (:data:`OUT_OF_VOCABULARY`, :data:`OTHER_TARGET`).
    """
    root = Path(home) / "traffic"
    if not root.is_dir():
        return

    def keep(sample: Sample, digest: str | None, where: str) -> bool:
        bad = foreign(sample, digest, vocab_size, target_digest)
        if bad is None:
            return True
        report.records -= 1
        report.skip(where, *bad)
        return False

    for wdir in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")):
        names = sorted(p.name for p in wdir.iterdir())
        if any(_SHARD_RE.match(n) for n in names):
            for rec in iter_records(wdir, include_partial=include_partial, report=report):
                sample = traffic_sample(wdir.name, rec)
                digest = rec.get("target_digest")
                if keep(sample, digest if isinstance(digest, str) else None,
                        f"{wdir}: record {sample.id}"):
                    yield sample
        for name in names:
            if SGLANG_LOG_RE.match(name):
                for sample in iter_sglang_log(wdir / name, wdir.name, report):
                    if keep(sample, None, f"{wdir / name}: request {sample.id}"):
                        yield sample


class Ledger:
    """Keys of the records earlier rounds consumed (`distill/consumed.keys`, one per line).

    Rewritten whole and atomically, so a crash leaves the old list or the new one.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)

    def load(self) -> set[str]:
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return set()
        return {line.strip() for line in text.splitlines() if line.strip()}

    def retain(self, present: set[str]) -> int:
        """Forget keys whose records are gone from the volume (the retention CronJob deletes old
        traffic), so the ledger stays the size of the traffic. Returns how many were dropped."""
        have = self.load()
        keep = have & present
        if len(keep) < len(have):
            write_text_atomic(self.path, "".join(k + "\n" for k in sorted(keep)))
        return len(have) - len(keep)

    def add(self, keys: Iterable[str]) -> int:
        """Adds keys; returns how many were new."""
        have = self.load()
        new = sorted(set(keys) - have)
        if new:
            lines = sorted(have) + new
            write_text_atomic(self.path, "".join(k + "\n" for k in lines))
        return len(new)


@dataclass
class Selection:
    train: list[Sample]
    eval: list[Sample]
    consumed: list[str]  # every new key seen: trained on, held out, too short or past the cap
    new: int  # new records seen
    too_short: int
    over_cap: int
    replay: list[Sample] = field(default_factory=list)  # earlier rounds' records, trained on again
    standing: list[Sample] = field(default_factory=list)  # earlier rounds' held-out records

    @property
    def usable(self) -> int:
        return len(self.train) + len(self.eval)


def _newest_first(s: Sample) -> tuple:
    return (-(s.ts if s.ts is not None else float("-inf")), s.key)


class _PerDomain:
    """At most ``cap`` samples of each domain, the ones ``order`` puts first: what the round
    needs of old traffic, without holding every old record of the volume in memory (a domain's
    list is cut back to ``cap`` whenever it reaches twice that)."""

    def __init__(self, cap: int, order):
        self.cap, self.order = cap, order
        self.kept: dict[str, list[Sample]] = {}

    def add(self, s: Sample) -> None:
        if self.cap <= 0:
            return
        kept = self.kept.setdefault(s.domain, [])
        kept.append(s)
        if len(kept) >= 2 * self.cap:
            kept.sort(key=self.order)
            del kept[self.cap:]

    def lists(self) -> dict[str, list[Sample]]:
        return {d: sorted(k, key=self.order)[:self.cap] for d, k in sorted(self.kept.items())}


def spread_over_domains(pools: dict[str, list[Sample]], n: int) -> list[Sample]:
    """``n`` samples taken in turn from each domain's pool (domains by name, each pool in its
    own order): a domain with little old traffic gives what it has and the others fill up."""
    out: list[Sample] = []
    queues = [list(p) for _, p in sorted(pools.items()) if p]
    i = 0
    while len(out) < n and queues:
        q = queues[i % len(queues)]
        out.append(q.pop(0))
        if not q:
            queues.remove(q)
        else:
            i += 1
    return out


def select_round(samples: Iterable[Sample], consumed: set[str], *, max_records: int,
                 eval_fraction: float, min_eval: int, max_eval: int,
                 min_output: int = 2, held_out: set[str] = frozenset(),
                 replay_share: float = 0.0, standing_per_domain: int = 0) -> Selection:
    """The new records of this round, their held-out split, and what it keeps of earlier rounds.

    Only records no earlier round consumed count as new. When more are new than
    ``max_records``, the newest are kept and the rest are consumed unused: stale traffic
    describes a deployment that has moved on. The held-out split is a function of the keys
    alone (the smallest hashes), so a resumed or repeated round holds out the same records.

    A round of one domain's traffic trains the drafter away from the others (in the closed-loop
    demo prose's live tau fell from 2.27 to 1.17 over three rounds of math). So, of the records
    earlier rounds consumed that are still on the volume:

    - ``replay_share`` x (new training records) are trained on again (``replay``), spread over
      their domains in turn, newest first within one; never a record an earlier round held out
      (its keys are in ``held_out``);
    - up to ``standing_per_domain`` of each domain's earlier held-out records (the smallest
      keys, so the same ones round after round) join the evaluation (``standing``): the gate
      then sees the domains this round's traffic lacks.
    """
    fresh: dict[str, Sample] = {}
    replay_cap = math.ceil(replay_share * max_records) if replay_share > 0 else 0
    pool = _PerDomain(replay_cap, _newest_first)
    standing = _PerDomain(standing_per_domain, lambda s: (s.key,))
    old: set[str] = set()
    for s in samples:
        if s.key not in consumed:
            fresh.setdefault(s.key, s)
        elif len(s.output_ids) >= min_output and s.key not in old:
            old.add(s.key)
            (standing if s.key in held_out else pool).add(s)
    usable = [s for s in fresh.values() if len(s.output_ids) >= min_output]
    too_short = len(fresh) - len(usable)
    usable.sort(key=lambda s: (s.ts if s.ts is not None else float("-inf"), s.key))
    over_cap = max(0, len(usable) - max_records)
    kept = usable[over_cap:]
    n_eval = min(max_eval, max(min_eval, round(eval_fraction * len(kept))), len(kept) // 4)
    by_key = sorted(kept, key=lambda s: s.key)
    held = {s.key for s in by_key[:n_eval]}
    train = [s for s in kept if s.key not in held]
    ev = [s for s in kept if s.key in held]
    replay = spread_over_domains(pool.lists(), math.ceil(replay_share * len(train)))
    standing_eval = [s for d in standing.lists().values() for s in d]
    return Selection(train, ev, sorted(fresh), len(fresh), too_short, over_cap, replay,
                     standing_eval)
