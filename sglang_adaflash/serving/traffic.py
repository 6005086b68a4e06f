"""Traffic records for on-policy distillation, as shards on the shared volume.

    $ADAFLASH_HOME/traffic/<writer>/<seq>.jsonl           closed shards (immutable)
    $ADAFLASH_HOME/traffic/<writer>/<seq>.jsonl.partial   the shard being written

The layout and the record format are a contract between processes that share only the volume
(docs/contracts.md). A writer appends one JSON object per line to its ``.partial`` shard and
closes it (flush, fsync, rename to ``.jsonl``) when it holds ``max_records`` records or is
``max_age_s`` old, and on :meth:`TrafficWriter.close`. A writer that restarts first closes the
shards a crash left behind, keeping only their valid records, so numbering and content stay
monotonic.

Record fields: ``id``, ``ts``, ``model``, ``drafter_version``, ``domain`` (optional tag from the
request), ``prompt_ids``, ``output_ids``, ``sampling`` (temperature, top_p, top_k),
``accept_lens``, ``finish_reason``; ``prompt_text`` / ``output_text`` only when the operator of
the service opts in (``include_text=True``).

Readers skip a line they cannot use (torn, not UTF-8, not JSON, not a record) instead of stopping
at it: one bad line on a shared volume must not cost every later record of that writer. What was
skipped, and where, is counted in a :class:`ReadReport` and logged, so loss is visible rather
than silent.

Who writes these shards: `adaflash serve`, one writer per server (sglang_adaflash/server/records.py).
SGLang pods log traffic with SGLang's own request log instead (docs/sglang.md). Readers go through
:func:`iter_records`; this module fixes the format both sides share.
"""

from __future__ import annotations

import io
import json
import logging
import os
import re
import threading
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..fsio import fsync_dir, write_bytes_atomic
from .metrics import MetricsSink, NullSink

logger = logging.getLogger(__name__)

SHARD_SUFFIX = ".jsonl"
PARTIAL_SUFFIX = ".jsonl.partial"
_SHARD_RE = re.compile(r"^(\d{8})\.jsonl(\.partial)?$")
_WRITER_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")

# Why a line was skipped (the keys of ReadReport.skipped).
BAD_UTF8 = "bad_utf8"
BAD_JSON = "bad_json"
NOT_OBJECT = "not_object"
BAD_SCHEMA = "bad_schema"
UNREADABLE = "unreadable"  # a whole shard that could not be opened or read

#: Default cap on the ``file:line: reason`` entries a report keeps; counts are never capped.
MAX_PROBLEMS = 50

_SAMPLING_KEYS = frozenset({"temperature", "top_p", "top_k"})
_OPTIONAL_STR_FIELDS = ("drafter_version", "finish_reason", "domain", "prompt_text", "output_text",
                        "target_digest")


def target_digest_of(target) -> str | None:
    """The config digest of a target directory (what records carry as ``target_digest``), or
    None when ``target`` is not a readable directory (a hub id)."""
    from ..drafter.manifest import ManifestError, target_fingerprint

    try:
        return target_fingerprint(target)["config_digest"] if Path(str(target)).is_dir() else None
    except (ManifestError, OSError, ValueError):
        return None


class TrafficError(ValueError):
    """A record or writer setting that cannot be written; the message says what to fix."""


