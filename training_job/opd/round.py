"""One distillation round, from the volume's traffic to a published, reported version.

The stages, each ending at a boundary a killed job resumes from (``boundary(stage)`` marks them;
tests kill the job there):

1. ``selected``: the round's records and held-out split are in ``distill/work/`` (one rename);
2. ``trained``: the drafter (and, by default, its length head) trained, checkpointed in the work
   directory;
3. ``head``: the head refit (``--head refit``) and recalibrated on the held-out records;
4. ``evaluated``: candidate and parent decoded the held-out prompts; tau and the gate's decision
   are in ``work/eval.json``;
5. ``published``: ``drafters/<version>/`` exists, its manifest naming the round's id;
6. ``recorded``: ``work/published.json`` names the version;
7. ``consumed``: the round's keys are in ``distill/consumed.keys``;
8. ``reported``: the report is written; then ``distill/work/`` is removed.

Exactly once: before anything else, and before ``--parent latest`` is resolved (a published
round moves ``latest``), a job that finds ``distill/work/`` of a round that published (by
``published.json`` or by the round id in a manifest) only records, consumes and reports that
version, whatever its ``--parent`` says. A round that did not publish resumes when its parent,
target and every setting match (the fingerprint), and starts over otherwise.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from collections import Counter
from pathlib import Path

from training_job.opd.options import gate_config, opd_config
from training_job.opd.workdir import (
    HELDOUT_NAME,
    LEDGER_NAME,
    WORK_NAME,
    GateRejected,
    JobError,
    _log,
    _one_line,
    _read_json,
    _write_json,
    find_published,
    load_buffer,
    prepare_round,
)

LOCK_NAME = ".lock"
STAGES = ("selected", "trained", "head", "evaluated", "published", "recorded", "consumed",
          "reported")


def boundary(stage: str) -> None:
    """A stage of the round is complete and on the volume (the kill tests stop the job here)."""


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
                               "no version; publish a first drafter (adaflash drafters import, "
                               "or python -m training_job.dflash_offline)")
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


def target_vocab_size(target_dir: Path) -> int | None:
    """The target's vocabulary (its embedding rows): token ids at or past it are foreign."""
    try:
        cfg = json.loads((Path(target_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    cfg = cfg.get("text_config", cfg) if isinstance(cfg, dict) else {}
    v = cfg.get("vocab_size")
    return v if isinstance(v, int) and v > 0 else None


# ---------------------------------------------------------------------------------------------
# Models


def job_device(requested: str | None) -> str:
    import torch

    if requested:
        return requested
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


def published_round(home: Path, work: Path) -> str | None:
    """The version the round in ``work`` published, if it did (rank 0)."""
    state = _read_json(work / "round.json")
    if state is None:
        return None
    done = _read_json(work / "published.json")
    if isinstance(done, dict) and done.get("version"):
        return done["version"]
    found = find_published(home, state.get("id", ""))
    if found is None:
        return None
    _log(f"round {state['id']} already published {found[0]}; reporting it")
    _write_json(work / "published.json", {"version": found[0]})
    boundary("recorded")
    return found[0]


def run_round(args, par, should_stop=None) -> dict | None:
    """Everything after argument parsing; returns the report on rank 0 (None elsewhere).

    ``should_stop`` (``--follow``'s signal flag) is asked during training and once more right
    before publishing; a yes raises ``Stopped`` with the round resumable in ``distill/work``.
    """
    import torch

    from training_job.opd.calibrate import calibrate_head
    from training_job.opd.train import Stopped, clip_sequence, train_head, train_opd

    home = Path(args.home)
    work = home / "distill" / WORK_NAME
    cfg, gate_cfg = opd_config(args), gate_config(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = job_device(args.device)
    target_dir = resolve_target(args.target)
    identity = target_identity(target_dir, args.target)

    # Exactly once: a round that published is reported, whatever --parent names now.
    done = _broadcast(par, published_round(home, work) if par.rank == 0 else None)
    if done is not None:
        return finish(home, work, done, args) if par.rank == 0 else None
    parent, _ = resolve_parent(home, args.parent, target_dir)

    state = None
    if par.rank == 0:
        try:
            state = prepare_round(home, work, args, cfg, gate_cfg, parent, identity,
                                  target_vocab_size(target_dir))
        except JobError as e:
            _broadcast(par, {"error": str(e)})  # the other ranks stop too, instead of hanging
            raise
        boundary("selected")
    state = _broadcast(par, state)
    if "error" in state:
        raise JobError(f"rank 0 failed: {state['error']}")
    round_id = state["id"]

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
    boundary("trained")
    head = training.pop("length_head", None) or train_head(
        target, drafter, seqs, cfg, work, pad_id=pad, progress=not args.quiet)
    if head is not None and args.head_calibration:
        head["calibration"] = calibrate_head(
            target, drafter, [clip_sequence(s.as_sequence(), cfg.max_seq_len) for s in held],
            pad_id=pad, anchors_per_seq=cfg.anchors_per_seq, batch_size=cfg.batch_size,
            seed=cfg.seed)
    boundary("head")
    ev = evaluate(work, args, gate_cfg, target, drafter, home, parent, held, stops, device)
    boundary("evaluated")
    gate = ev["manifest_eval"]["gate"]
    if gate_cfg.refuse and not gate["passed"]:
        # The same parent on the same records would give the same candidate: consume them, so
        # the next round trains on new traffic instead of resuming this one forever.
        consume(home, work)
        shutil.rmtree(work, ignore_errors=True)
        raise GateRejected(f"gate failed ({gate['reason']}): {gate['message']}; nothing "
                           "published (--require-gain), its records are consumed")
    if should_stop is not None and should_stop():
        raise Stopped("stopped before publishing; the round resumes from its evaluation")
    domains = Counter(s.domain for s in train)
    training.update({"records": len(train), "eval_records": len(held), "round": round_id,
                     "replay_records": state["traffic"].get("replay", 0),
                     "domains": dict(sorted(domains.items())), "traffic": state["traffic"],
                     "length_head": head})
    version = publish(home, drafter, parent, identity, training, ev["manifest_eval"])
    boundary("published")
    _write_json(work / "published.json", {"version": version})
    boundary("recorded")
    return finish(home, work, version, args)


def evaluate(work: Path, args, gate_cfg, target, drafter, home: Path, parent: str, held, stops,
             device: str) -> dict:
    """Candidate and parent on the held-out prompts, and the gate's decision (cached)."""
    from training_job.opd.evaluate import engine_results, tau_by_domain
    from training_job.opd.gate import decide

    cached = _read_json(work / "eval.json")
    if cached is not None:
        return cached
    kw = dict(max_new_tokens=args.eval_max_new_tokens, max_prompt_len=args.max_seq_len,
              batch_size=args.eval_batch_size, stop_ids=stops)
    dtype = next(target.parameters()).dtype
    t0 = time.time()
    cand = engine_results(target, drafter_copy(drafter, dtype, device), held, **kw)
    base = engine_results(target, drafter_copy(load_parent_drafter(home, parent, device), dtype,
                                               device), held, **kw)
    tau, ptau = tau_by_domain(cand), tau_by_domain(base)
    gate = decide(cand, base, gate_cfg)
    _log(f"held-out tau {tau} against parent {ptau} ({time.time() - t0:.0f} s); gate "
         f"{gate['reason']}: {gate['message']}")
    counts = Counter(domain for _, domain, _, _ in cand)
    steps = Counter()
    for _, domain, _, n in cand:
        steps[domain] += n
    out = {
        "manifest_eval": {
            "method": "reference engine, mode dflash (whole block), greedy, held-out traffic "
                      f"prompts, at most {args.eval_max_new_tokens} new tokens each",
            "parent": parent, "tau_by_domain": tau, "parent_tau_by_domain": ptau,
            "records_by_domain": dict(sorted(counts.items())),
            "steps_by_domain": dict(sorted(steps.items())),
            "gate": gate,
            # every prompt's (committed tokens, steps) for both: the gate can be recomputed
            "per_prompt": {"candidate": cand, "parent": base},
        },
    }
    _write_json(work / "eval.json", out)
    return out


def publish(home: Path, drafter, parent: str | None, identity: dict, training: dict,
            ev: dict | None, *, dtype_name: str | None = None) -> str:
    """Publish ``drafter`` as the next version, in its parent's dtype (or ``dtype_name``)."""
    import torch

    from sglang_adaflash.drafter.checkpoint import read_config
    from sglang_adaflash.drafter.store import publish_version, version_path

    saved = dtype_name or (read_config(version_path(home, parent)).torch_dtype if parent
                           else None) or "float32"
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
    boundary("consumed")
    report = build_report(manifest, target_name=args.target)
    weight = (manifest.get("eval") or {}).get("records_by_domain") or {}
    data = encode_report(report, weight)
    if args.report:
        write_report(args.report, data)
    if not getattr(args, "follow", False):  # --follow prints its own line per round
        print(data.decode(), flush=True)
    boundary("reported")
    shutil.rmtree(work, ignore_errors=True)
    return json.loads(data)


def consume(home: Path, work: Path) -> None:
    """Add the round's keys to the ledgers: every new key to consumed.keys, the held-out ones
    also to heldout.keys, which keeps them out of later rounds' replay (idempotent: a re-run
    after a crash adds nothing)."""
    from training_job.opd.traffic import Ledger

    for name, what in ((HELDOUT_NAME, "held out for good"), (LEDGER_NAME, "marked consumed")):
        keys_file = work / name
        if keys_file.exists():
            keys = [k for k in keys_file.read_text().splitlines() if k]
            added = Ledger(home / "distill" / name).add(keys)
            _log(f"{added} traffic records {what}")


def _broadcast(par, obj):
    if par.world == 1:
        return obj
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]
