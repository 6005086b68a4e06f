"""The distillation job: one on-policy round from served traffic to a published drafter version.

Run by the operator as (docs/contracts.md, "Distillation job")::

    python -m training_job.distill --home /var/lib/adaflash --target <target> \\
        --parent <fleet version> --min-records <N> --report /dev/termination-log [extra args]

and by hand as ``adaflash distill``; under ``torchrun`` every rank trains and rank 0 does the
rest. A round:

1. takes the volume's distillation lock (`distill/.lock`): one job per volume;
2. selects the records no earlier round consumed, from both traffic formats; with fewer than
   ``--min-records`` usable ones there is no round: the report says ``"outcome":
   "NotEnoughRecords"`` and the job exits ``--idle-exit-code`` (3; the operator passes 0);
   a fixed share, chosen by key, is held out for evaluation;
3. trains the parent on the rest with OPD (or the OSD baseline), then refits the length head;
4. evaluates candidate and parent on the held-out prompts through the reference engine;
5. publishes the next version (manifest with the training and eval summary), records the
   consumed keys, and writes the report the operator reads.

Everything a round needs to continue lives in `distill/work/` on the volume: the selected
records, the training checkpoints, the evaluation, and once published the version's name. A
retried Job with the same parent, target and settings resumes there instead of starting over; a
round that had published but died before reporting only reports (the version it published is
found by the round id in its manifest, never published twice). A round is failed with a one-line
reason written to the report path, which Kubernetes shows as the termination message.

With ``--follow`` the job does not stop after one round: it waits for traffic and runs rounds as
it arrives (``training_job.opd.follow``).

Exit codes: 0 published and reported (with ``--follow``: stopped by a signal or
``--max-rounds``); 1 failed (the reason is on stderr and in the report file); 2 bad arguments;
3 (``--idle-exit-code``) not enough new records, nothing done, reported.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import sys
import time
from collections import Counter
from pathlib import Path

from training_job.opd.options import DEFAULT_HOME, add_arguments, build_parser, opd_config
from training_job.opd.workdir import (
    LEDGER_NAME,
    WORK_NAME,
    GateRejected,
    JobError,
    NotEnoughRecords,
    _log,
    _one_line,
    _read_json,
    _write_json,
    find_published,
    load_buffer,
    prepare_round,
)

__all__ = ["DEFAULT_HOME", "GateRejected", "JobError", "NotEnoughRecords", "add_arguments",
           "build_parser", "main", "opd_config", "run", "run_round"]

LOCK_NAME = ".lock"


@contextlib.contextmanager
def volume_lock(distill_dir: Path):
    """One distillation job per volume: a second one fails at once instead of racing."""
    import fcntl

    distill_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(distill_dir / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise JobError(f"another distillation job holds {distill_dir / LOCK_NAME}; "
                           "at most one runs per volume") from None
        yield
    finally:
        os.close(fd)


def resolve_target(target: str) -> Path:
    """A local directory for ``--target`` (a Hugging Face id is fetched into HF_HOME)."""
    p = Path(target)
    if p.is_dir():
        return p
    if p.is_absolute() or target.startswith("."):
        raise JobError(f"target directory {target} does not exist")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id=target))
    except Exception as e:  # noqa: BLE001 - hub errors come in many types
        raise JobError(f"target {target!r} is neither a directory nor a model the hub can "
                       f"give ({_one_line(e)})") from None


def resolve_parent(home: Path, parent: str, target_dir: Path) -> tuple[str, dict]:
    """(version, manifest) of the parent, verified and checked against the target."""
    from sglang_adaflash.drafter.checkpoint import CheckpointError
    from sglang_adaflash.drafter.manifest import ManifestError, check_target
    from sglang_adaflash.drafter.store import latest_version, verify_version

    try:
        if not parent or parent == "latest":
            parent = latest_version(home) or ""
            if not parent:
                raise JobError(f"no parent: --parent is empty and {home}/drafters/latest names "
                               "no version; publish a first drafter (adaflash drafters publish)")
        manifest = verify_version(home, parent)
        check_target(manifest, target_dir)
    except (CheckpointError, ManifestError) as e:
        raise JobError(f"parent {parent}: {_one_line(e)}") from None
    return parent, manifest


def target_identity(target_dir: Path, name: str) -> dict[str, str]:
    from sglang_adaflash.drafter.manifest import target_fingerprint

    fp = target_fingerprint(target_dir)
    fp["name"] = name
    return fp


# ---------------------------------------------------------------------------------------------
# Models


def _device(args) -> str:
    import torch

    if args.device:
        return args.device
    if torch.cuda.is_available():
        return f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
    return "cpu"


def load_target(target_dir: Path, dtype_name: str | None, device: str):
    import torch
    from transformers import AutoModelForCausalLM

    if dtype_name is None:
        dtype_name = "float32" if device == "cpu" else "bfloat16"
    try:
        model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=getattr(torch, dtype_name))
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        raise JobError(f"target {target_dir} cannot be loaded: {_one_line(e)}") from None
    return model.to(device).eval()


def load_parent_drafter(home: Path, parent: str, device: str):
    import torch

    from sglang_adaflash.drafter.checkpoint import load_drafter
    from sglang_adaflash.drafter.store import version_path

    return load_drafter(version_path(home, parent), dtype=torch.float32, device=device)


def drafter_copy(drafter, dtype, device):
    """A detached copy for the engine (the trained one keeps float32 master weights)."""
    import torch

    from sglang_adaflash.drafter.model import DFlashDrafter

    with torch.device("meta"):
        copy = DFlashDrafter(drafter.config)
    state = {k: v.detach().to(device=device, dtype=dtype) for k, v in drafter.state_dict().items()}
    copy.load_state_dict(state, assign=True)
    return copy.eval()


def stop_ids_and_pad(target_dir: Path, model) -> tuple[tuple[int, ...], int]:
    from sglang_adaflash.launch.loading import stop_token_ids

    tokenizer = None
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(target_dir))
    except Exception:  # noqa: BLE001 - a target without a tokenizer still has a config
        tokenizer = None
    stops = stop_token_ids(tokenizer, model.config)
    pad = getattr(tokenizer, "pad_token_id", None)
    if pad is None:
        pad = getattr(model.config, "pad_token_id", None)
    return stops, int(pad or 0)


# ---------------------------------------------------------------------------------------------
# The round


def run_round(args, par, should_stop=None) -> dict | None:
    """Everything after argument parsing; returns the report on rank 0 (None elsewhere).

    ``should_stop`` (``--follow``'s signal flag) is asked during training and once more right
    before publishing; a yes raises ``Stopped`` with the round resumable in ``distill/work``.
    """
    import torch

    from training_job.opd.calibrate import calibrate_head
    from training_job.opd.train import Stopped, clip_sequence, train_head, train_opd

    home = Path(args.home)
    distill_dir = home / "distill"
    work = distill_dir / WORK_NAME
    cfg = opd_config(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = _device(args)
    target_dir = resolve_target(args.target)
    identity = target_identity(target_dir, args.target)
    parent, _ = resolve_parent(home, args.parent, target_dir)

    state = None
    if par.rank == 0:
        try:
            state = prepare_round(home, work, args, cfg, parent, identity)
        except JobError as e:
            _broadcast(par, {"error": str(e)})  # the other ranks stop too, instead of hanging
            raise
    state = _broadcast(par, state)
    if "error" in state:
        raise JobError(f"rank 0 failed: {state['error']}")
    round_id = state["id"]

    published = _read_json(work / "published.json")
    if published is None and par.rank == 0:
        found = find_published(home, round_id)
        if found is not None:
            published = {"version": found[0]}
            _write_json(work / "published.json", published)
    published = _broadcast(par, published)
    if published is not None:
        return finish(home, work, published["version"], args) if par.rank == 0 else None

    train, held = load_buffer(work)
    _log(f"round {round_id}: parent {parent}, {len(train)} records to train on, "
         f"{len(held)} held out, loss {cfg.loss}, {cfg.epochs} epochs, rank {par.rank}/{par.world}")
    target = load_target(target_dir, args.dtype, device)
    stops, pad = stop_ids_and_pad(target_dir, target)
    drafter = load_parent_drafter(home, parent, device)
    log_path = work / "log.jsonl"

    def log(rec):
        with open(log_path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"time": round(time.time(), 3), **rec}) + "\n")

    seqs = [s.as_sequence() for s in train]
    training = train_opd(target, drafter, seqs, cfg, work, pad_id=pad,
                         progress=not args.quiet, log=log, should_stop=should_stop)
    if par.rank != 0:
        return None
    head = train_head(target, drafter, seqs, cfg, work, pad_id=pad, progress=not args.quiet)
    if head is not None and args.head_calibration:
        head["calibration"] = calibrate_head(
            target, drafter, [clip_sequence(s.as_sequence(), cfg.max_seq_len) for s in held],
            pad_id=pad, anchors_per_seq=cfg.anchors_per_seq, batch_size=cfg.batch_size,
            seed=cfg.seed)
    ev = evaluate(work, args, target, drafter, home, parent, held, stops, device)
    gate = ev["gate"]
    if args.require_gain is not None and not gate["passed"]:
        # The same parent on the same records would give the same candidate: consume them, so
        # the next round trains on new traffic instead of resuming this one forever.
        consume(home, work)
        shutil.rmtree(work, ignore_errors=True)
        raise GateRejected(f"held-out tau {gate['tau']} does not beat the parent's "
                           f"{gate['parent_tau']} by {args.require_gain:.1%} (--require-gain); "
                           "nothing published, its records are consumed")
    if should_stop is not None and should_stop():
        raise Stopped("stopped before publishing; the round resumes from its evaluation")
    domains = Counter(s.domain for s in train)
    training.update({"records": len(train), "eval_records": len(held), "round": round_id,
                     "domains": dict(sorted(domains.items())), "traffic": state["traffic"],
                     "length_head": head})
    version = publish(home, drafter, parent, identity, training, ev["manifest_eval"])
    _write_json(work / "published.json", {"version": version})
    return finish(home, work, version, args)


def evaluate(work: Path, args, target, drafter, home: Path, parent: str, held, stops,
             device: str) -> dict:
    """Candidate and parent tau on the held-out records (cached in the work directory)."""
    from training_job.opd.evaluate import engine_tau, mean_tau, taus

    cached = _read_json(work / "eval.json")
    if cached is not None:
        return cached
    kw = dict(max_new_tokens=args.eval_max_new_tokens, max_prompt_len=args.max_seq_len,
              batch_size=args.eval_batch_size, stop_ids=stops)
    dtype = next(target.parameters()).dtype
    t0 = time.time()
    cand = engine_tau(target, drafter_copy(drafter, dtype, device), held, **kw)
    base = engine_tau(target, drafter_copy(load_parent_drafter(home, parent, device), dtype,
                                           device), held, **kw)
    tau, ptau = taus(cand), taus(base)
    common = sorted(set(tau) & set(ptau))
    m, pm = mean_tau({d: tau[d] for d in common}), mean_tau({d: ptau[d] for d in common})
    gain = args.require_gain or 0.0
    passed = m is not None and pm is not None and m >= pm * (1 + gain)
    _log(f"held-out tau {tau} against parent {ptau} ({time.time() - t0:.0f} s)")
    out = {
        "gate": {"tau": m, "parent_tau": pm, "min_gain": gain, "passed": passed},
        "manifest_eval": {
            "method": "reference engine, mode dflash (whole block), greedy, held-out traffic "
                      f"prompts, at most {args.eval_max_new_tokens} new tokens each",
            "parent": parent, "tau_by_domain": tau, "parent_tau_by_domain": ptau,
            "records_by_domain": {d: v["requests"] for d, v in cand.items()},
            "steps_by_domain": {d: v["steps"] for d, v in cand.items()},
            "gate": {"mean_tau": m, "parent_mean_tau": pm, "min_gain": gain, "passed": passed},
        },
    }
    _write_json(work / "eval.json", out)
    return out


def publish(home: Path, drafter, parent: str, identity: dict, training: dict, ev: dict) -> str:
    import torch

    from sglang_adaflash.drafter.checkpoint import read_config
    from sglang_adaflash.drafter.store import publish_version, version_path

    saved = read_config(version_path(home, parent)).torch_dtype or "float32"
    dtype = getattr(torch, saved)
    state = {k: v.detach().to("cpu", dtype) for k, v in drafter.state_dict().items()}
    for k, v in state.items():
        if not torch.isfinite(v).all():
            raise JobError(f"training diverged: weight {k} holds NaN or Inf; nothing published")
    training = {k: v for k, v in training.items() if v is not None}
    version = publish_version(home, drafter.config, state, target=identity, parent=parent,
                              training=training, eval=ev)
    _log(f"published {version} under {home}/drafters")
    return version


def finish(home: Path, work: Path, version: str, args) -> dict:
    """Record the consumed keys, write the report, drop the round's work directory."""
    from sglang_adaflash.drafter.store import verify_version
    from training_job.opd.report import build_report, encode_report, write_report

    manifest = verify_version(home, version)
    consume(home, work)
    report = build_report(manifest, target_name=args.target)
    weight = (manifest.get("eval") or {}).get("records_by_domain") or {}
    data = encode_report(report, weight)
    if args.report:
        write_report(args.report, data)
    if not getattr(args, "follow", False):  # --follow prints its own line per round
        print(data.decode(), flush=True)
    shutil.rmtree(work, ignore_errors=True)
    return json.loads(data)


def consume(home: Path, work: Path) -> None:
    """Add the round's keys to the ledger (idempotent: a re-run after a crash adds nothing)."""
    from training_job.opd.traffic import Ledger

    keys_file = work / LEDGER_NAME
    if keys_file.exists():
        keys = [k for k in keys_file.read_text().splitlines() if k]
        added = Ledger(home / "distill" / LEDGER_NAME).add(keys)
        _log(f"{added} traffic records marked consumed")


def _broadcast(par, obj):
    if par.world == 1:
        return obj
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _init_distributed():
    """torchrun sets WORLD_SIZE > 1: join the group (NCCL on GPUs, gloo on CPUs)."""
    import torch
    import torch.distributed as dist

    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend)


def run(args) -> int:
    """Run a round from parsed arguments; returns the exit code."""
    from training_job.opd.report import write_report
    from training_job.opd.train import Parallel

    if not math.isfinite(args.eval_fraction) or not 0 <= args.eval_fraction < 1:
        print("distill: error: --eval-fraction must lie in [0, 1)", file=sys.stderr)
        return 2
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
                                             created=now))
            if args.report:
                with contextlib.suppress(OSError):
                    write_report(args.report, data)
            print(data.decode(), flush=True)
        return args.idle_exit_code
    except (JobError, OSError, ValueError, RuntimeError) as e:
        reason = _one_line(e)
        if not isinstance(e, JobError):
            reason = f"{type(e).__name__}: {reason}"
        _log(f"error: {reason}")
        if par.rank == 0 and args.report:
            with contextlib.suppress(OSError):
                write_report(args.report, f"distill: {reason}"[:4000].encode())
        return 1
    finally:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
