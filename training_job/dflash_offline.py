"""Offline DFlash recipe: train a block-diffusion drafter, then its length head, on a frozen target.

1. Regenerate: the target answers the training prompts greedily (batched). The drafter learns to
   predict what the target says, not what the corpus says.
2. Drafter: random anchors among each response's positions. A block is the anchor token plus
   B-1 mask tokens at positions anchor..anchor+B-1. Block queries see the target's context
   features strictly before the anchor and their own block (bidirectionally), never another
   block. Slot k (k >= 1) is labelled with the token at anchor+k; cross-entropy weighted by
   ``exp(-(k-1)/gamma)``, gamma = 7.
3. Length head: on detached drafter states of the same blocks, label
   ``clamp(accept_len + 1, 0, B) / B`` (accept_len = leading proposals equal to the target's
   greedy tokens, which on regenerated data are the next tokens of the sequence), MSE loss, its
   own AdamW at lr 2e-4.
4. Export: a DFlash-format checkpoint (config.json, model.safetensors) plus manifest.json.

The target is frozen throughout; its hidden states are recomputed per batch (no feature cache).
Both loops checkpoint atomically and resume.
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from sglang_adaflash.assets import chat_format as cf
from sglang_adaflash.fsio import atomic_path

from .block_losses import (
    Blocks,
    accept_lengths,
    distill_kl,
    loss_slots,
    make_blocks,
    position_weights,
    sample_anchors,
    weighted_ce,
)
from .data.common import atomic_write_text


@dataclass
class DrafterTrainConfig:
    # Drafter architecture (the rest comes from the target's config).
    num_layers: int = 1
    intermediate_size: int | None = None  # the drafter MLP's width; None: the target's
    target_layer_ids: list[int] = field(default_factory=lambda: [1, 3, 4])
    block_size: int = 16
    # Regeneration.
    domains: list[str] = field(default_factory=lambda: ["code", "prose"])
    max_prompts_per_domain: int | None = None  # None: every training prompt of the domains
    max_new_tokens: int = 128
    # A second pass: the target continues each record's reference response from a seeded cut
    # (continuation_contexts), for up to this many tokens; 0 turns it off.
    continuation_new_tokens: int = 96
    # How many such continuations per record, each from its own seeded cut (pass 0 is the
    # first recipe's; later passes add data from other depths of the same responses).
    continuation_passes: int = 1
    gen_batch_size: int = 64
    # Synthetic typed problems in HumanEval's layout added to the code prompts
    # (training_job/data/code_problems.py; none of them a HumanEval problem), each response
    # seen problems_repeat times per pass over the data; 0 turns them off.
    code_problems: int = 0
    problems_repeat: int = 1
    # Start from this drafter's weights (a DFlash-format directory with the same architecture),
    # length head included, instead of a fresh initialisation: a second stage of training on
    # more data at a lower learning rate (docs/models.md, "A second stage").
    init_from: str | None = None
    # Drafter optimisation.
    anchors_per_seq: int = 32
    batch_size: int = 4  # sequences per step
    max_steps: int = 4500
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_steps: int = 50
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    # Slot k's weight exp(-(k-1)/gamma). The published recipe's 7 suits drafters whose proposals
    # survive ~87% of the time (the chance of reaching slot k decays like a^(k-1)); on the
    # embedded pair a is ~0.6, and gamma 2 measured best (docs/models.md, the ablation).
    gamma: float = 2.0
    # Share of the loss taken by distillation from the target's own distribution at each slot,
    # KL(p_target || p_drafter) at kd_temperature, weighted over slots like the cross-entropy
    # (0: the published recipe's hard labels only).
    kd_weight: float = 0.5
    kd_temperature: float = 1.0
    # Length head.
    head_steps: int = 600
    head_lr: float = 2e-4
    # Bookkeeping.
    seed: int = 1234
    threads: int = 2
    ckpt_every: int = 100
    save_dtype: str = "bfloat16"

    @classmethod
    def toy(cls) -> DrafterTrainConfig:
        return cls(target_layer_ids=[0, 1], block_size=4, max_prompts_per_domain=4,
                   max_new_tokens=12, continuation_new_tokens=6, gen_batch_size=4, anchors_per_seq=4, batch_size=2,
                   max_steps=8, warmup_steps=2, head_steps=4, ckpt_every=4, save_dtype="float32")

    def refined(self, base_dir: str | Path, max_steps: int = 3000,
                head_steps: int = 300) -> DrafterTrainConfig:
        """The second stage's recipe on top of this one: start from ``base_dir``'s drafter,
        add a second pass of continuations (new cuts: data from other depths of the responses),
        a new data order, and a shorter cosine from a lower peak (docs/models.md, "A second
        stage")."""
        return replace(self, init_from=str(base_dir), continuation_passes=max(2, self.continuation_passes),
                       seed=self.seed + 1, lr=self.lr / 2, min_lr=self.min_lr / 2,
                       max_steps=max_steps, head_steps=head_steps)

    def with_problems(self, base_dir: str | Path, n: int = 6000, repeat: int = 2,
                      max_steps: int = 2500, head_steps: int = 300) -> DrafterTrainConfig:
        """The third stage on top of the second: start from ``base_dir``'s drafter and add the
        target's answers to ``n`` typed problems in HumanEval's layout to the second stage's
        data, at half its peak learning rate (docs/models.md, "The third stage")."""
        base = self.refined(base_dir, max_steps=max_steps, head_steps=head_steps)
        return replace(base, code_problems=n, problems_repeat=repeat, seed=base.seed + 1,
                       lr=base.lr / 2, min_lr=base.min_lr / 2)

    @classmethod
    def from_dict(cls, d: dict) -> DrafterTrainConfig:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


# ---------------------------------------------------------------------------------------------
# 1. Regeneration


@torch.no_grad()
def build_drafter(target_config, cfg: DrafterTrainConfig, mask_token_id: int):
    from sglang_adaflash.drafter.config import DrafterConfig
    from sglang_adaflash.drafter.model import DFlashDrafter

    tc = target_config
    rope = (getattr(tc, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
    dc = DrafterConfig(
        hidden_size=tc.hidden_size, intermediate_size=cfg.intermediate_size or tc.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=tc.num_attention_heads,
        num_key_value_heads=tc.num_key_value_heads, head_dim=tc.head_dim,
        vocab_size=tc.vocab_size, num_target_layers=tc.num_hidden_layers,
        mask_token_id=mask_token_id, target_layer_ids=list(cfg.target_layer_ids),
        block_size=cfg.block_size, rms_norm_eps=tc.rms_norm_eps, rope_theta=float(rope),
        max_position_embeddings=tc.max_position_embeddings,
    )
    dc.validate()
    return DFlashDrafter(dc)


def collate(seqs: list[dict], pad_id: int) -> tuple[torch.Tensor, list[int], list[int]]:
    full = [s["prompt_ids"] + s["output_ids"] for s in seqs]
    width = max(map(len, full))
    ids = torch.full((len(full), width), pad_id, dtype=torch.long)
    for i, t in enumerate(full):
        ids[i, :len(t)] = torch.tensor(t)
    return ids, [len(t) for t in full], [len(s["prompt_ids"]) for s in seqs]


@torch.no_grad()
def target_features(target, ids: torch.Tensor, layer_ids: list[int]) -> torch.Tensor:
    """ids [bs, C] -> [bs, C, K*H]: hidden states after each of ``layer_ids`` (HF index id+1)."""
    out = target.model(input_ids=ids, output_hidden_states=True)
    return torch.cat([out.hidden_states[i + 1] for i in layer_ids], dim=-1)


@torch.no_grad()
def target_features_and_states(target, ids: torch.Tensor,
                               layer_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """One target forward: the context features [bs, C, K*H] (as :func:`target_features`) and
    the final normed states [bs, C, H] that the LM head turns into the target's logits."""
    out = target.model(input_ids=ids, output_hidden_states=True)
    feats = torch.cat([out.hidden_states[i + 1] for i in layer_ids], dim=-1)
    return feats, out.last_hidden_state


@torch.no_grad()
def block_teacher_logits(target, final_states: torch.Tensor, blocks: Blocks,
                         slots: int | None = None) -> torch.Tensor:
    """[N, B, V] (B = ``slots`` leading slots when given): the target's logits at the position
    before each block slot (slot k is labelled with the token at anchor+k, which the target
    predicts at anchor+k-1). Slots past the sequence read a clamped position; their labels are
    IGNORE, so they weigh nothing."""
    pos = (blocks.positions[:, :slots] - 1).clamp(0, final_states.shape[1] - 1)  # [N, B]
    rows = final_states[blocks.seq_indices[:, None], pos]  # [N, B, H]
    return target.lm_head(rows)


def drafter_forward(drafter, feats: torch.Tensor, blocks: Blocks, slots: int | None = None) -> torch.Tensor:
    """Final normed block states [N, B, H] of every block, with context K/V per sequence; with
    ``slots``, those of the leading slots only, [N, slots, H] (the same values)."""
    bs, c, _ = feats.shape
    ctx = drafter.project_context(feats)  # [bs, C, H]
    ctx_pos = torch.arange(c, device=feats.device)[None].expand(bs, -1)
    ctx_kv = drafter.context_kv(ctx, ctx_pos)  # per layer ([bs, kvh, C, hd] x2)
    per_block = [(k[blocks.seq_indices], v[blocks.seq_indices]) for k, v in ctx_kv]
    emb = drafter.embed_tokens(blocks.input_ids)
    read = None
    if slots is not None and slots < blocks.input_ids.shape[1]:
        read = torch.arange(slots, device=emb.device)[None].expand(emb.shape[0], -1)
    return drafter(emb, blocks.positions, per_block, blocks.mask, read)


# ---------------------------------------------------------------------------------------------
# Training loops


def _lr(step: int, base: float, floor: float, warmup: int, total: int) -> float:
    if step < warmup:
        return base * (step + 1) / warmup
    frac = min(1.0, (step - warmup) / max(1, total - warmup))
    return floor + 0.5 * (1 + math.cos(math.pi * frac)) * (base - floor)


def _save(path: Path, state: dict) -> None:
    with atomic_path(path) as tmp:
        torch.save(state, tmp)


def warm_start(drafter, path: Path) -> None:
    """Load a trained drafter's weights (and length head) into ``drafter``, in place; the
    architecture must match, except that ``drafter``'s MLPs may be wider (the checkpoint's
    hashes are verified first)."""
    from sglang_adaflash.drafter.checkpoint import read_checkpoint

    init_cfg, state = read_checkpoint(path)
    mine = drafter.config
    for k in ("hidden_size", "num_hidden_layers", "target_layer_ids", "block_size", "vocab_size",
              "mask_token_id"):
        if getattr(init_cfg, k) != getattr(mine, k):
            raise ValueError(f"init_from {path}: {k}={getattr(init_cfg, k)}, but this recipe "
                             f"builds {getattr(mine, k)}")
    if init_cfg.intermediate_size > mine.intermediate_size:
        raise ValueError(f"init_from {path}: its MLP is {init_cfg.intermediate_size} wide, wider "
                         f"than this recipe's {mine.intermediate_size}")
    if any(k.startswith("thresh_head") for k in state):
        drafter.ensure_length_head()
    ref = drafter.fc.weight  # the embedding and LM head are the target's, in no state dict
    state = {k: v.to(dtype=ref.dtype, device=ref.device) for k, v in state.items()}
    if init_cfg.intermediate_size < mine.intermediate_size:
        state = _widen_mlps(state, drafter.state_dict())
    drafter.load_state_dict(state)


def _widen_mlps(state: dict, fresh: dict) -> dict:
    """A trained drafter's weights in a drafter with wider MLPs, computing the same function:
    the new units keep their fresh random gate and up rows, and their down-projection columns
    start at zero, so they add nothing until training moves them (Net2Net's idea)."""
    out = dict(state)
    for name, w in state.items():
        new = fresh[name]
        if new.shape == w.shape:
            continue
        grown = new.detach().clone()
        if name.endswith(("mlp.gate_proj.weight", "mlp.up_proj.weight")):
            grown[:w.shape[0]] = w  # [I, H]: old units first
        elif name.endswith("mlp.down_proj.weight"):
            grown.zero_()
            grown[:, :w.shape[1]] = w  # [H, I]: the new units' outputs start at zero
        else:
            raise ValueError(f"{name}: {tuple(w.shape)} cannot grow to {tuple(new.shape)}")
        out[name] = grown
    return out


def train_drafter(target, tokenizer, seqs: list[dict], cfg: DrafterTrainConfig, work_dir: Path,
                  progress: bool = True):
    """Train the drafter layers (target frozen) and return ``(drafter, stats)``."""
    from tqdm.auto import tqdm

    work_dir = Path(work_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    mask_id = tokenizer.convert_tokens_to_ids(cf.MASK)
    drafter = build_drafter(target.config, cfg, mask_id)
    drafter.share_target_modules(target.get_input_embeddings(), target.get_output_embeddings())
    if cfg.init_from:
        warm_start(drafter, Path(cfg.init_from))
    for p in target.parameters():
        p.requires_grad_(False)
    params = [p for n, p in drafter.named_parameters() if not n.startswith("thresh_head")]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    ckpt = work_dir / "drafter_ckpt.pt"
    step = 0
    if ckpt.exists():
        state = torch.load(ckpt, map_location="cpu", weights_only=False)
        saved = DrafterTrainConfig.from_dict(state["config"])
        for k in ("num_layers", "intermediate_size", "target_layer_ids", "block_size", "init_from"):
            if getattr(saved, k) != getattr(cfg, k):
                raise ValueError(f"{ckpt} was trained with {k}={getattr(saved, k)}, now "
                                 f"{getattr(cfg, k)}: delete it or use the same config")
        drafter.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        step = state["step"]
    slots = loss_slots(cfg.block_size, cfg.gamma)
    weights = position_weights(cfg.block_size, cfg.gamma)[:slots]
    usable = [s for s in seqs if len(s["output_ids"]) >= 2]
    per_epoch = max(1, len(usable) // cfg.batch_size)
    log_path = work_dir / "drafter_log.jsonl"
    target.eval()
    drafter.train()
    bar = tqdm(total=cfg.max_steps, initial=step, desc="drafter", disable=not progress,
               dynamic_ncols=True)
    ema = None
    while step < cfg.max_steps:
        lr = _lr(step, cfg.lr, cfg.min_lr, cfg.warmup_steps, cfg.max_steps)
        for g in opt.param_groups:
            g["lr"] = lr
        if step > 0 and step % cfg.ckpt_every == 0:
            _save(ckpt, {"model": drafter.state_dict(), "optimizer": opt.state_dict(),
                         "step": step, "config": asdict(cfg)})
        t0 = time.time()
        # Batches and anchors are a function of (seed, step): a resumed run sees the same data.
        epoch, i = divmod(step, per_epoch)
        order = list(range(len(usable)))
        random.Random(cfg.seed * 1000 + epoch).shuffle(order)
        batch = [usable[j] for j in order[i * cfg.batch_size:(i + 1) * cfg.batch_size]]
        rng = random.Random(cfg.seed * 7919 + step)
        ids, lens, plens = collate(batch, tokenizer.pad_token_id)
        anchors = [sample_anchors(p, n, cfg.anchors_per_seq, rng) for p, n in zip(plens, lens)]
        blocks = make_blocks(ids, lens, anchors, cfg.block_size, mask_id)
        feats, final_states = target_features_and_states(target, ids, cfg.target_layer_ids)
        hidden = drafter_forward(drafter, feats, blocks, slots)
        logits = drafter.logits(hidden)  # [N, slots, V]
        labels = blocks.labels[:, :slots]
        loss = weighted_ce(logits, labels, weights)
        if cfg.kd_weight > 0:
            teacher = block_teacher_logits(target, final_states, blocks, slots)
            kd = distill_kl(logits, teacher, labels, weights, cfg.kd_temperature)
            loss = (1 - cfg.kd_weight) * loss + cfg.kd_weight * kd
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        with torch.no_grad():
            acc = accept_lengths(logits.argmax(-1), labels).float().mean().item() + 1
        li = loss.item()
        ema = li if ema is None else 0.9 * ema + 0.1 * li
        bar.update(1)
        bar.set_postfix(loss=f"{ema:.3f}", tau=f"{acc:.2f}", lr=f"{lr:.1e}")
        _log(log_path, {"event": "step", "step": step, "loss": round(li, 4), "tau": round(acc, 3),
                        "grad_norm": round(float(gnorm), 3), "lr": lr,
                        "step_s": round(time.time() - t0, 3)})
    bar.close()
    _save(ckpt, {"model": drafter.state_dict(), "optimizer": opt.state_dict(), "step": step,
                 "config": asdict(cfg)})
    return drafter, {"steps": step, "final_loss": ema}


def train_length_head(target, tokenizer, drafter, seqs: list[dict], cfg: DrafterTrainConfig,
                      work_dir: Path, progress: bool = True) -> dict:
    """Train the length head on detached drafter states (no gradient reaches the drafter)."""
    from tqdm.auto import tqdm

    from sglang_adaflash.drafter.length_head import length_label

    head = drafter.ensure_length_head()
    opt = torch.optim.AdamW(head.parameters(), lr=cfg.head_lr)
    ckpt = Path(work_dir) / "head_ckpt.pt"
    step = 0
    if ckpt.exists():
        state = torch.load(ckpt, map_location="cpu", weights_only=False)
        head.load_state_dict(state["head"])
        opt.load_state_dict(state["optimizer"])
        step = state["step"]
    usable = [s for s in seqs if len(s["output_ids"]) >= 2]
    mask_id = tokenizer.convert_tokens_to_ids(cf.MASK)
    drafter.eval()
    bar = tqdm(total=cfg.head_steps, initial=step, desc="length head", disable=not progress,
               dynamic_ncols=True)
    ema = None
    while step < cfg.head_steps:
        if step > 0 and step % cfg.ckpt_every == 0:
            _save(ckpt, {"head": head.state_dict(), "optimizer": opt.state_dict(), "step": step})
        rng = random.Random(cfg.seed * 104729 + step)
        batch = rng.sample(usable, min(cfg.batch_size, len(usable)))
        ids, lens, plens = collate(batch, tokenizer.pad_token_id)
        anchors = [sample_anchors(p, n, cfg.anchors_per_seq, rng) for p, n in zip(plens, lens)]
        blocks = make_blocks(ids, lens, anchors, cfg.block_size, mask_id)
        with torch.no_grad():
            feats = target_features(target, ids, cfg.target_layer_ids)
            hidden = drafter_forward(drafter, feats, blocks)  # detached states
            acc = accept_lengths(drafter.logits(hidden).argmax(-1), blocks.labels)
        label = length_label(acc, cfg.block_size)
        loss = F.mse_loss(head(hidden), label)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        ema = loss.item() if ema is None else 0.9 * ema + 0.1 * loss.item()
        bar.update(1)
        bar.set_postfix(mse=f"{ema:.4f}")
    bar.close()
    _save(ckpt, {"head": head.state_dict(), "optimizer": opt.state_dict(), "step": step})
    return {"steps": step, "final_mse": ema}


@torch.no_grad()
def evaluate_blocks(target, tokenizer, drafter, seqs: list[dict], cfg: DrafterTrainConfig,
                    seed: int = 0) -> dict:
    """Mean tau of one-block drafts at random anchors (teacher-forced context): a quick proxy."""
    mask_id = tokenizer.convert_tokens_to_ids(cf.MASK)
    rng = random.Random(seed)
    taus = []
    for i in range(0, len(seqs), cfg.batch_size):
        batch = [s for s in seqs[i:i + cfg.batch_size] if len(s["output_ids"]) >= 2]
        if not batch:
            continue
        ids, lens, plens = collate(batch, tokenizer.pad_token_id)
        anchors = [sample_anchors(p, n, 4, rng) for p, n in zip(plens, lens)]
        blocks = make_blocks(ids, lens, anchors, cfg.block_size, mask_id)
        hidden = drafter_forward(drafter, target_features(target, ids, cfg.target_layer_ids),
                                 blocks)
        taus += (accept_lengths(drafter.logits(hidden).argmax(-1), blocks.labels) + 1).tolist()
    return {"tau_mean": sum(taus) / max(1, len(taus)), "blocks": len(taus)}


def export_drafter(drafter, target_dir: Path, out_dir: Path, cfg: DrafterTrainConfig,
                   training: dict, eval_: dict, version: str = "v000001") -> Path:
    """DFlash-format checkpoint plus manifest.json (hashes of the files written)."""
    from sglang_adaflash.drafter.checkpoint import write_checkpoint
    from sglang_adaflash.drafter.manifest import build_manifest, target_fingerprint

    dtype = getattr(torch, cfg.save_dtype)
    state = {k: v.to(dtype) for k, v in drafter.state_dict().items()}
    out_dir = Path(out_dir)
    write_checkpoint(out_dir, drafter.config, state, overwrite=True)
    manifest = build_manifest(out_dir, version=version, parent=None,
                              target=target_fingerprint(target_dir), training=training,
                              eval=eval_)
    atomic_write_text(out_dir / "manifest.json", json.dumps(manifest, indent=2, sort_keys=True)
                      + "\n")
    return out_dir


def _log(path: Path, rec: dict) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps({"time": round(time.time(), 3), **rec}) + "\n")


if __name__ == "__main__":
    # `python -m training_job.dflash_offline` is the recipe's command (training_job.recipe: any
    # local Hugging Face causal LM, torchrun, publishing); it runs as this script, so the
    # recipe's functions here import nothing above them.
    import runpy

    runpy.run_module("training_job.recipe", run_name="__main__", alter_sys=True)
