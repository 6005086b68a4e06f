"""The distillation job: one on-policy round from served traffic to a published drafter version.

Run by the operator as (docs/contracts.md, "Distillation job")::

    python -m torch.distributed.run --nproc-per-node <gpus> -m training_job.distill \\
        --home /var/lib/adaflash --target <target> --parent <fleet version> \\
        --min-records <N> --report /dev/termination-log [extra args]

(plain ``python -m training_job.distill`` with one GPU or none), and by hand as ``adaflash
distill``; under ``torchrun`` every rank trains and rank 0 does the rest. A round
(``training_job.opd.round``):

1. takes the volume's distillation lock (`distill/.lock`): one job per volume;
2. selects the records no earlier round consumed, from both traffic formats; with fewer than
   ``--min-records`` usable ones there is no round: the report says ``"outcome":
   "NotEnoughRecords"`` and the job exits ``--idle-exit-code`` (3; the operator passes 0);
   a fixed share, chosen by key, is held out for evaluation;
3. trains the parent on the rest with OPD (or the OSD baseline), its length head with it;
4. evaluates candidate and parent on the held-out prompts through the reference engine, and
   gates the candidate (paired bootstrap over prompts, per-domain floor);
5. publishes the next version (manifest with the training, eval and gate summary), records the
   consumed keys, and writes the report the operator reads.

Everything a round needs to continue lives in `distill/work/` on the volume. A retried Job
resumes there; a round that had published is only reported, whatever ``--parent`` says (never
published twice). A round is failed with a one-line reason written to the report path, which
Kubernetes shows as the termination message.

With ``--follow`` the job does not stop after one round: it waits for traffic and runs rounds as
it arrives (``training_job.opd.follow``).

Exit codes: 0 published and reported (with ``--follow``: stopped by a signal or
``--max-rounds``); 1 failed (the reason is on stderr and in the report file); 2 bad arguments
(checked before anything is read or written); 3 (``--idle-exit-code``) not enough new records,
nothing done, reported.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from pathlib import Path

from training_job.opd.options import (
    DEFAULT_HOME,
    add_arguments,
    build_parser,
    check_arguments,
    opd_config,
)
from training_job.opd.round import (
    LOCK_NAME,
    run_round,
    stop_ids_and_pad,
    volume_lock,
)
from training_job.opd.workdir import (
    GateRejected,
    JobError,
    NotEnoughRecords,
    _log,
    _one_line,
    leave_process_group,
    report_failure,
)

__all__ = ["DEFAULT_HOME", "LOCK_NAME", "GateRejected", "JobError", "NotEnoughRecords",
           "add_arguments", "build_parser", "main", "opd_config", "run", "run_round",
           "stop_ids_and_pad", "volume_lock"]


def _init_distributed():
    """torchrun sets WORLD_SIZE > 1: join the group (NCCL on GPUs, gloo on CPUs)."""
    import torch
    import torch.distributed as dist

    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend)


def _refuse(args, problems: list[str]) -> int:
    from training_job.opd.report import write_report

    reason = "; ".join(problems)
    print(f"distill: error: {reason}", file=sys.stderr)
    if args.report and int(os.environ.get("RANK", "0")) == 0:
        with contextlib.suppress(OSError):
            write_report(args.report, f"distill: bad arguments: {reason}"[:4000].encode())
    return 2


def run(args) -> int:
    """Run a round from parsed arguments; returns the exit code."""
    from training_job.opd.report import write_report
    from training_job.opd.train import Parallel

    problems = check_arguments(args)
    if problems:
        return _refuse(args, problems)
    if getattr(args, "follow", False):
        from training_job.opd.follow import follow

        return follow(args)
    _init_distributed()
    par = Parallel.current()
    try:
        with volume_lock(Path(args.home) / "distill") if par.rank == 0 else \
                contextlib.nullcontext():
            run_round(args, par)
        return 0
    except NotEnoughRecords as e:
        # Not a failure: nothing was trained, published or consumed; the next Job (or round)
        # finds these records again together with the new ones.
        _log(f"no round: {_one_line(e)}")
        if par.rank == 0:
            from training_job.opd.report import encode_report, idle_report

            now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            data = encode_report(idle_report(parent=args.parent, usable=e.usable,
                                             required=e.required, message=_one_line(e),
                                             created=now, skipped=e.skipped))
            if args.report:
                with contextlib.suppress(OSError):
                    write_report(args.report, data)
            print(data.decode(), flush=True)
        return args.idle_exit_code
    except (JobError, OSError, ValueError, RuntimeError) as e:
        report_failure(e, prog="distill", rank=par.rank, report=args.report)
        return 1
    finally:
        leave_process_group()


def main(argv: list[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
