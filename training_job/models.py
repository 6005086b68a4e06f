"""Build the embedded model pair from scratch: data -> tokenizer -> target -> unlikelihood ->
drafter -> refine -> problems (the drafter's second and third stages; the third is shipped).

    python -m training_job.models build --out DIR [--toy]
        [--stages data,tokenizer,target,unlikelihood,drafter,refine,problems]      # the default
    python -m training_job.models ship --from DIR       # copy into sglang_adaflash/assets/

Each stage writes its output atomically and is skipped when that output already exists, so an
interrupted build resumes where it stopped (the target also resumes from its own checkpoint).
``--toy`` shrinks every stage so the whole pipeline runs in seconds (CI).

Layout of DIR::

    data/            workloads (see training_job.data)
    tokenizer/       HF tokenizer (tokenizer.json, tokenizer_config.json)
    target_work/     target checkpoint (ckpt.pt) and train_log.jsonl
    target_mle/      HF model directory of the target after maximum likelihood
    unlikelihood_work/  the loop fine-tune's checkpoint (ckpt.pt) and train_log.jsonl
    target/          HF model directory of the target (target_mle/ fine-tuned against its own
                     greedy loops), with tokenizer files and training_report.json
    drafter_work/    regenerated responses (regen.*.jsonl), drafter and length-head checkpoints
    drafter/         DFlash-format drafter checkpoint (config.json, model.safetensors,
                     manifest.json) with the AdaFlash length head
    drafter_refined_work/, drafter_refined/   the second stage: drafter/ trained further on more
                     continuations at a lower learning rate
    drafter_problems_work/, drafter_problems/  the third stage: drafter_refined/ trained further
                     with the target's answers to typed problems in HumanEval's layout added
                     (the shipped drafter; `ship` copies the last stage present)
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import time
from dataclasses import replace
from pathlib import Path

from sglang_adaflash.assets import chat_format as cf

from .data import DOMAINS, DataConfig, build_all, load_split
from .dflash_offline import DrafterTrainConfig
from .target_lm import TargetConfig
from .target_unlikelihood import UnlikelihoodConfig

STAGES: tuple[str, ...] = ("data", "tokenizer", "target", "unlikelihood", "drafter", "refine", "problems")
# What `build` runs unless told: every stage, since the shipped drafter is the third stage's
# (problems; docs/models.md, Drafter). `ship` copies the last stage's drafter that exists.
DEFAULT_STAGES: tuple[str, ...] = STAGES
# The typed problems of the third stage (training_job/data/code_problems.py) come from this seed.
PROBLEMS_SEED = 7
# Held-out prompts per domain whose regenerated responses measure the drafter (block tau).
EVAL_PROMPTS = 48


def _train_records(data_dir: Path, domains=DOMAINS) -> list[dict]:
    return [r for d in domains for r in load_split(data_dir, d, "train")]


def stage_data(out: Path, toy: bool, seed: int | None = None,
               kjv_text: str | None = None) -> Path:
    data_dir = out / "data"
    if not (data_dir / "manifest.json").exists():
        cfg = DataConfig.toy() if toy else DataConfig()
        if seed is not None:
            cfg = replace(cfg, seed=seed)
        build_all(data_dir, cfg, kjv_text=kjv_text)
    return data_dir


def stage_tokenizer(out: Path, data_dir: Path, cfg: TargetConfig) -> Path:
    from .tokenizer import corpus_texts, save_tokenizer, train_tokenizer

    tok_dir = out / "tokenizer"
    if not (tok_dir / "tokenizer.json").exists():
        tok = train_tokenizer(corpus_texts(_train_records(data_dir)), vocab_size=cfg.vocab_size)
        tmp = tok_dir.with_name("tokenizer.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        save_tokenizer(tok, tmp, cfg.seq_len)
        shutil.rmtree(tok_dir, ignore_errors=True)
        tmp.rename(tok_dir)
    return tok_dir


def stage_target(out: Path, data_dir: Path, tok_dir: Path, cfg: TargetConfig,
                 progress: bool = True) -> Path:
    from .target_lm import train_target
    from .tokenizer import load_tokenizer

    target_dir = out / "target_mle"
    if not (target_dir / "model.safetensors").exists():
        tokenizer = load_tokenizer(tok_dir)
        heldout = {d: load_split(data_dir, d, "heldout") for d in DOMAINS}
        report = train_target(cfg, tokenizer, _train_records(data_dir), heldout,
                              out / "target_work", target_dir, progress=progress)
        print(json.dumps(report["heldout"], indent=2))
    return target_dir


def stage_unlikelihood(out: Path, data_dir: Path, base_dir: Path, cfg: UnlikelihoodConfig,
                       progress: bool = True) -> Path:
    """Fine-tune the MLE target against its own greedy loops (training_job.target_unlikelihood)."""
    from .target_unlikelihood import finetune

    target_dir = out / "target"
    if not (target_dir / "model.safetensors").exists():
        heldout = {d: load_split(data_dir, d, "heldout") for d in DOMAINS}
        report = finetune(cfg, base_dir, _train_records(data_dir), heldout,
                          out / "unlikelihood_work", target_dir, progress=progress)
        print(json.dumps(report["heldout"], indent=2))
    return target_dir


def regenerate_responses(work: Path, data_dir: Path, target, tokenizer, cfg: DrafterTrainConfig,
                         progress: bool = True) -> tuple[list[dict], list[dict]]:
    """The target's greedy data the drafters train on (work/regen.train.jsonl: responses to the
    training prompts of cfg.domains; work/regen.cont.jsonl: continuations of their reference
    responses from a seeded cut, when cfg.continuation_new_tokens > 0) and are measured on
    (work/regen.heldout.jsonl); later continuation passes cut elsewhere (regen.cont<k>.jsonl);
    resumes from what is there."""
    from . import drafter_data

    work.mkdir(parents=True, exist_ok=True)
    train_recs = []
    for d in cfg.domains:
        recs = load_split(data_dir, d, "train")
        random.Random(cfg.seed).shuffle(recs)
        train_recs += recs[:cfg.max_prompts_per_domain]
    seqs = drafter_data.regenerate(target, tokenizer, train_recs, work / "regen.train.jsonl",
                          cfg.max_new_tokens, cfg.gen_batch_size, progress)
    if cfg.continuation_new_tokens > 0:
        stop_ids = {tokenizer.convert_tokens_to_ids(t) for t in cf.STOP_TOKENS}
        for k in range(cfg.continuation_passes):
            name = "regen.cont.jsonl" if k == 0 else f"regen.cont{k}.jsonl"
            seqs += drafter_data.generate_greedy(target, drafter_data.continuation_contexts(tokenizer, train_recs, pass_=k),
                                        work / name, cfg.continuation_new_tokens, stop_ids,
                                        cfg.gen_batch_size, progress)
    if cfg.code_problems > 0 and "code" in cfg.domains:
        from .data.code_problems import build_problems

        problems = build_problems(cfg.code_problems, seed=PROBLEMS_SEED)
        seqs += cfg.problems_repeat * drafter_data.regenerate(target, tokenizer, problems, work / "regen.problems.jsonl",
                                                     cfg.max_new_tokens, cfg.gen_batch_size, progress)
    eval_recs = [r for d in DOMAINS for r in load_split(data_dir, d, "heldout")[:EVAL_PROMPTS]]
    eval_seqs = drafter_data.regenerate(target, tokenizer, eval_recs, work / "regen.heldout.jsonl",
                               cfg.max_new_tokens, cfg.gen_batch_size, progress)
    return seqs, eval_seqs


def stage_drafter(out: Path, data_dir: Path, target_dir: Path, cfg: DrafterTrainConfig,
                  progress: bool = True, name: str = "drafter") -> Path:
    """Regenerate with the target, train the drafter on code and prose, then its length head.

    ``name`` "drafter_refined" is the second stage: ``cfg.init_from`` is the first stage's
    drafter, the regenerated data is shared with it (drafter_work/), its checkpoints go to
    drafter_refined_work/; "drafter_problems" is the third, from the second's drafter, with the
    typed problems' answers added (drafter_work/regen.problems.jsonl)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from . import dflash_offline as dfo

    drafter_dir = out / name
    if (drafter_dir / "manifest.json").exists():
        return drafter_dir
    work = out / f"{name}_work"
    torch.set_num_threads(cfg.threads)
    target = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(target_dir))
    seqs, eval_seqs = regenerate_responses(out / "drafter_work", data_dir, target, tokenizer, cfg,
                                           progress)
    drafter, train_stats = dfo.train_drafter(target, tokenizer, seqs, cfg, work, progress)
    head_stats = dfo.train_length_head(target, tokenizer, drafter, seqs, cfg, work, progress)
    tau = {d: dfo.evaluate_blocks(target, tokenizer, drafter,
                                  [s for s in eval_seqs if s["domain"] == d], cfg)
           for d in DOMAINS}
    training = {"algorithm": "dflash-offline", "records": len(seqs), "steps": train_stats["steps"],
                "final_loss": train_stats["final_loss"], "length_head": head_stats,
                "domains": list(cfg.domains)}
    if cfg.init_from:
        from sglang_adaflash.drafter.checkpoint import sha256_file

        training["init_from"] = {"name": Path(cfg.init_from).name,
                                 "model_sha256": sha256_file(Path(cfg.init_from) / "model.safetensors")}
    evaluation = {"tau_by_domain": {d: round(v["tau_mean"], 3) for d, v in tau.items()},
                  "method": f"one block at 4 random anchors per held-out response, "
                            f"block {cfg.block_size}, teacher-forced context",
                  "parent": None}
    dfo.export_drafter(drafter, target_dir, drafter_dir, cfg, training, evaluation)
    print(json.dumps({"training": training, "eval": evaluation}, indent=2))
    return drafter_dir


