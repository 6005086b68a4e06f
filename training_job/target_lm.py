"""The small target LM of the embedded pair: a Qwen3 trained from scratch on the mixed corpus.

The target sees all three domains (code, math, prose) in the chat format of
:mod:`sglang_adaflash.assets.chat_format`. Conversations are shuffled once (seeded) and packed
into fixed windows of ``seq_len`` tokens; every epoch visits the windows in a new seeded order.

The loop follows nanoGPT's order: learning rate, then eval and checkpoint, then forward and
backward, clip, step, zero grad, timing. The checkpoint (``ckpt.pt``) carries everything needed
to resume (weights, optimiser, step, RNG state, config) and is written atomically; on resume the
architecture is checked against the config. The result is a standard HF model directory
(``config.json``, ``model.safetensors``, ``generation_config.json`` and the tokenizer files).

Embeddings are tied (``tie_word_embeddings=True``): the drafter reuses the target's
``embed_tokens`` and ``lm_head``, so one matrix serves both.
"""

from __future__ import annotations

import json
import math
import os
import random
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch

from sglang_adaflash.assets import chat_format as cf
from sglang_adaflash.fsio import atomic_path

from .data.common import atomic_write_text

ARCH_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
             "num_kv_heads", "head_dim", "seq_len", "tie_embeddings")


@dataclass
class TargetConfig:
    # Architecture (Qwen3).
    vocab_size: int = 4096
    hidden_size: int = 256
    intermediate_size: int = 768
    num_layers: int = 6
    num_heads: int = 8
    num_kv_heads: int = 4
    head_dim: int = 32
    seq_len: int = 512
    tie_embeddings: bool = True
    rope_theta: float = 10000.0
    # Optimisation. 4392 steps of 3 x 512 tokens = 3.0 epochs of the 4394 packed windows
    # (2.25 M tokens) of the default data; bf16 autocast (see docs/models.md for the timing).
    batch_size: int = 3
    max_steps: int = 4392
    lr: float = 2e-3
    min_lr: float = 2e-4
    warmup_steps: int = 100
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    amp_bf16: bool = True  # forward under bf16 autocast; weights and optimiser stay fp32
    # Bookkeeping.
    seed: int = 1234
    threads: int = 2
    eval_every: int = 250
    eval_examples: int = 24  # per domain, for the periodic eval; the final eval uses all
    eval_max_len: int = 512  # tokens of prompt + response scored per held-out record
    ckpt_every: int = 50
    save_dtype: str = "bfloat16"

    @classmethod
    def toy(cls) -> TargetConfig:
        return cls(vocab_size=320, hidden_size=32, intermediate_size=64, num_layers=2,
                   num_heads=2, num_kv_heads=1, head_dim=16, seq_len=64, batch_size=4,
                   max_steps=12, lr=3e-3, min_lr=3e-4, warmup_steps=2, eval_every=6,
                   eval_examples=4, ckpt_every=5, save_dtype="float32")

    @classmethod
    def from_dict(cls, d: dict) -> TargetConfig:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


def make_model_config(cfg: TargetConfig):
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim, max_position_embeddings=cfg.seq_len,
        tie_word_embeddings=cfg.tie_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        bos_token_id=cf.SPECIAL_TOKENS.index(cf.BOS),
        eos_token_id=[cf.SPECIAL_TOKENS.index(cf.END), cf.SPECIAL_TOKENS.index(cf.EOS)],
        pad_token_id=cf.SPECIAL_TOKENS.index(cf.PAD),
    )


def make_model(cfg: TargetConfig):
    from transformers import Qwen3ForCausalLM

    mc = make_model_config(cfg)
    mc._attn_implementation = "sdpa"
    return Qwen3ForCausalLM(mc)


# ---------------------------------------------------------------------------------------------
# Data


def encode_records(tokenizer, records: list[dict]) -> list[list[int]]:
    """Token ids of each record's whole conversation (prompt, response, stop token)."""
    texts = [cf.render_example(r["prompt"], r["response"]) for r in records]
    return tokenizer(texts, add_special_tokens=False)["input_ids"]


def pack(docs: list[list[int]], seq_len: int, seed: int) -> torch.Tensor:
    """Shuffle the documents (seeded), concatenate, cut into ``[N, seq_len]`` windows."""
    order = list(range(len(docs)))
    random.Random(seed).shuffle(order)
    stream = [t for i in order for t in docs[i]]
    n = len(stream) // seq_len
    if n == 0:
        raise ValueError(f"corpus of {len(stream)} tokens is shorter than one window of {seq_len}")
    return torch.tensor(stream[: n * seq_len], dtype=torch.long).view(n, seq_len)


