"""Fine-tunes the trained target against its own greedy loops (sequence-level unlikelihood).

Maximum likelihood on 2.25 M tokens leaves a small LM whose greedy continuations fall into
phrase loops (`and in the Lord Jesus Christ, and in the Lord Jesus Christ, ...`), most of all on
KJV prose. More epochs of the same data lowered perplexity but not the loops. Sequence-level
unlikelihood training (Welleck et al., "Neural Text Generation with Unlikelihood Training",
ICLR 2020) aims at the loops directly: the model continues training prompts greedily, and every
token of a continuation that belongs to an n-gram repeating an earlier n-gram of the same
continuation is penalised with ``-log(1 - p(token | prefix))``. The fine-tune mixes that loss
with the usual next-token loss on the packed training windows, so the model keeps its
perplexity while greedy decoding learns to leave a loop.

Each step, deterministically from ``seed`` and the step number (so a resumed run repeats the
steps it would have taken):

1. ``gen_prompts`` training prompts of at most ``max_prompt_tokens`` tokens, continued greedily
   for up to ``max_new_tokens`` tokens (cut before the first stop token), model in eval mode;
2. the penalty mask of each continuation (:func:`repeat_mask`);
3. loss = next-token CE on one batch of packed windows + ``alpha`` x the unlikelihood of the
   flagged tokens, summed over them and divided by all continuation tokens of the step (a step
   whose continuations do not loop adds nothing).

The run is resumable like the target's: ``ckpt.pt`` (weights, optimiser, step) is written
atomically every ``ckpt_every`` steps, ``train_log.jsonl`` logs every step. The result is a
standard HF model directory whose ``training_report.json`` also records this fine-tune.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch

from sglang_adaflash.assets import chat_format as cf
from sglang_adaflash.fsio import atomic_path

from .target_lm import (
    TargetConfig,
    WindowSampler,
    _log,
    _optimizer,
    encode_records,
    evaluate,
    export_target,
    pack,
)
from .target_quality import generate, generate_batch, repeated_ngram_share

FORMAT = "adaflash.target_unlikelihood/v1"


@dataclass
class UnlikelihoodConfig:
    steps: int = 300
    lr: float = 1e-4  # the MLE run ended at 2e-4; half of that keeps its perplexity
    warmup_steps: int = 20
    alpha: float = 1.0  # weight of the unlikelihood loss against next-token CE
    ngram: int = 4
    gen_prompts: int = 8  # prompts continued greedily per step
    max_new_tokens: int = 64  # the length the target-quality loop figures are measured at
    max_prompt_tokens: int = 320
    mle_batch_size: int = 3  # packed windows of the target's seq_len per step
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 2027
    threads: int = 2
    ckpt_every: int = 25
    eval_every: int = 100
    eval_examples: int = 24  # per domain: held-out loss and greedy rep4 at each periodic eval
    save_dtype: str = "bfloat16"

    @classmethod
    def toy(cls) -> UnlikelihoodConfig:
        return cls(steps=4, warmup_steps=1, gen_prompts=2, max_new_tokens=12,
                   max_prompt_tokens=512, mle_batch_size=2, ckpt_every=2, eval_every=3,
                   eval_examples=2, save_dtype="float32")

    @classmethod
    def from_dict(cls, d: dict) -> UnlikelihoodConfig:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


def repeat_mask(tokens: list[int], n: int = 4) -> list[bool]:
    """Which tokens belong to an n-gram that repeats an earlier n-gram of the same sequence.

    ``a b c d a b c d e``: the second ``a b c d`` repeats, so positions 4-7 are flagged. These
    are the tokens the unlikelihood loss penalises (all n of each repeating n-gram, as in
    Welleck et al.). An n-gram overlapping its earlier copy counts: ``a a a a a`` flags 1-4.
    """
    flags = [False] * len(tokens)
    seen: set[tuple[int, ...]] = set()
    for i in range(len(tokens) - n + 1):
        gram = tuple(tokens[i:i + n])
        if gram in seen:
            for j in range(i, i + n):
                flags[j] = True
        else:
            seen.add(gram)
    return flags


def unlikelihood_loss(logits: torch.Tensor, ids: torch.Tensor, flags: torch.Tensor,
                      denom: int) -> torch.Tensor:
    """``sum over flagged t of -log(1 - p(ids[t] | ids[<t]))`` over ``denom``.

    ``logits`` [bs, T, V] from a forward over ``ids`` [bs, T]; ``flags`` [bs, T] bool marks the
    tokens to push down (a flag at position 0 is ignored: nothing predicts it). The probability
    is clamped below 1 - 1e-5 so a near-certain loop gives a large finite loss, not inf.
    """
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    p = logp.gather(-1, ids[:, 1:, None])[..., 0].exp()  # [bs, T-1]
    pen = -torch.log((1.0 - p).clamp(min=1e-5))
    return (pen * flags[:, 1:].to(pen.dtype)).sum() / max(denom, 1)


def _lr(step: int, cfg: UnlikelihoodConfig) -> float:
    return cfg.lr * min(1.0, (step + 1) / max(1, cfg.warmup_steps))


def eligible_prompts(tokenizer, train: list[dict], max_tokens: int) -> list[list[int]]:
    """Token ids of the rendered training prompts no longer than ``max_tokens``."""
    texts = [cf.render_prompt(r["prompt"]) for r in train]
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    return [x for x in ids if len(x) <= max_tokens]


def _continuation_batch(model, tokenizer, prompts: list[list[int]], cfg: UnlikelihoodConfig,
                        pad: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int]:
    """Greedy continuations of ``prompts``: (ids [bs, T] right-padded, attention mask, penalty
    flags, continuation tokens, flagged tokens)."""
    stops = tuple(tokenizer.convert_tokens_to_ids(t) for t in cf.STOP_TOKENS)
    model.eval()
    outs = [t for t, _ in generate_batch(model, prompts, cfg.max_new_tokens, stops, pad)]
    model.train()
    rows, flags, cont = [], [], 0
    for p, g in zip(prompts, outs):
        rows.append(p + g)
        flags.append([False] * len(p) + repeat_mask(g, cfg.ngram))
        cont += len(g)
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    att = torch.zeros_like(ids)
    fl = torch.zeros((len(rows), width), dtype=torch.bool)
    for i, (r, f) in enumerate(zip(rows, flags)):
        ids[i, :len(r)] = torch.tensor(r)
        att[i, :len(r)] = 1
        fl[i, :len(r)] = torch.tensor(f)
    return ids, att, fl, cont, int(fl.sum())


def greedy_rep4(model, tokenizer, heldout: dict[str, list[dict]], limit: int,
                max_new_tokens: int, n: int = 4) -> dict[str, float | None]:
    """Mean repeated-n-gram share of greedy continuations of the first ``limit`` held-out
    prompts of each domain (the periodic eval's loop figure)."""
    was_training = model.training
    model.eval()
    res = {}
    for d, recs in heldout.items():
        outs = generate(model, tokenizer, [r["prompt"] for r in recs[:limit]], max_new_tokens)
        res[d] = repeated_ngram_share([t for t, _ in outs], n, "mean")
    model.train(was_training)
    return res


def save_checkpoint(path: Path, model, opt, step: int, cfg: UnlikelihoodConfig) -> None:
    state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step,
             "config": asdict(cfg)}
    with atomic_path(Path(path)) as tmp:
        torch.save(state, tmp)