def _is_count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def record_problem(record: dict[str, Any]) -> str | None:
    """Why ``record`` is not a usable traffic record, or None when it is.

    The writer refuses and the readers skip by this same rule, so a record that was written is
    never dropped on read, and a foreign or damaged line never reaches the training job.
    """
    rid = record.get("id")
    if not isinstance(rid, str) or not rid:
        return "needs a non-empty id string"
    if not isinstance(record.get("model"), str):
        return "model must be a string"
    for name in ("prompt_ids", "output_ids", "accept_lens"):
        values = record.get(name)
        if not isinstance(values, list) or not all(_is_count(v) for v in values):
            return f"{name} must be a list of ints >= 0"
    accepted, produced = sum(record["accept_lens"]), len(record["output_ids"])
    if accepted > produced + len(record["accept_lens"]):
        return f"accept_lens sum to {accepted} but only {produced} output tokens were produced"
    sampling = record.get("sampling")
    if not isinstance(sampling, dict):
        return "sampling must be an object"
    unknown = set(sampling) - _SAMPLING_KEYS
    if unknown:
        return f"sampling has unknown keys {sorted(unknown)}; expected temperature, top_p, top_k"
    ts = record.get("ts")
    if ts is not None and (isinstance(ts, bool) or not isinstance(ts, (int, float))):
        return "ts must be a number"
    for name in _OPTIONAL_STR_FIELDS:
        value = record.get(name)
        if value is not None and not isinstance(value, str):
            return f"{name} must be a string or null"
    return None


@dataclass
class TrafficRecord:
    id: str
    model: str
    drafter_version: str | None
    prompt_ids: list[int]
    output_ids: list[int]
    sampling: dict[str, Any]  # temperature, top_p, top_k
    accept_lens: list[int]  # per decode step: committed tokens (accepted proposals + bonus)
    finish_reason: str | None
    domain: str | None = None
    ts: float = field(default_factory=time.time)
    prompt_text: str | None = None
    output_text: str | None = None
    # The served target's config digest (drafter.manifest.config_digest), when the writer knows
    # it: the training job skips records of another target.
    target_digest: str | None = None

    def validate(self) -> None:
        problem = record_problem(self.to_json(include_text=True))
        if problem:
            raise TrafficError(f"traffic record {self.id!r}: {problem}")

    def to_json(self, include_text: bool) -> dict[str, Any]:
        out = {
            "id": self.id,
            "ts": self.ts,
            "model": self.model,
            "drafter_version": self.drafter_version,
            "domain": self.domain,
            "prompt_ids": self.prompt_ids,
            "output_ids": self.output_ids,
            "sampling": self.sampling,
            "accept_lens": self.accept_lens,
            "finish_reason": self.finish_reason,
        }
        if self.target_digest is not None:
            out["target_digest"] = self.target_digest
        if include_text:
            out["prompt_text"] = self.prompt_text
            out["output_text"] = self.output_text
        return out


@dataclass
class ReadReport:
    """What reading traffic shards kept and skipped, and where.

    Pass one to :func:`iter_records` or :func:`recover_partial` to account for records that
    did not come through; one report may be shared by several calls, and then its counts are
    their totals. ``torn`` counts the unterminated last line of a ``.partial`` shard: expected
    while a writer is mid-line or after it crashed, so it is kept apart from ``skipped``,
    which counts lines that are damaged or foreign (by reason: :data:`BAD_UTF8`,
    :data:`BAD_JSON`, :data:`NOT_OBJECT`, :data:`BAD_SCHEMA`, or :data:`UNREADABLE` for a
    whole shard). ``problems`` holds the first ``max_problems`` as ``file:line: reason: detail``.
    """

    records: int = 0
    torn: int = 0
    skipped: Counter = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)
    max_problems: int = MAX_PROBLEMS

    @property
    def skipped_total(self) -> int:
        return sum(self.skipped.values())

    def skip(self, where: str, reason: str, detail: str) -> None:
        self.skipped[reason] += 1
        if len(self.problems) < self.max_problems:
            self.problems.append(f"{where}: {reason}: {detail}")

    def summary(self) -> str:
        parts = [f"{self.records} records"]
        if self.skipped:
            by_reason = ", ".join(f"{k} {v}" for k, v in sorted(self.skipped.items()))
            parts.append(f"{self.skipped_total} lines skipped ({by_reason})")
        if self.torn:
            parts.append(f"{self.torn} torn last lines of partial shards")
        text = "; ".join(parts)
        if self.problems:
            more = self.skipped_total - len(self.problems)
            text += "; " + "; ".join(self.problems) + (f"; and {more} more" if more > 0 else "")
        return text


