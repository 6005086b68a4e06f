"""``--follow``: the distillation job as a long-running worker that trains as traffic arrives.

One process holds the volume's distillation lock for as long as it runs and loops: look at the
traffic; with fewer than ``--min-records`` new usable records, sleep ``--poll-interval`` and look
again; otherwise run one round exactly as a one-shot job would (same selection, resume,
evaluation, gate and publishing code in ``training_job.distill``), print one JSON line, and go
on from the version it published.

Why the rounds reuse the one-shot code instead of keeping the models in memory: a round's state
lives on the volume (``distill/work``, the consumption ledger), so a follower that is killed and
restarted resumes exactly where a retried Job would, and the two modes cannot drift apart.

Stopping: SIGTERM or SIGINT sets a flag. While waiting the loop notices it within a fraction of
a second; during a round training stops after the current step (checkpointed) or, past training,
right before publishing, so nothing half-done is published and nothing is consumed; the next run
resumes that round from ``distill/work``. A second signal gets the default action.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import signal
import sys
import time
from pathlib import Path

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Stopper:
    """The flag the signal handlers set; the round and the waits poll it."""

    def __init__(self):
        self.signal: int | None = None
        self._previous: dict[int, object] = {}

    def _handle(self, signum, _frame):
        self.signal = signum
        _log(f"{signal.Signals(signum).name}: stopping after the current step "
             "(send it again to stop at once)")
        signal.signal(signum, self._previous.get(signum, signal.SIG_DFL))

    def __call__(self) -> bool:
        return self.signal is not None

    def __enter__(self):
        for s in STOP_SIGNALS:
            self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc):
        for s, h in self._previous.items():
            signal.signal(s, h)

    def sleep(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while not self() and time.monotonic() < end:
            time.sleep(min(0.1, max(0.0, end - time.monotonic())))


def _log(msg: str) -> None:
    print(f"distill: {msg}", file=sys.stderr, flush=True)


def _emit(line: dict) -> None:
    print(json.dumps(line, sort_keys=True), flush=True)


def pending_records(home: Path, args, *, vocab_size: int | None = None,
                    target_digest: str | None = None) -> int:
    """New usable records the next round would select (the same rule as the round's own)."""
    from sglang_adaflash.serving.traffic import ReadReport
    from training_job.opd.traffic import Ledger, scan_traffic, select_round
    from training_job.opd.workdir import LEDGER_NAME

    consumed = Ledger(home / "distill" / LEDGER_NAME).load()
    sel = select_round(scan_traffic(home, ReadReport(), vocab_size=vocab_size,
                                    target_digest=target_digest), consumed,
                       max_records=args.max_records, eval_fraction=args.eval_fraction,
                       min_eval=args.min_eval_records, max_eval=args.max_eval_records)
    return sel.usable


def follow(args) -> int:
    """Run rounds until a signal or ``--max-rounds``; returns the exit code (see distill.py).

    The arguments were checked already (``training_job.opd.options.check_arguments``)."""
    from training_job.opd.report import write_report
    from training_job.opd.round import (
        resolve_parent,
        resolve_target,
        run_round,
        target_identity,
        target_vocab_size,
        volume_lock,
    )
    from training_job.opd.train import Parallel, Stopped
    from training_job.opd.workdir import (
        WORK_NAME,
        GateRejected,
        JobError,
        NotEnoughRecords,
        _one_line,
        report_failure,
    )

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        print("distill: error: --follow runs in one process; start one round per torchrun "
              "instead", file=sys.stderr)
        return 2
    home = Path(args.home)
    work = home / "distill" / WORK_NAME
    # An explicit parent starts the chain; 'latest' (or none) is looked up again every round.
    chained = args.parent not in ("", "latest")
    parent = args.parent
    rounds, last_seen = 0, None
    par = Parallel()
    with Stopper() as stop:
        try:
            with volume_lock(home / "distill"):
                # bad input fails now, not after the first wait for traffic
                target_dir = resolve_target(args.target)
                resolve_parent(home, args.parent, target_dir)
                filters = {"vocab_size": target_vocab_size(target_dir),
                           "target_digest": target_identity(target_dir, args.target)
                           .get("config_digest")}
                while not stop() and (args.max_rounds is None or rounds < args.max_rounds):
                    if not (work / "round.json").exists():
                        n = pending_records(home, args, **filters)
                        if n < args.min_records:
                            if n != last_seen:
                                _log(f"waiting for traffic: {n} of {args.min_records} new "
                                     f"usable records under {home}/traffic")
                                last_seen = n
                            stop.sleep(args.poll_interval)
                            continue
                    last_seen = None
                    round_args = copy.copy(args)
                    round_args.parent = parent
                    t0 = time.time()
                    line = {"round": rounds + 1}
                    try:
                        report = run_round(round_args, par, should_stop=stop)
                    except NotEnoughRecords as e:  # traffic deleted since the look above
                        _log(_one_line(e))
                        stop.sleep(args.poll_interval)
                        continue
                    except GateRejected as e:
                        line.update(outcome="rejected", reason=_one_line(e))
                        if args.report:
                            with contextlib.suppress(OSError):
                                write_report(args.report, f"distill: {e}"[:4000].encode())
                    except Stopped as e:
                        _emit({**line, "outcome": "stopped", "reason": _one_line(e),
                               "seconds": round(time.time() - t0, 1)})
                        break
                    else:
                        line.update(outcome="published", version=report["version"],
                                    parent=report["parent"], report=report)
                        if chained:
                            parent = report["version"]
                    rounds += 1
                    line["seconds"] = round(time.time() - t0, 1)
                    _emit(line)
        except (JobError, OSError, ValueError, RuntimeError) as e:
            report_failure(e, prog="distill", rank=0, report=args.report)
            return 1
    why = f"{signal.Signals(stop.signal).name}" if stop() else f"--max-rounds {args.max_rounds}"
    _log(f"follow: stopped ({why}) after {rounds} round(s)")
    return 0
