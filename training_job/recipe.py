"""A first drafter for any local Hugging Face causal LM: the offline DFlash recipe as a command.

    python -m training_job.dflash_offline --target DIR (--prompts FILE | --traffic HOME) \\
        (--home HOME | --save DIR) [options]          # or under torchrun, a rank per GPU

1. Prompts: a JSON-lines file (``prompt`` text, or chat ``messages``, or ``prompt_ids``; ``id``
   and ``domain`` optional), or the prompts of the traffic logged under ``HOME/traffic`` (both
   formats the distillation job reads; another target's records are skipped). Text goes through
   the target's chat template when it has one.
2. Regenerate: the target answers every prompt greedily (the drafter learns what the target
   says, not what a corpus says). Under torchrun every rank answers its share; each rank's
   answers go to ``WORK/regen.rank<r>.jsonl`` as they come, so a restarted run resumes.
3. A held-out share, chosen by key as the distillation job chooses (smallest hashes), is kept
   for the length head's recalibration and the evaluation.
4. Train a new drafter (``--layers`` Qwen3-style layers reading ``--target-layer-ids``, DFlash's
   default spread when absent, blocks of ``--block-size``) with the distillation job's own
   data-parallel, resumable loop (``training_job.opd.train``) and the recipe's loss: position-
   weighted CE on the regenerated tokens (``--loss sft``, gamma 7), AdamW with warmup and a
   cosine decay. The AdaFlash length head trains in the same steps on the detached states.
5. Recalibrate the head on the held-out records, measure tau per domain there (reference engine,
   greedy, whole blocks), and publish: ``--home`` makes it the volume's first version
   (``v000001``, with a manifest; refused where versions exist), ``--save`` writes a checkpoint
   directory with a manifest.

The mask token: ``--mask-token-id``, else the tokenizer's mask token, else the first embedding
row past the tokenizer's vocabulary (Qwen3's configs leave a few hundred such rows), else an
error that asks for ``--mask-token-id``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

from training_job.opd.workdir import JobError, _log, leave_process_group, report_failure


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = p.add_argument_group("data")
    g.add_argument("--target", required=True, help="target: a local directory or a hub id")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompts", metavar="FILE", help="JSON lines: prompt, messages or "
                                                      "prompt_ids (id and domain optional)")
    src.add_argument("--traffic", metavar="HOME", help="use the prompts of the traffic under "
                                                       "HOME/traffic")
    g.add_argument("--max-prompts", type=int, default=None, help="use at most this many")
    g.add_argument("--max-prompt-len", type=int, default=1024, help="prompt tokens kept")
    g.add_argument("--max-new-tokens", type=int, default=256, help="of each regenerated answer")
    g.add_argument("--gen-batch-size", type=int, default=16)
    o = p.add_argument_group("output")
    o.add_argument("--home", default=None, help="publish as this volume's first version")
    o.add_argument("--save", default=None, metavar="DIR",
                   help="write the checkpoint (and manifest) here instead")
    o.add_argument("--work", default=None, metavar="DIR",
                   help="regenerated data and checkpoints (default HOME/bootstrap/work, or "
                        "DIR.work next to --save); a rerun resumes there")
    o.add_argument("--report", default=None, metavar="PATH", help="write the summary JSON here")
    o.add_argument("--save-dtype", choices=("bfloat16", "float16", "float32"),
                   default="bfloat16")
    a = p.add_argument_group("the drafter")
    a.add_argument("--layers", type=int, default=1, help="draft layers (default 1)")
    a.add_argument("--block-size", type=int, default=16)
    a.add_argument("--target-layer-ids", default=None,
                   help="comma-separated target layers read (default: DFlash's spread)")
    a.add_argument("--mask-token-id", type=int, default=None)
    t = p.add_argument_group("training")
    t.add_argument("--loss", choices=("sft", "rkl"), default="sft",
                   help="sft: the recipe's CE on the regenerated tokens (default); rkl: OPD")
    t.add_argument("--epochs", type=int, default=3)
    t.add_argument("--batch-size", type=int, default=8, help="sequences per step, all ranks")
    t.add_argument("--anchors-per-seq", type=int, default=32)
    t.add_argument("--lr", type=float, default=6e-4)
    t.add_argument("--min-lr", type=float, default=6e-5)
    t.add_argument("--warmup", type=float, default=0.04, help="share of steps warming up")
    t.add_argument("--gamma", type=float, default=7.0)
    t.add_argument("--head-lr", type=float, default=2e-4)
    t.add_argument("--max-seq-len", type=int, default=2048)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--ckpt-every", type=int, default=50)
    e = p.add_argument_group("evaluation")
    e.add_argument("--heldout-fraction", type=float, default=0.05)
    e.add_argument("--min-heldout", type=int, default=8)
    e.add_argument("--max-heldout", type=int, default=64)
    e.add_argument("--eval-max-new-tokens", type=int, default=64)
    r = p.add_argument_group("runtime")
    r.add_argument("--device", default=None, help="default cuda:<LOCAL_RANK> if present, else cpu")
    r.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                   help="the target's (default float32 on CPU, bfloat16 on GPU)")
    r.add_argument("--threads", type=int, default=None)
    r.add_argument("--quiet", action="store_true")
    return p


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m training_job.dflash_offline",
                                description="Train a first DFlash drafter (with its AdaFlash "
                                            "length head) for a Hugging Face causal LM.")
    return add_arguments(p)


# ---------------------------------------------------------------------------------------------
# Prompts


def _key(rec_id: str) -> str:
    return hashlib.sha256(rec_id.encode()).hexdigest()[:32]


def encode_prompt(tokenizer, rec: dict) -> list[int]:
    """A prompt record's token ids: given ids as they are; text or messages through the chat
    template (a plain encoding where the tokenizer has none)."""
    if isinstance(rec.get("prompt_ids"), list):
        return [int(t) for t in rec["prompt_ids"]]
    messages = rec.get("messages") or [{"role": "user", "content": str(rec.get("prompt", ""))}]
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                             tokenize=False)
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    return tokenizer("\n".join(m["content"] for m in messages))["input_ids"]


def file_prompts(path: str, tokenizer, limit: int | None) -> list[dict]:
    out = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise JobError(f"{path}:{n}: not JSON ({e})") from None
            if not isinstance(rec, dict) or not any(k in rec for k in
                                                     ("prompt", "messages", "prompt_ids")):
                raise JobError(f"{path}:{n}: needs prompt, messages or prompt_ids")
            rid = str(rec.get("id", f"line{n}"))
            out.append({"id": rid, "domain": str(rec.get("domain") or "untagged"),
                        "prompt_ids": encode_prompt(tokenizer, rec)})
            if limit and len(out) >= limit:
                break
    return out


def traffic_prompts(home: str, target_dir: Path, limit: int | None) -> list[dict]:
    """The prompts of the traffic under HOME (another target's records are skipped)."""
    from sglang_adaflash.serving.traffic import ReadReport
    from training_job.opd.round import target_identity, target_vocab_size
    from training_job.opd.traffic import scan_traffic

    report = ReadReport()
    digest = target_identity(target_dir, "").get("config_digest")
    out, seen = [], set()
    for s in scan_traffic(home, report, vocab_size=target_vocab_size(target_dir),
                          target_digest=digest):
        if s.key not in seen:
            seen.add(s.key)
            out.append({"id": s.key, "domain": s.domain, "prompt_ids": list(s.prompt_ids)})
        if limit and len(out) >= limit:
            break
    _log(f"traffic: {report.summary()}")
    return out


# ---------------------------------------------------------------------------------------------
# Regeneration


def regen_path(work: Path, rank: int) -> Path:
    return work / f"regen.rank{rank}.jsonl"


def read_regenerated(work: Path) -> dict[str, dict]:
    """Every answer written so far, by prompt id (a torn last line is dropped)."""
    done = {}
    for path in sorted(work.glob("regen.rank*.jsonl")):
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    break
                done[rec["id"]] = rec
    return done


def regenerate(target, prompts: list[dict], work: Path, *, rank: int, world: int,
               max_new_tokens: int, batch_size: int, stop_ids, progress: bool = False) -> None:
    """Greedy answers of this rank's share of ``prompts`` (every ``world``-th), appended to its
    shard as they come; prompts answered already (by any rank) are skipped. The offline
    recipe's regeneration (:func:`training_job.drafter_data.generate_greedy`: the reference
    engine in mode ``ar``, continuous batching, on the target's device)."""
    from training_job.drafter_data import generate_greedy

    done = read_regenerated(work)
    mine = [(p["id"], p["domain"], p["prompt_ids"]) for i, p in enumerate(prompts)
            if i % world == rank and p["id"] not in done]
    if mine:
        generate_greedy(target, mine, regen_path(work, rank), max_new_tokens, set(stop_ids),
                        batch_size, progress)


# ---------------------------------------------------------------------------------------------
# The drafter


def mask_token_id(tokenizer, target_config, requested: int | None) -> int:
    vocab = _text_config(target_config).vocab_size
    if requested is not None:
        mid = requested
    elif getattr(tokenizer, "mask_token_id", None) is not None:
        mid = tokenizer.mask_token_id
    elif vocab > len(tokenizer):
        mid = len(tokenizer)  # an embedding row no token uses
    else:
        raise JobError(f"no mask token: the tokenizer has none and uses all {vocab} embedding "
                       "rows; pass --mask-token-id (a token id the responses never use)")
    if not 0 <= mid < vocab:
        raise JobError(f"--mask-token-id {mid} is outside the target's vocabulary of {vocab}")
    return int(mid)


def _text_config(cfg):
    return getattr(cfg, "text_config", None) or cfg


def new_drafter(target_config, *, layers: int, block_size: int, layer_ids: list[int] | None,
                mask_id: int, seed: int):
    """A fresh drafter shaped for the target (every rank builds the same one from the seed),
    with the AdaFlash length head."""
    import torch

    from sglang_adaflash.drafter.config import DrafterConfig, default_target_layer_ids
    from sglang_adaflash.drafter.model import DFlashDrafter

    tc = _text_config(target_config)
    heads = tc.num_attention_heads
    rope = (getattr(tc, "rope_parameters", None) or {}).get("rope_theta") or \
        getattr(tc, "rope_theta", None) or 1_000_000.0
    n_target = tc.num_hidden_layers
    ids = layer_ids or default_target_layer_ids(n_target, layers)
    cfg = DrafterConfig(
        hidden_size=tc.hidden_size, intermediate_size=tc.intermediate_size,
        num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=getattr(tc, "num_key_value_heads", None) or heads,
        head_dim=getattr(tc, "head_dim", None) or tc.hidden_size // heads,
        vocab_size=tc.vocab_size, num_target_layers=n_target, mask_token_id=mask_id,
        target_layer_ids=list(ids), block_size=block_size,
        rms_norm_eps=getattr(tc, "rms_norm_eps", 1e-6), rope_theta=float(rope),
        max_position_embeddings=getattr(tc, "max_position_embeddings", 32768),
        use_length_head=True)
    try:
        cfg.validate()
    except ValueError as e:
        raise JobError(str(e)) from None
    torch.manual_seed(seed)
    return DFlashDrafter(cfg)


# ---------------------------------------------------------------------------------------------
# The run


def _check(args) -> list[str]:
    import math

    out = []
    if bool(args.home) == bool(args.save):
        out.append("pass exactly one of --home (publish) and --save (a directory)")
    for name in ("lr", "min_lr", "warmup", "gamma", "head_lr", "heldout_fraction"):
        v = getattr(args, name)
        if not (isinstance(v, float) and math.isfinite(v) and v >= 0):
            out.append(f"--{name.replace('_', '-')} must be a finite number >= 0, got {v}")
    if not 0 <= args.warmup < 1 or not 0 <= args.heldout_fraction < 1:
        out.append("--warmup and --heldout-fraction must lie in [0, 1)")
    for name in ("layers", "epochs", "batch_size", "anchors_per_seq", "max_new_tokens",
                 "gen_batch_size", "eval_max_new_tokens", "ckpt_every"):
        if getattr(args, name) < 1:
            out.append(f"--{name.replace('_', '-')} must be >= 1")
    if args.block_size < 2:
        out.append("--block-size must be >= 2")
    return out


def run(args) -> int:
    """The recipe from parsed arguments; returns the exit code (0, 1 failed, 2 bad arguments)."""
    from training_job.distill import _init_distributed
    from training_job.opd.train import Parallel

    problems = _check(args)
    if problems:
        print("dflash_offline: error: " + "; ".join(problems), file=sys.stderr)
        return 2
    _init_distributed()
    par = Parallel.current()
    try:
        report = train_first_drafter(args, par)
        if par.rank == 0:
            data = json.dumps(report, sort_keys=True)
            if args.report:
                from training_job.opd.report import write_report

                write_report(args.report, data.encode())
            print(data, flush=True)
        return 0
    except (JobError, OSError, ValueError, RuntimeError) as e:
        report_failure(e, prog="dflash_offline", rank=par.rank, report=args.report)
        return 1
    finally:
        leave_process_group()


def _work_dir(args) -> Path:
    if args.work:
        return Path(args.work)
    if args.home:
        return Path(args.home) / "bootstrap" / "work"
    return Path(str(args.save).rstrip("/") + ".work")


def train_first_drafter(args, par) -> dict:
    import torch
    from transformers import AutoTokenizer

    from training_job.opd.round import (
        job_device,
        load_target,
        resolve_target,
        stop_ids_and_pad,
        target_identity,
    )
    from training_job.opd.train import OPDConfig, steps_per_epoch, train_opd

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.home and par.rank == 0:
        from sglang_adaflash.drafter.store import list_versions

        if list_versions(args.home):
            raise JobError(f"{args.home}/drafters already holds {list_versions(args.home)[-1]}: "
                           "the recipe publishes a volume's first version (distil the next "
                           "ones with python -m training_job.distill)")
    device = job_device(args.device)
    target_dir = resolve_target(args.target)
    work = _work_dir(args)
    work.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(str(target_dir))
    target = load_target(target_dir, args.dtype, device)
    stops, pad = stop_ids_and_pad(target_dir, target)

    if args.prompts:
        prompts = file_prompts(args.prompts, tokenizer, args.max_prompts)
    else:
        prompts = traffic_prompts(args.traffic, target_dir, args.max_prompts)
    if not prompts:
        raise JobError("no prompts to answer: the prompts file or the traffic is empty")
    prompts = [{**p, "prompt_ids": p["prompt_ids"][-args.max_prompt_len:]} for p in prompts]
    t0 = time.time()
    regenerate(target, prompts, work, rank=par.rank, world=par.world,
               max_new_tokens=args.max_new_tokens, batch_size=args.gen_batch_size,
               stop_ids=stops, progress=not args.quiet and par.rank == 0)
    par.barrier()
    regen_s = time.time() - t0
    done = read_regenerated(work)
    train, held = _split(prompts, done, args)
    _log(f"regenerated {len(done)} answers ({regen_s:.0f} s); {len(train)} to train on, "
         f"{len(held)} held out; rank {par.rank}/{par.world}")

    mask_id = mask_token_id(tokenizer, target.config, args.mask_token_id)
    layer_ids = [int(x) for x in args.target_layer_ids.split(",")] \
        if args.target_layer_ids else None
    drafter = new_drafter(target.config, layers=args.layers, block_size=args.block_size,
                          layer_ids=layer_ids, mask_id=mask_id, seed=args.seed).to(device)
    seqs = [s.as_sequence() for s in train]
    total = args.epochs * steps_per_epoch(len(seqs), args.batch_size)
    cfg = OPDConfig(loss=args.loss, gamma=args.gamma, lr=args.lr, min_lr=args.min_lr,
                    schedule="cosine", warmup_steps=int(args.warmup * total),
                    epochs=args.epochs, batch_size=args.batch_size,
                    anchors_per_seq=args.anchors_per_seq, max_seq_len=args.max_seq_len,
                    seed=args.seed, ckpt_every=args.ckpt_every, head="joint",
                    head_lr=args.head_lr)
    training = train_opd(target, drafter, seqs, cfg, work / "train", pad_id=pad,
                         progress=not args.quiet)
    if par.rank != 0:
        return {}
    training["algorithm"] = "dflash-offline"
    training.update(records=len(train), eval_records=len(held), regenerated=len(done),
                    source="traffic" if args.traffic else "prompts")
    head = training.pop("length_head", None)
    evaluation = _calibrate_and_evaluate(target, drafter, held, head, cfg, args, pad, stops,
                                         device)
    training["length_head"] = head
    identity = target_identity(target_dir, args.target)
    version = _publish(args, drafter, identity, training, evaluation)
    return {"outcome": "Trained", "version": version, "target": args.target,
            "training": {k: training[k] for k in ("algorithm", "records", "steps",
                                                   "final_loss")},
            "eval": {"tau": evaluation.get("tau_by_domain", {})}}


def _split(prompts, done, args):
    """(train, held-out) Samples by the distillation job's rule (smallest keys held out)."""
    from training_job.opd.traffic import Sample, select_round

    samples = []
    for p in prompts:
        rec = done.get(p["id"])
        if rec is None:
            raise JobError(f"prompt {p['id']} has no answer after regeneration; rerun to "
                           "resume it")
        samples.append(Sample(key=_key(p["id"]), source="recipe", writer="-", id=p["id"],
                              domain=p["domain"], prompt_ids=rec["prompt_ids"],
                              output_ids=rec["output_ids"]))
    sel = select_round(samples, set(), max_records=len(samples) + 1,
                       eval_fraction=args.heldout_fraction, min_eval=args.min_heldout,
                       max_eval=args.max_heldout)
    if not sel.train:
        raise JobError("no answer of 2 tokens or more to train on: raise --max-new-tokens, or "
                       "check that the target does not stop at once")
    return sel.train, sel.eval


def _calibrate_and_evaluate(target, drafter, held, head, cfg, args, pad, stops,
                            device) -> dict:
    from training_job.opd.calibrate import calibrate_head
    from training_job.opd.evaluate import engine_results, tau_by_domain
    from training_job.opd.round import drafter_copy
    from training_job.opd.train import clip_sequence

    if not held:
        return {"method": "none: no held-out records"}
    if head is not None:
        head["calibration"] = calibrate_head(
            target, drafter, [clip_sequence(s.as_sequence(), cfg.max_seq_len) for s in held],
            pad_id=pad, anchors_per_seq=cfg.anchors_per_seq, batch_size=cfg.batch_size,
            seed=cfg.seed)
    dtype = next(target.parameters()).dtype
    rows = engine_results(target, drafter_copy(drafter, dtype, device), held,
                          max_new_tokens=args.eval_max_new_tokens,
                          max_prompt_len=args.max_seq_len, stop_ids=stops)
    return {"method": "reference engine, mode dflash (whole block), greedy, the recipe's "
                      f"held-out prompts, at most {args.eval_max_new_tokens} new tokens each",
            "parent": None, "tau_by_domain": tau_by_domain(rows),
            "records_by_domain": {d: sum(1 for r in rows if r[1] == d)
                                  for d in sorted({r[1] for r in rows})}}


def _publish(args, drafter, identity, training, evaluation) -> str:
    import torch

    from training_job.opd.round import publish

    if args.home:
        return publish(Path(args.home), drafter, None, identity, training, evaluation,
                       dtype_name=args.save_dtype)
    from sglang_adaflash.drafter.checkpoint import write_checkpoint
    from sglang_adaflash.drafter.manifest import build_manifest
    from sglang_adaflash.fsio import write_json_atomic

    dtype = getattr(torch, args.save_dtype)
    state = {k: v.detach().to("cpu", dtype) for k, v in drafter.state_dict().items()}
    out = write_checkpoint(args.save, drafter.config, state, overwrite=True)
    manifest = build_manifest(out, version="v000001", parent=None, target=identity,
                              training=training, eval=evaluation)
    write_json_atomic(out / "manifest.json", manifest, sort_keys=True)
    return "v000001"


def main(argv: list[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
