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
import os
import random
import time
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from sglang_adaflash.assets import chat_format as cf
from sglang_adaflash.fsio import atomic_path

from .data.common import atomic_write_text, read_jsonl

IGNORE = -100


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
def regenerate(target, tokenizer, records: list[dict], out_path: Path, max_new_tokens: int,
               batch_size: int, progress: bool = True) -> list[dict]:
    """Greedy target responses for ``records``; appends to ``out_path`` and resumes from it.

    Each line: ``id``, ``domain``, ``prompt_ids``, ``output_ids`` (up to and including the stop
    token, if the target stopped), like the traffic record format.
    """
    stop_ids = {tokenizer.convert_tokens_to_ids(t) for t in cf.STOP_TOKENS}
    items = [(r["id"], r["domain"], tokenizer(cf.render_prompt(r["prompt"]), add_special_tokens=False)
              ["input_ids"]) for r in records]
    return generate_greedy(target, items, out_path, max_new_tokens, stop_ids, batch_size, progress)


def continuation_contexts(tokenizer, records: list[dict], max_context: int = 400,
                          pass_: int = 0) -> list[tuple]:
    """``(id, domain, context ids)`` per record: its prompt and its reference response cut at a
    point drawn from the record's id and ``pass_`` (so a rebuild cuts the same place, and each
    pass somewhere else), the last ``max_context`` tokens of that. The target continues these
    greedily: data from the middle of responses and from longer contexts than a prompt alone
    gives (acceptance falls with context length: benchmarks/adaptive/context/)."""
    out = []
    for r in records:
        prompt = tokenizer(cf.render_prompt(r["prompt"]), add_special_tokens=False)["input_ids"]
        resp = tokenizer(r["response"], add_special_tokens=False)["input_ids"]
        if len(resp) < 16:
            continue
        tag = "" if pass_ == 0 else str(pass_)  # pass 0 keeps the first recipe's ids and cuts
        cut = random.Random(f"{r['id']}-cut{tag}").randint(8, len(resp) - 4)
        out.append((f"{r['id']}#cont{tag}", r["domain"], (prompt + resp[:cut])[-max_context:]))
    return out


@torch.no_grad()
def generate_greedy(target, items: list[tuple], out_path: Path, max_new_tokens: int, stop_ids,
                    batch_size: int, progress: bool = True) -> list[dict]:
    """The target's greedy continuation of each ``(id, domain, prompt ids)``, with the reference
    engine in mode ``ar`` (continuous batching: 5-10x HF ``generate`` with left padding here,
    and token for token the same output, tests/engine/test_lossless_greedy.py). Appends one
    line per item to ``out_path`` (fsynced per batch) and resumes from what is there."""
    from tqdm.auto import tqdm

    from sglang_adaflash.core.sampling import SamplingParams
    from sglang_adaflash.engine.engine import SpecEngine
    from sglang_adaflash.engine.request import Request
    from sglang_adaflash.target.hf_target import HFTarget

    out_path = Path(out_path)
    done = {}
    if out_path.exists():
        for r in _read_tolerant(out_path):
            done[r["id"]] = r
    limit = int(getattr(target.config, "max_position_embeddings", 0) or 1 << 30)
    new_tokens = max(1, min(max_new_tokens, limit - 1))
    # a context longer than the target's window keeps its last tokens (the shipped target's
    # prompts all fit: at most 356 of its 512 positions)
    todo = [(i, d, list(p)[-(limit - new_tokens):]) for i, d, p in items if i not in done]
    engine = SpecEngine(HFTarget(target), None, mode="ar", max_batch_size=max(1, batch_size),
                        max_seq_len=max((len(p) for _, _, p in todo), default=1) + new_tokens)
    stops = tuple(sorted(stop_ids))
    bar = tqdm(total=len(todo), desc="regenerate", disable=not progress, dynamic_ncols=True)
    chunk = 4 * max(1, batch_size)  # a write and fsync per chunk; the engine refills its slots
    with open(out_path, "a", encoding="utf-8") as f:
        for i in range(0, len(todo), chunk):
            part = todo[i:i + chunk]
            reqs = [Request(p, SamplingParams(max_new_tokens=new_tokens, stop_token_ids=stops))
                    for _, _, p in part]
            for (rid, domain, p), o in zip(part, engine.run(reqs)):
                rec = {"id": rid, "domain": domain, "prompt_ids": p, "output_ids": o.output_ids}
                done[rid] = rec
                f.write(json.dumps(rec) + "\n")
            f.flush()
            os.fsync(f.fileno())
            bar.update(len(part))
    bar.close()
    return [done[it[0]] for it in items]


def _read_tolerant(path: Path):
    """JSONL records, skipping a torn last line (a killed run)."""
    try:
        yield from read_jsonl(path)
    except json.JSONDecodeError:
        good = []
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    good.append(json.loads(line))
                except json.JSONDecodeError:
                    break
        yield from good


# ---------------------------------------------------------------------------------------------
# 2. Blocks and the drafter loss (pure functions; tests call them directly)


