"""The distillation job: one on-policy round from served traffic to a published drafter version.

Run by the operator as (docs/contracts.md, "Distillation job")::

    python -m training_job.distill --home /var/lib/adaflash --target <target> \\
        --parent <fleet version> --min-records <N> --report /dev/termination-log [extra args]

and by hand as ``adaflash distill``; under ``torchrun`` every rank trains and rank 0 does the
rest. A round:

1. takes the volume's distillation lock (`distill/.lock`): one job per volume;
2. selects the records no earlier round consumed, from both traffic formats; fewer than
   ``--min-records`` usable ones is a failure (the contract has no "nothing to do" outcome);
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
``--max-rounds``); 1 failed (the reason is on stderr and in the report file); 2 bad arguments.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import sys
import time
import uuid
from collections import Counter
from dataclasses import asdict
from pathlib import Path
from typing import Any

DEFAULT_HOME = "/var/lib/adaflash"
WORK_NAME = "work"
LOCK_NAME = ".lock"
LEDGER_NAME = "consumed.keys"


class JobError(RuntimeError):
    """A round that cannot go on; the message is the one line the operator shows."""


class NotEnoughRecords(JobError):
    """Too little new traffic: a failure for one round, a reason to wait for ``--follow``."""


class GateRejected(JobError):
    """The candidate missed ``--require-gain``; its records are consumed, nothing published."""


# ---------------------------------------------------------------------------------------------
# Arguments


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The job's options (shared by `python -m training_job.distill` and `adaflash distill`)."""
    g = p.add_argument_group("the operator's contract")
    g.add_argument("--home", default=os.environ.get("ADAFLASH_HOME", DEFAULT_HOME),
                   help="shared volume (default $ADAFLASH_HOME, else /var/lib/adaflash)")
    g.add_argument("--target", required=True,
                   help="target model: a local directory or a Hugging Face id")
    g.add_argument("--parent", default="",
                   help="version to distil from, or 'latest' (the default: the one "
                        "drafters/latest names)")
    g.add_argument("--min-records", type=int, default=128,
                   help="fail unless at least this many new usable records exist (default 128)")
    g.add_argument("--report", default=None, metavar="PATH",
                   help="write the JSON report (or, on failure, the reason) here")
    t = p.add_argument_group("training")
    t.add_argument("--loss", choices=("rkl", "fkl", "sft"), default=None,
                   help="rkl: CE on the target argmax + clipped reverse KL (OPD, the default); "
                        "fkl: the same with forward KL; sft: plain CE on the response (OSD)")
    t.add_argument("--algorithm", choices=("opd", "osd"), default=None,
                   help="deprecated alias: opd = --loss rkl, osd = --loss sft")
    t.add_argument("--alpha", type=float, default=0.8, help="weight of the CE term (default 0.8)")
    t.add_argument("--tau", type=float, default=0.01,
                   help="entry-wise clip of the normalised reverse KL (default 0.01)")
    t.add_argument("--temperature", type=float, default=1.0, help="of the KL term (default 1)")
    t.add_argument("--gamma", type=float, default=7.0, help="position decay (default 7)")
    t.add_argument("--lr", type=float, default=3e-4, help="AdamW learning rate (default 3e-4)")
    t.add_argument("--epochs", type=int, default=2, help="passes over the round (default 2)")
    t.add_argument("--batch-size", type=int, default=8,
                   help="sequences per step over all ranks (default 8)")
    t.add_argument("--anchors-per-seq", type=int, default=24, help="blocks per sequence (default 24)")
    t.add_argument("--grad-clip", type=float, default=1.0, help="global grad-norm clip (default 1)")
    t.add_argument("--max-seq-len", type=int, default=1024,
                   help="prompt + response tokens kept per record (default 1024)")
    t.add_argument("--head-steps", type=int, default=50,
                   help="length-head refit steps after the drafter (default 50; 0 = keep it)")
    t.add_argument("--head-lr", type=float, default=2e-4)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--ckpt-every", type=int, default=20, help="checkpoint every N steps (default 20)")
    d = p.add_argument_group("data and evaluation")
    d.add_argument("--max-records", type=int, default=4096,
                   help="newest new records used; older new ones are consumed unused (default 4096)")
    d.add_argument("--eval-fraction", type=float, default=0.1,
                   help="share of the round held out for the evaluation (default 0.1)")
    d.add_argument("--min-eval-records", type=int, default=8)
    d.add_argument("--max-eval-records", type=int, default=64)
    d.add_argument("--eval-max-new-tokens", type=int, default=64)
    d.add_argument("--eval-batch-size", type=int, default=16)
    d.add_argument("--require-gain", type=float, default=None, metavar="G",
                   help="fail without publishing unless mean held-out tau >= parent's * (1 + G) "
                        "(default: always publish and leave the gate to the operator)")
    r = p.add_argument_group("runtime")
    r.add_argument("--device", default=None, help="default: cuda:<LOCAL_RANK> if available, else cpu")
    r.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                   help="the target's dtype (default float32 on CPU, bfloat16 on GPU); "
                        "the drafter always trains in float32")
    r.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    r.add_argument("--quiet", action="store_true", help="no progress bars")
    f = p.add_argument_group("follow mode")
    f.add_argument("--follow", action="store_true",
                   help="keep running rounds as traffic arrives, each from the version the "
                        "previous one published, until SIGTERM/SIGINT or --max-rounds")
    f.add_argument("--poll-interval", type=float, default=5.0, metavar="SECONDS",
                   help="with --follow: wait this long between looks at the traffic (default 5)")
    f.add_argument("--max-rounds", type=int, default=None, metavar="R",
                   help="with --follow: stop after R rounds that trained (default: no limit)")
    return p


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m training_job.distill",
                                description="One on-policy distillation round of the drafter.")
    return add_arguments(p)


