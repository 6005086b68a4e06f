"""The round's state on the volume (`distill/work`): selection, resume, and the errors of a round.

Everything a round needs to continue lives in `distill/work/`: the selected records, the
training checkpoints, the evaluation, and once published the version's name. A retried job with
the same parent, target and settings resumes there instead of starting over.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
import uuid
from dataclasses import asdict
from pathlib import Path
from typing import Any

WORK_NAME = "work"
LEDGER_NAME = "consumed.keys"
HELDOUT_NAME = "heldout.keys"  # records a round held out: never trained on by a later one


class JobError(RuntimeError):
    """A round that cannot go on; the message is the one line the operator shows."""


class NotEnoughRecords(JobError):
    """Too little new traffic: no round yet. Not a failure: the job writes a report with
    ``"outcome": "NotEnoughRecords"`` and exits ``--idle-exit-code``; ``--follow`` waits."""

    def __init__(self, message: str, usable: int = 0, required: int = 0,
                 skipped: dict[str, int] | None = None):
        super().__init__(message)
        self.usable, self.required = usable, required
        self.skipped = dict(skipped or {})  # lines and records passed over, by reason


class GateRejected(JobError):
    """The candidate missed ``--require-gain``; its records are consumed, nothing published."""


def _log(msg: str) -> None:
    print(f"distill: {msg}", file=sys.stderr, flush=True)


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def report_failure(e: BaseException, *, prog: str, rank: int, report: str | None) -> None:
    """A failed run's one-line reason: on stderr, and (rank 0) in the report file, which
    Kubernetes shows as the termination message."""
    import contextlib

    from training_job.opd.report import write_report

    reason = _one_line(e)
    if not isinstance(e, JobError):
        reason = f"{type(e).__name__}: {reason}"
    print(f"{prog}: error: {reason}", file=sys.stderr, flush=True)
    if rank == 0 and report:
        with contextlib.suppress(OSError):
            write_report(report, f"{prog}: {reason}"[:4000].encode())


def leave_process_group() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError):
        return None


def _write_json(path: Path, obj: Any) -> None:
    from sglang_adaflash.fsio import write_json_atomic

    write_json_atomic(path, obj, sort_keys=True)


def _fingerprint(args, cfg, gate_cfg, parent: str, target: dict) -> dict[str, Any]:
    """What a resumed round must share with the one that started (else it starts over): the
    parent, the target, every training, selection, evaluation and gate setting."""
    c = asdict(cfg)
    c.pop("ckpt_every", None)
    return {"parent": parent, "target": target.get("config_digest"), "config": c,
            "selection": {"max_records": args.max_records, "eval_fraction": args.eval_fraction,
                          "min_eval": args.min_eval_records, "max_eval": args.max_eval_records,
                          "replay_share": args.replay_share,
                          "standing_eval": args.standing_eval_records},
            "eval": {"max_new_tokens": args.eval_max_new_tokens,
                     "head_calibration": bool(args.head_calibration)},
            "gate": asdict(gate_cfg)}


def prepare_round(home: Path, work: Path, args, cfg, gate_cfg, parent: str, target: dict,
                  vocab_size: int | None = None) -> dict:
    """Resume the round in ``work`` if it matches, else select a new one. Returns round.json.

    Records another target served (their ``target_digest`` differs from this target's) or
    holding token ids at or past ``vocab_size`` are skipped and counted like damaged lines.
    """
    from sglang_adaflash.serving.traffic import ReadReport
    from training_job.opd.traffic import Ledger, scan_traffic, select_round

    fingerprint = _fingerprint(args, cfg, gate_cfg, parent, target)
    state = _read_json(work / "round.json")
    if state is not None:
        if state.get("fingerprint") == fingerprint:
            _log(f"resuming round {state['id']} in {work}")
            return state
        _log(f"discarding the unfinished round in {work}: it was started with other settings "
             "or another parent")
    if work.exists():
        shutil.rmtree(work)
    for stale in work.parent.glob(f".{work.name}.*.tmp"):  # a selection a crash cut short
        shutil.rmtree(stale, ignore_errors=True)
    report = ReadReport()
    ledger = Ledger(home / "distill" / LEDGER_NAME)
    held_ledger = Ledger(home / "distill" / HELDOUT_NAME)
    consumed, held_out = ledger.load(), held_ledger.load()
    present: set[str] = set()

    def seen(samples):
        for s in samples:
            present.add(s.key)
            yield s

    sel = select_round(seen(scan_traffic(home, report, vocab_size=vocab_size,
                                         target_digest=target.get("config_digest"))),
                       consumed, max_records=args.max_records,
                       eval_fraction=args.eval_fraction, min_eval=args.min_eval_records,
                       max_eval=args.max_eval_records, held_out=held_out,
                       replay_share=args.replay_share,
                       standing_per_domain=args.standing_eval_records)
    dropped = ledger.retain(present)
    held_ledger.retain(present)
    if dropped:
        _log(f"forgot {dropped} consumed keys whose records are no longer on the volume")
    _log(f"traffic: {report.summary()}; {sel.new} new records, {sel.usable} usable "
         f"({sel.too_short} too short, {sel.over_cap} older ones past --max-records); "
         f"{len(sel.replay)} earlier records replayed, {len(sel.standing)} earlier held-out "
         "records evaluated")
    skipped = dict(sorted(report.skipped.items()))
    if sel.usable < args.min_records:
        raise NotEnoughRecords(f"only {sel.usable} new usable traffic records under "
                               f"{home}/traffic (need --min-records {args.min_records}; "
                               f"{sel.new} new, {report.skipped_total} lines skipped)",
                               sel.usable, args.min_records, skipped)
    if not sel.eval:
        raise NotEnoughRecords("no record left to hold out for the evaluation; lower "
                               "--min-eval-records or wait for more traffic", sel.usable,
                               args.min_records, skipped)
    tmp = work.with_name(f".{work.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    with open(tmp / "buffer.jsonl", "w", encoding="utf-8") as f:
        for split, samples in (("train", sel.train), ("replay", sel.replay), ("eval", sel.eval),
                               ("standing", sel.standing)):
            for s in samples:
                f.write(json.dumps({"split": split, **s.to_json()}) + "\n")
    (tmp / LEDGER_NAME).write_text("".join(k + "\n" for k in sel.consumed))
    (tmp / HELDOUT_NAME).write_text("".join(s.key + "\n" for s in sel.eval))
    state = {
        "id": uuid.uuid4().hex, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "fingerprint": fingerprint,
        "traffic": {"new": sel.new, "train": len(sel.train), "eval": len(sel.eval),
                    "replay": len(sel.replay), "standing_eval": len(sel.standing),
                    "too_short": sel.too_short, "over_cap": sel.over_cap,
                    "skipped_lines": report.skipped_total, "skipped": skipped,
                    "torn_lines": report.torn},
    }
    _write_json(tmp / "round.json", state)
    for f in tmp.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    work.parent.mkdir(parents=True, exist_ok=True)
    os.replace(tmp, work)
    return state


def load_buffer(work: Path):
    """(training records, held-out records) of the round: the new ones and, after them, those
    of earlier rounds (replayed; standing held-out)."""
    from training_job.opd.traffic import Sample

    parts: dict[str, list] = {"train": [], "replay": [], "eval": [], "standing": []}
    with open(work / "buffer.jsonl", encoding="utf-8") as f:
        for line in f:
            obj = json.loads(line)
            parts[obj.pop("split")].append(Sample.from_json(obj))
    return parts["train"] + parts["replay"], parts["eval"] + parts["standing"]


def find_published(home: Path, round_id: str) -> tuple[str, dict] | None:
    """The version this round already published, if a crash cut it off before it reported."""
    from sglang_adaflash.drafter.manifest import ManifestError, read_manifest
    from sglang_adaflash.drafter.store import list_versions, version_path

    for v in reversed(list_versions(home)):
        try:
            m = read_manifest(version_path(home, v))
        except ManifestError:
            continue
        if (m.get("training") or {}).get("round") == round_id:
            return v, m
    return None