def build(out: Path, toy: bool = False, stages=DEFAULT_STAGES, target_cfg: TargetConfig | None = None,
          progress: bool = True, kjv_text: str | None = None,
          drafter_cfg: DrafterTrainConfig | None = None,
          unlikelihood_cfg: UnlikelihoodConfig | None = None) -> dict[str, Path]:
    """Run the stages in order under ``out``; ``kjv_text`` replaces the `bible` reader (tests)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = target_cfg or (TargetConfig.toy() if toy else TargetConfig())
    paths: dict[str, Path] = {}
    t0 = time.time()
    paths["data"] = stage_data(out, toy, kjv_text=kjv_text)
    if "tokenizer" in stages or "target" in stages:
        paths["tokenizer"] = stage_tokenizer(out, paths["data"], cfg)
    if "target" in stages:
        paths["target_mle"] = stage_target(out, paths["data"], paths["tokenizer"], cfg, progress)
    if "unlikelihood" in stages:
        ucfg = unlikelihood_cfg or (UnlikelihoodConfig.toy() if toy else UnlikelihoodConfig())
        paths["target"] = stage_unlikelihood(out, paths["data"], out / "target_mle", ucfg, progress)
    if "drafter" in stages:
        dcfg = drafter_cfg or (DrafterTrainConfig.toy() if toy else DrafterTrainConfig())
        paths["drafter"] = stage_drafter(out, paths["data"], out / "target", dcfg, progress)
    if "refine" in stages:
        rcfg = (DrafterTrainConfig.toy().refined(out / "drafter", max_steps=4, head_steps=2) if toy
                else DrafterTrainConfig().refined(out / "drafter"))
        paths["drafter_refined"] = stage_drafter(out, paths["data"], out / "target", rcfg, progress,
                                                 name="drafter_refined")
    if "problems" in stages:
        pcfg = (DrafterTrainConfig.toy().with_problems(out / "drafter_refined", n=6, max_steps=4, head_steps=2)
                if toy else DrafterTrainConfig().with_problems(out / "drafter_refined"))
        paths["drafter_problems"] = stage_drafter(out, paths["data"], out / "target", pcfg, progress,
                                                  name="drafter_problems")
    print(f"built {', '.join(paths)} in {time.time() - t0:.1f}s under {out}")
    return paths


def _copy_tree(src: Path, dst: Path) -> None:
    """Replace ``dst`` with a world-readable copy of ``src`` (staged, then renamed)."""
    tmp = dst.with_name(dst.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp)
    tmp.chmod(0o755)
    for f in tmp.iterdir():
        f.chmod(0o644)
    shutil.rmtree(dst, ignore_errors=True)
    tmp.rename(dst)


def ship(build_dir: Path, assets_dir: Path | None = None) -> None:
    """Copy the built target, drafter and held-out workloads into the package's assets."""
    from sglang_adaflash import assets

    assets_dir = Path(assets_dir) if assets_dir else assets.ASSETS_DIR
    build_dir = Path(build_dir)
    (assets_dir / "models").mkdir(parents=True, exist_ok=True)
    _copy_tree(build_dir / "target", assets_dir / "models" / "target")
    wl = assets_dir / "workloads"
    wl.mkdir(parents=True, exist_ok=True)
    for d in DOMAINS:
        shutil.copyfile(build_dir / "data" / f"{d}.heldout.jsonl", wl / f"{d}.heldout.jsonl")
    shutil.copyfile(build_dir / "data" / "manifest.json", wl / "manifest.json")
    for name in ("drafter_problems", "drafter_refined", "drafter"):  # the last stage's that exists
        if (build_dir / name / "manifest.json").exists():
            _copy_tree(build_dir / name, assets_dir / "models" / "drafter")
            break


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m training_job.models")
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="rebuild the embedded model pair from scratch")
    b.add_argument("--out", type=Path, required=True)
    b.add_argument("--toy", action="store_true", help="tiny everything, runs in seconds")
    b.add_argument("--stages", default=",".join(DEFAULT_STAGES),
                   help=f"comma-separated subset of {','.join(STAGES)}")
    b.add_argument("--max-steps", type=int, default=None, help="override the target's steps")
    b.add_argument("--unlikelihood-steps", type=int, default=None,
                   help="override the loop fine-tune's steps")
    b.add_argument("--no-progress", action="store_true")
    s = sub.add_parser("ship", help="copy a build into sglang_adaflash/assets/")
    s.add_argument("--from", dest="src", type=Path, required=True)
    r = sub.add_parser("regen", help="the drafter stage's data alone: OUT/drafter_work/regen.{train,heldout}.jsonl "
                                     "from a built or shipped target (for training_job.d2sd_recovery)")
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--target", type=Path, required=True, help="target directory (e.g. the shipped one)")
    r.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    if args.cmd == "ship":
        ship(args.src)
        return 0
    if args.cmd == "regen":
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        dcfg = DrafterTrainConfig()
        torch.set_num_threads(dcfg.threads)
        target = AutoModelForCausalLM.from_pretrained(str(args.target), dtype=torch.float32).eval()
        tokenizer = AutoTokenizer.from_pretrained(str(args.target))
        regenerate_responses(args.out / "drafter_work", stage_data(args.out, False), target, tokenizer, dcfg,
                             not args.no_progress)
        return 0
    stages = tuple(x for x in args.stages.split(",") if x)
    unknown = set(stages) - set(STAGES)
    if unknown:
        ap.error(f"unknown stages {sorted(unknown)}: choose from {', '.join(STAGES)}")
    cfg = TargetConfig.toy() if args.toy else TargetConfig()
    if args.max_steps is not None:
        cfg = replace(cfg, max_steps=args.max_steps)
    ucfg = UnlikelihoodConfig.toy() if args.toy else UnlikelihoodConfig()
    if args.unlikelihood_steps is not None:
        ucfg = replace(ucfg, steps=args.unlikelihood_steps)
    build(args.out, toy=args.toy, stages=stages, target_cfg=cfg, progress=not args.no_progress,
          unlikelihood_cfg=ucfg)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