def opd_config(args) -> Any:
    from training_job.opd.train import ALGORITHM_ALIASES, OPDConfig

    loss = args.loss
    if args.algorithm is not None:
        alias = ALGORITHM_ALIASES[args.algorithm]
        if loss is not None and loss != alias:
            raise JobError(f"--algorithm {args.algorithm} (deprecated) means --loss {alias}, "
                           f"which contradicts --loss {loss}; pass --loss alone")
        loss = alias
    try:
        return OPDConfig(loss=loss or "rkl", alpha=args.alpha, tau=args.tau,
                         temperature=args.temperature, gamma=args.gamma, lr=args.lr,
                         epochs=args.epochs, batch_size=args.batch_size,
                         anchors_per_seq=args.anchors_per_seq, grad_clip=args.grad_clip,
                         max_seq_len=args.max_seq_len, seed=args.seed,
                         ckpt_every=max(1, args.ckpt_every), head_steps=args.head_steps,
                         head_lr=args.head_lr)
    except ValueError as e:
        raise JobError(str(e)) from None


# ---------------------------------------------------------------------------------------------
# Small helpers


def _log(msg: str) -> None:
    print(f"distill: {msg}", file=sys.stderr, flush=True)


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError):
        return None


def _write_json(path: Path, obj: Any) -> None:
    from sglang_adaflash.fsio import write_json_atomic

    write_json_atomic(path, obj, sort_keys=True)


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
# The round's state on the volume


def _fingerprint(args, cfg, parent: str, target: dict) -> dict[str, Any]:
    """What a resumed round must share with the one that started (else it starts over)."""
    c = asdict(cfg)
    c.pop("ckpt_every", None)
    return {"parent": parent, "target": target.get("config_digest"), "config": c,
            "selection": {"max_records": args.max_records, "eval_fraction": args.eval_fraction,
                          "min_eval": args.min_eval_records, "max_eval": args.max_eval_records},
            "eval": {"max_new_tokens": args.eval_max_new_tokens}}


def prepare_round(home: Path, work: Path, args, cfg, parent: str, target: dict) -> dict:
    """Resume the round in ``work`` if it matches, else select a new one. Returns round.json."""
    from sglang_adaflash.serving.traffic import ReadReport
    from training_job.opd.traffic import Ledger, scan_traffic, select_round

    fingerprint = _fingerprint(args, cfg, parent, target)
    state = _read_json(work / "round.json")
    if state is not None:
        if state.get("fingerprint") == fingerprint or (work / "published.json").exists():
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
    consumed = ledger.load()
    present: set[str] = set()

    def seen(samples):
        for s in samples:
            present.add(s.key)
            yield s

    sel = select_round(seen(scan_traffic(home, report)), consumed, max_records=args.max_records,
                       eval_fraction=args.eval_fraction, min_eval=args.min_eval_records,
                       max_eval=args.max_eval_records)
    dropped = ledger.retain(present)
    if dropped:
        _log(f"forgot {dropped} consumed keys whose records are no longer on the volume")
    _log(f"traffic: {report.summary()}; {sel.new} new records, {sel.usable} usable "
         f"({sel.too_short} too short, {sel.over_cap} older ones past --max-records)")
    if sel.usable < args.min_records:
        raise NotEnoughRecords(f"only {sel.usable} new usable traffic records under {home}/traffic "
                       f"(need --min-records {args.min_records}; {sel.new} new, "
                       f"{report.skipped_total} lines skipped)")
    if not sel.eval:
        raise NotEnoughRecords("no record left to hold out for the evaluation; lower --min-eval-records "
                       "or wait for more traffic")
    tmp = work.with_name(f".{work.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    with open(tmp / "buffer.jsonl", "w", encoding="utf-8") as f:
        for split, samples in (("train", sel.train), ("eval", sel.eval)):
            for s in samples:
                f.write(json.dumps({"split": split, **s.to_json()}) + "\n")
    (tmp / LEDGER_NAME).write_text("".join(k + "\n" for k in sel.consumed))
    state = {
        "id": uuid.uuid4().hex, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "fingerprint": fingerprint,
        "traffic": {"new": sel.new, "train": len(sel.train), "eval": len(sel.eval),
                    "too_short": sel.too_short, "over_cap": sel.over_cap,
                    "skipped_lines": report.skipped_total, "torn_lines": report.torn},
    }
    _write_json(tmp / "round.json", state)
    for f in tmp.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    work.parent.mkdir(parents=True, exist_ok=True)
    os.replace(tmp, work)
    return state


def load_buffer(work: Path):
    from training_job.opd.traffic import Sample

    train, ev = [], []
    with open(work / "buffer.jsonl", encoding="utf-8") as f:
        for line in f:
            obj = json.loads(line)
            (train if obj.pop("split") == "train" else ev).append(Sample.from_json(obj))
    return train, ev


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
    from sglang_adaflash.cli.loading import stop_token_ids

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

    from training_job.opd.train import Stopped, train_head, train_opd

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