def finetune(cfg: UnlikelihoodConfig, base_dir: Path, train: list[dict],
             heldout: dict[str, list[dict]], work_dir: Path, out_dir: Path,
             progress: bool = True) -> dict:
    """Fine-tune the HF target in ``base_dir`` (or resume in ``work_dir``) and save the result
    as an HF model directory in ``out_dir``; returns its training report."""
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base_dir, work_dir, out_dir = Path(base_dir), Path(work_dir), Path(out_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(cfg.threads)
    base_report = json.loads((base_dir / "training_report.json").read_text())
    tcfg = TargetConfig.from_dict(base_report["config"])
    tokenizer = AutoTokenizer.from_pretrained(str(base_dir))
    model = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    pad = tokenizer.pad_token_id
    opt = _optimizer(model, TargetConfig(lr=cfg.lr, weight_decay=cfg.weight_decay))
    ckpt = work_dir / "ckpt.pt"
    step = 0
    if ckpt.exists():
        state = torch.load(ckpt, map_location="cpu", weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        step = int(state["step"])

    windows = pack(encode_records(tokenizer, train), tcfg.seq_len, cfg.seed)
    sampler = WindowSampler(windows, cfg.mle_batch_size, cfg.seed)
    prompts = eligible_prompts(tokenizer, train, cfg.max_prompt_tokens)
    if not prompts:
        raise ValueError(f"no training prompt has at most {cfg.max_prompt_tokens} tokens")
    log_path = work_dir / "train_log.jsonl"
    _log(log_path, {"event": "start", "step": step, "base": str(base_dir),
                    "prompts": len(prompts), "config": asdict(cfg)})
    model.train()
    bar = tqdm(total=cfg.steps, initial=step, desc="unlikelihood", disable=not progress,
               dynamic_ncols=True)
    while step < cfg.steps:
        if step > 0 and step % cfg.eval_every == 0:
            _periodic_eval(model, tokenizer, heldout, cfg, tcfg.eval_max_len, step, log_path)
        if step > 0 and step % cfg.ckpt_every == 0:
            save_checkpoint(ckpt, model, opt, step, cfg)
        t0 = time.time()
        lr = _lr(step, cfg)
        for g in opt.param_groups:
            g["lr"] = lr
        rng = random.Random(cfg.seed * 1_000_003 + step)
        picked = [prompts[rng.randrange(len(prompts))] for _ in range(cfg.gen_prompts)]
        ids, att, flags, cont, flagged = _continuation_batch(model, tokenizer, picked, cfg, pad)
        t_gen = time.time() - t0
        ul = unlikelihood_loss(model(input_ids=ids, attention_mask=att).logits, ids, flags, cont)
        x = sampler.batch(step)
        mle = model(input_ids=x, labels=x).loss
        (mle + cfg.alpha * ul).backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        bar.update(1)
        bar.set_postfix(mle=f"{mle.item():.3f}", ul=f"{ul.item():.3f}",
                        looped=f"{flagged / max(cont, 1):.2f}")
        _log(log_path, {"event": "step", "step": step, "mle": round(mle.item(), 4),
                        "ul": round(ul.item(), 4), "flagged_share": round(flagged / max(cont, 1), 4),
                        "continuation_tokens": cont, "lr": lr, "grad_norm": round(float(gnorm), 3),
                        "gen_s": round(t_gen, 3), "step_s": round(time.time() - t0, 3)})
    bar.close()
    save_checkpoint(ckpt, model, opt, step, cfg)
    tcfg.save_dtype = cfg.save_dtype
    extra = {"unlikelihood": {"format": FORMAT, "config": asdict(cfg), "steps": step,
                              "base_heldout": base_report.get("heldout")}}
    return export_target(model, tokenizer, tcfg, heldout, out_dir, log_path, extra=extra)


def _periodic_eval(model, tokenizer, heldout, cfg: UnlikelihoodConfig, max_len: int, step: int,
                   log_path: Path) -> None:
    ev = evaluate(model, tokenizer, heldout, max_len, cfg.eval_examples)
    rep = greedy_rep4(model, tokenizer, heldout, cfg.eval_examples, cfg.max_new_tokens, cfg.ngram)
    _log(log_path, {"event": "eval", "step": step,
                    **{f"{d}_loss": round(v["loss"], 4) for d, v in ev.items()},
                    **{f"{d}_rep4": None if r is None else round(r, 4) for d, r in rep.items()}})