class WindowSampler:
    """Batches of packed windows; each epoch is a new seeded permutation. Resumable by step."""

    def __init__(self, windows: torch.Tensor, batch_size: int, seed: int):
        self.windows = windows  # [N, T]
        self.batch_size = batch_size
        self.seed = seed
        self.per_epoch = max(1, len(windows) // batch_size)

    def batch(self, step: int) -> torch.Tensor:
        epoch, i = divmod(step, self.per_epoch)
        g = torch.Generator().manual_seed(self.seed * 1000 + epoch)
        perm = torch.randperm(len(self.windows), generator=g)
        idx = perm[i * self.batch_size:(i + 1) * self.batch_size]
        return self.windows[idx]  # [bs, T]


# ---------------------------------------------------------------------------------------------
# Evaluation


@torch.no_grad()
def response_loss(model, tokenizer, records: list[dict], max_len: int) -> dict:
    """Mean cross-entropy over response tokens (and the stop token) of ``records``."""
    model.eval()
    total, count = 0.0, 0
    for r in records:
        prompt = tokenizer(cf.render_prompt(r["prompt"]), add_special_tokens=False)["input_ids"]
        full = tokenizer(cf.render_example(r["prompt"], r["response"]),
                         add_special_tokens=False)["input_ids"]
        full = full[:max_len]
        if len(full) <= len(prompt):
            continue
        ids = torch.tensor([full])
        logits = model(input_ids=ids).logits[0, :-1].float()  # [T-1, V]
        targets = ids[0, 1:]
        ce = torch.nn.functional.cross_entropy(logits, targets, reduction="none")
        ce = ce[len(prompt) - 1:]  # positions that predict response tokens
        total += ce.sum().item()
        count += ce.numel()
    model.train()
    loss = total / max(count, 1)
    return {"loss": loss, "ppl": math.exp(min(loss, 50.0)), "tokens": count}


def evaluate(model, tokenizer, heldout: dict[str, list[dict]], max_len: int,
             limit: int | None = None) -> dict[str, dict]:
    return {d: response_loss(model, tokenizer, recs[:limit] if limit else recs, max_len)
            for d, recs in heldout.items()}


# ---------------------------------------------------------------------------------------------
# Checkpoints


def lr_at(step: int, cfg: TargetConfig) -> float:
    """Linear warmup, then cosine decay from ``lr`` to ``min_lr`` at ``max_steps``."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    frac = (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps)
    frac = min(1.0, frac)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * frac)) * (cfg.lr - cfg.min_lr)


def save_checkpoint(path: Path, model, opt, step: int, cfg: TargetConfig, best: float) -> None:
    """Atomic: write to a temporary file, fsync, rename."""
    path = Path(path)
    state = {
        "model": model.state_dict(), "optimizer": opt.state_dict(), "step": step,
        "config": asdict(cfg), "best_eval_loss": best,
        "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
    }
    with atomic_path(path) as tmp:
        torch.save(state, tmp)


def load_checkpoint(path: Path, model, opt, cfg: TargetConfig) -> tuple[int, float]:
    state = torch.load(path, map_location="cpu", weights_only=False)
    saved = state["config"]
    diff = {k: (saved.get(k), getattr(cfg, k)) for k in ARCH_KEYS if saved.get(k) != getattr(cfg, k)}
    if diff:
        raise ValueError(
            f"checkpoint {path} was trained with another architecture {diff} (saved, now): "
            "delete it or pass the config it was trained with")
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["rng"]["torch"])
    random.setstate(state["rng"]["python"])
    return int(state["step"]), float(state["best_eval_loss"])


# ---------------------------------------------------------------------------------------------
# Training


def _optimizer(model, cfg: TargetConfig) -> torch.optim.Optimizer:
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2))


def train_target(cfg: TargetConfig, tokenizer, train: list[dict], heldout: dict[str, list[dict]],
                 work_dir: Path, out_dir: Path, progress: bool = True) -> dict:
    """Train (or resume) the target in ``work_dir`` and save the HF model dir to ``out_dir``."""
    from tqdm.auto import tqdm

    work_dir, out_dir = Path(work_dir), Path(out_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    if len(tokenizer) != cfg.vocab_size:
        raise ValueError(f"tokenizer has {len(tokenizer)} tokens but the target config expects "
                         f"vocab_size={cfg.vocab_size}: rebuild one to match the other")

    windows = pack(encode_records(tokenizer, train), cfg.seq_len, cfg.seed)
    sampler = WindowSampler(windows, cfg.batch_size, cfg.seed)
    model = make_model(cfg)
    opt = _optimizer(model, cfg)
    ckpt = work_dir / "ckpt.pt"
    step, best = 0, float("inf")
    if ckpt.exists():
        step, best = load_checkpoint(ckpt, model, opt, cfg)
    log_path = work_dir / "train_log.jsonl"
    n_params = sum(p.numel() for p in model.parameters())
    meta = {"event": "start", "step": step, "params": n_params, "windows": len(windows),
            "tokens_per_epoch": windows.numel(), "config": asdict(cfg)}
    _log(log_path, meta)

    model.train()
    bar = tqdm(total=cfg.max_steps, initial=step, desc="target", disable=not progress,
               dynamic_ncols=True)
    t_last = time.time()
    loss_ema = None
    while step < cfg.max_steps:
        lr = lr_at(step, cfg)
        for g in opt.param_groups:
            g["lr"] = lr
        if step > 0 and step % cfg.eval_every == 0:
            ev = evaluate(model, tokenizer, heldout, cfg.eval_max_len, cfg.eval_examples)
            mean = sum(v["loss"] for v in ev.values()) / len(ev)
            best = min(best, mean)
            _log(log_path, {"event": "eval", "step": step,
                            **{f"{d}_loss": round(v["loss"], 4) for d, v in ev.items()}})
        if step > 0 and step % cfg.ckpt_every == 0:
            save_checkpoint(ckpt, model, opt, step, cfg, best)

        x = sampler.batch(step)  # [bs, T]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.amp_bf16):
            loss = model(input_ids=x, labels=x).loss
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)

        step += 1
        li = loss.item()  # CPU: no device sync to worry about
        loss_ema = li if loss_ema is None else 0.9 * loss_ema + 0.1 * li
        dt = time.time() - t_last
        t_last = time.time()
        bar.update(1)
        bar.set_postfix(loss=f"{loss_ema:.3f}", lr=f"{lr:.1e}", tok_s=f"{x.numel() / dt:.0f}")
        _log(log_path, {"event": "step", "step": step, "loss": round(li, 4), "lr": lr,
                        "grad_norm": round(float(gnorm), 3), "step_s": round(dt, 3)})
    bar.close()
    save_checkpoint(ckpt, model, opt, step, cfg, best)
    return export_target(model, tokenizer, cfg, heldout, out_dir, log_path)


def export_target(model, tokenizer, cfg: TargetConfig, heldout: dict[str, list[dict]],
                  out_dir: Path, log_path: Path | None = None, extra: dict | None = None) -> dict:
    """Save the HF model directory, reload it as shipped, and evaluate that copy; ``extra``
    joins the report (what a later stage, such as a fine-tune, adds to the recipe)."""
    from transformers import GenerationConfig, Qwen3ForCausalLM

    out_dir = Path(out_dir)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    if tmp.exists():
        import shutil

        shutil.rmtree(tmp)
    dtype = getattr(torch, cfg.save_dtype)
    model.to(dtype).save_pretrained(str(tmp))
    model.float()
    tokenizer.save_pretrained(str(tmp))
    GenerationConfig(
        bos_token_id=model.config.bos_token_id, eos_token_id=model.config.eos_token_id,
        pad_token_id=model.config.pad_token_id, do_sample=False, max_new_tokens=256,
    ).save_pretrained(str(tmp))
    shipped = Qwen3ForCausalLM.from_pretrained(str(tmp), dtype=torch.float32)
    ev = evaluate(shipped, tokenizer, heldout, cfg.eval_max_len)
    report = {
        "format": "adaflash.target/v1",
        "params": sum(p.numel() for p in shipped.parameters()),
        "heldout": {d: {k: round(v, 4) if isinstance(v, float) else v for k, v in e.items()}
                    for d, e in ev.items()},
        "config": asdict(cfg),
        **(extra or {}),
    }
    atomic_write_text(tmp / "training_report.json", json.dumps(report, indent=2) + "\n")
    if out_dir.exists():
        import shutil

        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)
    if log_path is not None:
        _log(log_path, {"event": "final_eval", **{f"{d}_loss": v["loss"] for d, v in ev.items()}})
    return report


def _log(path: Path, rec: dict) -> None:
    rec = {"time": round(time.time(), 3), **rec}
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(rec) + "\n")