def _shard_seq(path: Path) -> int | None:
    m = _SHARD_RE.match(path.name)
    return int(m.group(1)) if m else None


def _closed_name(path: Path) -> Path:
    return path.with_name(path.name[: -len(".partial")])


def _scan(
    lines: Iterable[bytes], shard: Path, partial: bool, report: ReadReport
) -> Iterator[tuple[bytes, dict[str, Any]]]:
    """The valid records of one shard's lines, each with its line as written (newline ended)."""
    for lineno, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        if not raw.endswith(b"\n"):  # only ever the last line
            if partial:
                report.torn += 1
                continue
            raw += b"\n"  # a closed shard whose last line lacks a newline: still judged whole
        where = f"{shard}:{lineno}"
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            report.skip(where, BAD_UTF8, f"byte {raw[e.start]:#04x} at column {e.start + 1}")
            continue
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            report.skip(where, BAD_JSON, str(e))
            continue
        except RecursionError:
            report.skip(where, BAD_JSON, "nested too deeply")
            continue
        if not isinstance(obj, dict):
            report.skip(where, NOT_OBJECT, f"a JSON {type(obj).__name__}, not an object")
            continue
        problem = record_problem(obj)
        if problem:
            report.skip(where, BAD_SCHEMA, problem)
            continue
        report.records += 1
        yield raw, obj


def recover_partial(path: Path, report: ReadReport | None = None) -> Path | None:
    """Close a ``.partial`` shard left by a crash, keeping only its valid records.

    A crash can leave more than a torn tail (a disk error, a foreign writer), and a closed shard
    is trusted by every reader, so everything :func:`iter_records` would skip is dropped here,
    counted in ``report`` and logged. Returns the closed shard, or None when no valid record was
    in it (the file is removed).
    """
    report = report if report is not None else ReadReport()
    skipped, torn = report.skipped_total, report.torn
    data = path.read_bytes()
    kept = [raw for raw, _ in _scan(io.BytesIO(data), path, True, report)]
    dropped = report.skipped_total - skipped
    if dropped or report.torn - torn:
        log = logger.warning if dropped else logger.info
        log("traffic: recovering %s dropped lines: %s", path, report.summary())
    if not kept:
        path.unlink()
        return None
    good = b"".join(kept)
    if good != data:
        write_bytes_atomic(path, good)  # the partial name throughout: never two copies
        _restrict(path, FILE_MODE)
    final = _closed_name(path)
    os.replace(path, final)
    fsync_dir(path.parent)
    return final


#: Traffic holds what users sent (token ids decode to the text), so only the writer's user and
#: group read it: the serving pods and the distillation job of a service share uid and fsGroup.
FILE_MODE = 0o640
DIR_MODE = 0o750


def _restrict(path: Path, mode: int) -> None:
    try:
        os.chmod(path, mode)
    except PermissionError:  # made by another user (a shared traffic/): theirs to set
        logger.debug("traffic: cannot set mode %o on %s", mode, path)