def sample_anchors(prompt_len: int, seq_len: int, num: int, rng: random.Random) -> list[int]:
    """Distinct anchors among response positions that leave at least one label after them."""
    lo, hi = max(prompt_len, 1), seq_len - 2  # anchor + 1 <= seq_len - 1
    if hi < lo:
        return []
    cand = list(range(lo, hi + 1))
    return sorted(rng.sample(cand, min(num, len(cand))))


@dataclass
class Blocks:
    """Training blocks of one batch; N blocks, block size B, context length C (padded)."""

    # [N] which sequence of the batch each block belongs to
    seq_indices: torch.Tensor
    # [N, B] anchor token then mask tokens
    input_ids: torch.Tensor
    # [N, B] absolute positions anchor..anchor+B-1
    positions: torch.Tensor
    # [N, B] token at anchor+k for slot k >= 1; IGNORE for slot 0 and past the sequence
    labels: torch.Tensor
    # [N, 1, B, C+B] True = may attend: context keys < anchor, all keys of its own block
    mask: torch.Tensor


def make_blocks(ids: torch.Tensor, lens: list[int], anchors: list[list[int]], block_size: int,
                mask_token_id: int) -> Blocks:
    """ids [bs, C] (padded), lens [bs], anchors per sequence -> :class:`Blocks`."""
    c = ids.shape[1]
    seq_idx, inp, pos, lab, ctx_ok = [], [], [], [], []
    key_pos = torch.arange(c)
    ks = torch.arange(block_size)
    for i, (n, anchor_list) in enumerate(zip(lens, anchors)):
        for a in anchor_list:
            seq_idx.append(i)
            row = torch.full((block_size,), mask_token_id, dtype=torch.long)
            row[0] = ids[i, a]
            inp.append(row)
            pos.append(a + ks)
            tgt = torch.full((block_size,), IGNORE, dtype=torch.long)
            upto = min(block_size, n - a)
            tgt[1:upto] = ids[i, a + 1:a + upto]
            lab.append(tgt)
            ctx_ok.append(key_pos < a)
    n_blocks = len(seq_idx)
    ctx = torch.stack(ctx_ok) if n_blocks else torch.zeros(0, c, dtype=torch.bool)
    own = torch.ones(n_blocks, block_size, dtype=torch.bool)
    mask = torch.cat([ctx[:, None, :].expand(-1, block_size, -1),
                      own[:, None, :].expand(-1, block_size, -1)], dim=-1)[:, None]
    return Blocks(torch.tensor(seq_idx, dtype=torch.long), torch.stack(inp), torch.stack(pos),
                  torch.stack(lab), mask)


def position_weights(block_size: int, gamma: float) -> torch.Tensor:
    """[B] slot weights: 0 for slot 0, exp(-(k-1)/gamma) for slot k >= 1."""
    k = torch.arange(block_size, dtype=torch.float32)
    w = torch.exp(-(k - 1) / gamma)
    w[0] = 0.0
    return w


def loss_slots(block_size: int, gamma: float, floor: float = 0.01) -> int:
    """Leading block slots (slot 0 included) whose weight exp(-(k-1)/gamma) is at least
    ``floor``: the drafter's last layer, the LM head and the loss run on these alone in training
    (every slot still gives keys and values, so their states are exactly the whole block's).
    Gamma 7 keeps all 16 slots of a block; gamma 2 keeps 11, and the 5 it drops weighed 1.4%
    of a block, for a third of the LM head's work."""
    w = position_weights(block_size, gamma)
    return max(2, min(block_size, int((w[1:] >= floor).sum()) + 1))


def weighted_ce(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """logits [N, B, V], labels [N, B], weights [B] -> weighted mean CE over valid slots."""
    ce = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten().clamp(min=0),
                         reduction="none").view(labels.shape)
    w = weights[None, :] * (labels != IGNORE)
    return (ce * w).sum() / w.sum().clamp(min=1e-8)


def distill_kl(logits: torch.Tensor, teacher_logits: torch.Tensor, labels: torch.Tensor,
               weights: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Weighted mean over valid slots of KL(p_teacher || p_drafter) at ``temperature`` (times
    T^2, so the gradient's scale does not shrink with T).

    logits, teacher_logits [N, B, V] (slot k's teacher is the target's distribution at the
    position before slot k's label); labels [N, B] mark the valid slots; weights [B].
    The teacher is detached. At T=0 on regenerated data the hard label is the teacher's argmax,
    so this gives the drafter the rest of the target's distribution: which near misses are near.
    """
    t = float(temperature)
    log_q = F.log_softmax(logits.float() / t, dim=-1)
    log_p = F.log_softmax(teacher_logits.detach().float() / t, dim=-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1) * (t * t)  # [N, B]
    w = weights[None, :] * (labels != IGNORE)
    return (kl * w).sum() / w.sum().clamp(min=1e-8)


def accept_lengths(proposals: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Leading proposals (slots 1..B-1) equal to the labels. [N, B] x2 -> [N] long."""
    ok = (proposals[:, 1:] == labels[:, 1:]) & (labels[:, 1:] != IGNORE)
    return ok.long().cumprod(dim=1).sum(dim=1)


# ---------------------------------------------------------------------------------------------
# The forward over one batch


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