class TrafficWriter:
    """Appends traffic records to rotating shards of one writer (thread-safe)."""

    def __init__(
        self,
        home: str | os.PathLike,
        writer: str,
        *,
        max_records: int = 1000,
        max_age_s: float = 300.0,
        include_text: bool = False,
        sink: MetricsSink | None = None,
        clock=time.time,
    ):
        if not _WRITER_RE.match(writer):
            raise TrafficError(
                f"writer name {writer!r} must be 1-128 characters of letters, digits, '.', '_' "
                "or '-' (use the pod name)"
            )
        if max_records < 1:
            raise TrafficError(f"max_records must be at least 1, found {max_records}")
        self.dir = Path(home) / "traffic" / writer
        self.dir.mkdir(parents=True, exist_ok=True)
        for d in (self.dir.parent, self.dir):
            _restrict(d, DIR_MODE)
        self.max_records = max_records
        self.max_age_s = max_age_s
        self.include_text = include_text
        self.sink = sink or NullSink()
        self._clock = clock
        self._lock = threading.Lock()
        self._file = None
        self._path: Path | None = None
        self._count = 0
        self._opened_at = 0.0
        #: What closing the shards of a crashed predecessor kept and dropped.
        self.recovery = ReadReport()
        self.recovered = [
            recover_partial(p, self.recovery) for p in sorted(self.dir.glob(f"*{PARTIAL_SUFFIX}"))
        ]
        seqs = [s for s in (_shard_seq(p) for p in self.dir.iterdir()) if s is not None]
        self._next_seq = max(seqs, default=0) + 1

    def write(self, record: TrafficRecord) -> None:
        record.validate()
        line = json.dumps(record.to_json(self.include_text), separators=(",", ":")) + "\n"
        with self._lock:
            if self._file is not None and self._clock() - self._opened_at >= self.max_age_s:
                self._close_shard()
            if self._file is None:
                self._open_shard()
            self._file.write(line)
            self._file.flush()  # a reader of the partial shard sees whole lines
            self._count += 1
            if self._count >= self.max_records:
                self._close_shard()
        self.sink.count_traffic_records(1, record.domain)

    def rotate(self) -> Path | None:
        """Close the current shard now (e.g. on a timer); returns it, or None if none was open."""
        with self._lock:
            return self._close_shard()

    def close(self) -> None:
        self.rotate()

    def __enter__(self) -> TrafficWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _open_shard(self) -> None:
        self._path = self.dir / f"{self._next_seq:08d}{PARTIAL_SUFFIX}"
        self._next_seq += 1
        # "x": never reuse a name. The mode is explicit, not left to the umask (see FILE_MODE).
        fd = os.open(self._path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
        os.fchmod(fd, FILE_MODE)
        self._file = open(fd, "w")
        self._count = 0
        self._opened_at = self._clock()

    def _close_shard(self) -> Path | None:
        if self._file is None:
            return None
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        final = self._path.with_name(self._path.name[: -len(".partial")])
        os.replace(self._path, final)
        fsync_dir(self.dir)
        self._file, self._path = None, None
        return final


def _open_shard(shard: Path, partial: bool) -> tuple[Any, Path, bool]:
    """Open a listed shard; a ``.partial`` one closed since the listing is read under its new name."""
    try:
        return open(shard, "rb"), shard, partial
    except FileNotFoundError:
        if not partial:
            raise
        closed = _closed_name(shard)
        return open(closed, "rb"), closed, False


def iter_records(
    directory: str | os.PathLike,
    *,
    include_partial: bool = False,
    report: ReadReport | None = None,
) -> Iterator[dict]:
    """Valid records of one writer's shards, in order, past any line that is not one.

    Each skipped line is counted in ``report`` (pass one in to see why records are missing) and
    a summary is logged when anything was skipped.
    """
    report = report if report is not None else ReadReport()
    skipped = report.skipped_total
    directory = Path(directory)
    shards = sorted(
        (p for p in directory.iterdir() if _shard_seq(p) is not None),
        key=lambda p: (_shard_seq(p), p.name),
    )
    try:
        for shard in shards:
            partial = shard.name.endswith(".partial")
            if partial and not include_partial:
                continue
            try:
                f, shard, partial = _open_shard(shard, partial)
            except OSError as e:
                report.skip(str(shard), UNREADABLE, str(e))
                continue
            with f:
                try:
                    for _, record in _scan(f, shard, partial, report):
                        yield record
                except OSError as e:
                    report.skip(str(shard), UNREADABLE, str(e))
    finally:
        if report.skipped_total > skipped:
            logger.warning("traffic: reading %s skipped lines: %s", directory, report.summary())
