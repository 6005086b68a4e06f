"""One OPD (or OSD) round over a buffer of served responses, resumable and data-parallel.

The blocks are the offline recipe's (``training_job.dflash_offline``: random anchors among
response positions, anchor token plus B-1 masks, context strictly before the anchor, slot k
labelled by the token at anchor+k); only the loss differs (:mod:`training_job.opd.loss`).

By default the step is the AdaFlash reference's: every sequence is its own normalisation group
(the reference trains micro-batches of one sequence and accumulates), the length head trains in
the same step on the drafter's detached block states (label tau/B, MSE, its own parameter group
at ``head_lr``), one gradient-norm clip covers drafter and head, AdamW (0.9, 0.999) with weight
decay 0.01. ``scope="batch"``, ``head="refit"``, ``adam_beta2=0.95``, ``weight_decay=0`` are
this project's earlier choices, kept as options (benchmarks/opd/README.md, "Ablation").

Determinism is what makes resume and data parallelism exact: the batches of a step are a function
of (seed, epoch) and the anchors of a sequence a function of (seed, epoch, its index), never of
the rank count or of where a previous run stopped. Under ``torchrun`` each rank takes every
``world``-th sequence of the global batch, the batch-wide denominators are all-reduced, and the
gradients are summed across ranks before clipping, so two ranks compute the update one process
would on the whole batch. The gradient exchange is an explicit all-reduce rather than
DistributedDataParallel's forward hooks: the drafter's forward is several calls (context
projection, per-layer K/V, the block), and the last batch of an epoch may leave a rank without a
sequence, both of which DDP's reducer handles badly.

Every tensor a collective sees lives on the training device (NCCL accepts nothing else), and a
step synchronises with the host once, after its statistics are reduced (for the log line).
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch

from training_job.dflash_offline import (
    _save,
    accept_lengths,
    collate,
    drafter_forward,
    make_blocks,
    position_weights,
    sample_anchors,
)

from .loss import NORM_EPS, NORMS, opd_loss, osd_loss

#: --loss -> the name the manifest's training.algorithm records.
LOSSES = {"rkl": "opd-rkl", "fkl": "opd-fkl", "sft": "osd-ce"}
#: The old --algorithm names, still accepted.
ALGORITHM_ALIASES = {"opd": "rkl", "osd": "sft"}
SCOPES = ("sequence", "batch")
HEAD_MODES = ("joint", "refit")
SCHEDULES = ("constant", "cosine")


@dataclass
class OPDConfig:
    loss: str = "rkl"  # CE on the target argmax + clipped reverse ("rkl") or forward ("fkl")
    # KL; "sft": plain CE on the response tokens (OSD)
    alpha: float = 0.8
    tau: float = 0.01
    temperature: float = 1.0
    gamma: float = 7.0
    norm: str = "weights"  # soft-term denominator: decayed-weight sum (reference) or "count"
    scope: str = "sequence"  # normalisation group: one sequence (reference) or the "batch"
    t_squared: bool = True  # multiply the KL by T^2 (reference)
    lr: float = 3e-4
    adam_beta2: float = 0.999
    weight_decay: float = 0.01
    schedule: str = "constant"  # or "cosine" (warmup, then down to min_lr): the offline recipe
    warmup_steps: int = 0
    min_lr: float = 0.0
    epochs: int = 2
    batch_size: int = 8  # sequences per step, over all ranks
    anchors_per_seq: int = 24
    grad_clip: float = 1.0
    max_seq_len: int = 1024
    seed: int = 0
    ckpt_every: int = 20
    head: str = "joint"  # length head: trained in the drafter's steps, or "refit" after them
    head_steps: int = 50  # refit only
    head_lr: float = 2e-4

    def __post_init__(self):
        if self.loss not in LOSSES:
            raise ValueError(f"loss must be one of {sorted(LOSSES)}, got {self.loss!r}")
        for name, allowed in (("norm", NORMS), ("scope", SCOPES), ("head", HEAD_MODES),
                              ("schedule", SCHEDULES)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {list(allowed)}, "
                                 f"got {getattr(self, name)!r}")
        problems = check_numbers(self)
        if problems:
            raise ValueError("; ".join(problems))

    @classmethod
    def from_dict(cls, d: dict) -> OPDConfig:
        names = {f.name for f in fields(cls)}
        if "algorithm" in d and "loss" not in d:  # a checkpoint written before --loss
            d = {**d, "loss": ALGORITHM_ALIASES.get(d["algorithm"], d["algorithm"])}
        return cls(**{k: v for k, v in d.items() if k in names})


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def check_numbers(cfg: OPDConfig) -> list[str]:
    """What is wrong with the numbers of ``cfg`` (NaN, inf, out of range), one phrase each."""
    rules = [
        ("alpha", lambda v: 0.0 <= v <= 1.0, "in [0, 1]"),
        ("tau", lambda v: v > 0, "> 0"), ("temperature", lambda v: v > 0, "> 0"),
        ("gamma", lambda v: v > 0, "> 0"), ("lr", lambda v: v > 0, "> 0"),
        ("head_lr", lambda v: v > 0, "> 0"), ("grad_clip", lambda v: v > 0, "> 0"),
        ("adam_beta2", lambda v: 0.0 <= v < 1.0, "in [0, 1)"),
        ("weight_decay", lambda v: v >= 0, ">= 0"), ("min_lr", lambda v: v >= 0, ">= 0"),
    ]
    out = [f"{name} must be a finite number {what}, got {getattr(cfg, name)}"
           for name, ok, what in rules
           if not _finite(getattr(cfg, name)) or not ok(getattr(cfg, name))]
    for name, least in (("epochs", 1), ("batch_size", 1), ("anchors_per_seq", 1),
                        ("max_seq_len", 4), ("head_steps", 0), ("warmup_steps", 0),
                        ("ckpt_every", 1)):
        if getattr(cfg, name) < least:
            out.append(f"{name} must be >= {least}, got {getattr(cfg, name)}")
    return out


@dataclass
class Parallel:
    """This process's place among the data-parallel ranks (rank 0 of 1 without torchrun), and
    the device its collectives run on (the training device: NCCL takes nothing else)."""

    rank: int = 0
    world: int = 1
    device: torch.device = torch.device("cpu")

    @classmethod
    def current(cls, device: str | torch.device = "cpu") -> Parallel:
        import torch.distributed as dist

        device = torch.device(device)
        if dist.is_available() and dist.is_initialized():
            return cls(dist.get_rank(), dist.get_world_size(), device)
        return cls(device=device)

    def sum_(self, t: torch.Tensor) -> torch.Tensor:
        if self.world > 1:
            import torch.distributed as dist

            dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t

    def barrier(self) -> None:
        if self.world > 1:
            import torch.distributed as dist

            dist.barrier()


def clip_sequence(seq: dict, max_len: int) -> dict:
    """Fit prompt + response in ``max_len`` tokens: the prompt loses its oldest tokens first,
    then the response its end (the context right before the response matters most)."""
    prompt, output = seq["prompt_ids"], seq["output_ids"]
    if len(prompt) + len(output) <= max_len:
        return seq
    output = output[: max_len - 1]
    keep = max(1, max_len - len(output))
    return {**seq, "prompt_ids": prompt[-keep:], "output_ids": output}


def _anchor_rng(seed: int, epoch: int, index: int) -> random.Random:
    return random.Random((seed * 1_000_003 + epoch) * 1_000_003 + index)


def _order(seed: int, epoch: int, n: int) -> list[int]:
    order = list(range(n))
    random.Random(seed * 7919 + epoch).shuffle(order)
    return order


def steps_per_epoch(n: int, batch_size: int) -> int:
    return max(1, math.ceil(n / batch_size))


def batch_indices(cfg: OPDConfig, step: int, n: int, seed_offset: int = 0) -> tuple[int, list]:
    """(epoch, the global batch's sequence indices) of optimizer step ``step``."""
    epoch, i = divmod(step, steps_per_epoch(n, cfg.batch_size))
    order = _order(cfg.seed + seed_offset, epoch, n)
    return epoch, order[i * cfg.batch_size:(i + 1) * cfg.batch_size]


def learning_rate(cfg: OPDConfig, step: int, total: int) -> float:
    if cfg.schedule == "constant":
        return cfg.lr
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    frac = min(1.0, (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps))
    return cfg.min_lr + 0.5 * (1 + math.cos(math.pi * frac)) * (cfg.lr - cfg.min_lr)


@torch.no_grad()
def target_pass(target, ids: torch.Tensor, layer_ids: list[int]):
    """ids [bs, C] -> (context features [bs, C, K*H], logits [bs, C, V]) in one forward."""
    out = target(input_ids=ids, output_hidden_states=True)
    feats = torch.cat([out.hidden_states[i + 1] for i in layer_ids], dim=-1)
    return feats, out.logits


@dataclass
class StepLoss:
    """One rank's share of a step: the loss to run backward on (None: this rank has no block)
    and its statistics [loss, ce, kl, clipped, head mse], detached, on the training device."""

    loss: torch.Tensor | None
    stats: torch.Tensor


def _group_norms(blocks, weights, cfg: OPDConfig, par: Parallel, groups: int, local: int):
    """Per-block denominators [N] of CE, soft term and head loss, and the group count.

    scope "batch": one group, the whole global batch (all-reduced); "sequence": each sequence
    its own group (local to the rank that holds it, which holds ``local`` sequences), and the
    step is their mean.
    """
    dev = par.device
    n = 0 if blocks is None else blocks.labels.shape[0]
    if blocks is None:
        count = wsum = torch.zeros(0, dtype=torch.float64, device=dev)
        seq = torch.zeros(0, dtype=torch.long, device=dev)
    else:
        valid = blocks.labels != -100
        wv = weights.to(device=dev, dtype=torch.float64)[None, :] * valid
        count, wsum, seq = valid.sum(1).to(torch.float64), wv.sum(1), blocks.seq_indices
    ones = torch.ones(n, dtype=torch.float64, device=dev)
    if cfg.scope == "batch":
        totals = par.sum_(torch.stack([count.sum(), wsum.sum(), ones.sum()]))
        c, w, b = (totals[i].expand(n) for i in range(3))
        return c, w, b, 1
    per = [torch.zeros(local, dtype=torch.float64, device=dev).index_add_(0, seq, x)[seq]
           for x in (count, wsum, ones)]
    return per[0], per[1], per[2], groups


def step_loss(target, drafter, seqs: list[dict], indices: list[int], epoch: int, cfg: OPDConfig,
              weights: torch.Tensor, pad_id: int, par: Parallel, *, drafter_loss: bool = True,
              head_loss: bool = True) -> StepLoss:
    """This rank's share of one global batch (every rank calls it: scope "batch" all-reduces).

    ``drafter_loss``: the OPD/OSD loss of the drafter; ``head_loss``: the length head's MSE on
    the detached block states (label tau/B against the response tokens), when it has a head.
    """
    dev = par.device
    mine = indices[par.rank::par.world]
    blocks = ids = None
    if mine:
        batch = [seqs[i] for i in mine]
        ids, lens, plens = collate(batch, pad_id)
        anchors = [sample_anchors(p, n, cfg.anchors_per_seq, _anchor_rng(cfg.seed, epoch, i))
                   for p, n, i in zip(plens, lens, mine)]
        blocks = make_blocks(ids, lens, anchors, drafter.config.block_size,
                             drafter.config.mask_token_id)
        if blocks.labels.shape[0] == 0:
            blocks = None
        else:
            ids = ids.to(dev)
            blocks = type(blocks)(*(t.to(dev) for t in (
                blocks.seq_indices, blocks.input_ids, blocks.positions, blocks.labels,
                blocks.mask)))
    count, wsum, nblocks, groups = _group_norms(blocks, weights, cfg, par, len(indices),
                                                len(mine))
    zero = torch.zeros((), device=dev)
    if blocks is None:
        return StepLoss(None, torch.zeros(5, dtype=torch.float64, device=dev))
    feats, t_logits = target_pass(target, ids, drafter.config.target_layer_ids)
    with torch.set_grad_enabled(drafter_loss and torch.is_grad_enabled()):
        hidden = drafter_forward(drafter, feats, blocks)
        d_logits = drafter.logits(hidden)
    w = weights.to(dev)
    loss = zero
    ce = kl = zero
    clipped = torch.zeros((), dtype=torch.long, device=dev)
    if drafter_loss:
        ce_norm = wsum + NORM_EPS
        if cfg.loss == "sft":
            parts = osd_loss(d_logits, blocks.labels, w, ce_norm=ce_norm, groups=groups)
        else:
            kl_norm = ce_norm if cfg.norm == "weights" else count.clamp(min=1.0)
            rows = (blocks.positions - 1).clamp(0, ids.shape[1] - 1)  # predicts slot k here
            t_sel = t_logits[blocks.seq_indices[:, None], rows]
            parts = opd_loss(d_logits, t_sel, blocks.labels, w, alpha=cfg.alpha, tau=cfg.tau,
                             temperature=cfg.temperature, divergence=cfg.loss,
                             t_squared=cfg.t_squared, ce_norm=ce_norm, kl_norm=kl_norm,
                             groups=groups)
        loss, ce, kl, clipped = parts.loss, parts.ce, parts.kl, parts.clipped
    mse = zero
    if head_loss and drafter.length_head is not None:
        from sglang_adaflash.drafter.length_head import length_label

        with torch.no_grad():
            label = length_label(accept_lengths(d_logits.argmax(-1), blocks.labels),
                                 drafter.config.block_size)
        pred = drafter.length_head(hidden.detach())
        head = ((pred - label) ** 2 / nblocks.float()).sum() / groups
        loss, mse = loss + head, head.detach()
    stats = torch.stack([loss.detach().double(), ce.double(), kl.double(), clipped.double(),
                         mse.double()])
    return StepLoss(loss, stats)


def exchange_and_clip(par: Parallel, params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Sum the gradients over the ranks (one all-reduce of one flat buffer on the training
    device), then clip their global norm; returns the norm (a tensor: no host sync)."""
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    if par.world > 1:
        flat = par.sum_(torch.cat([g.reshape(-1) for g in grads]))
        grads = list(torch.split(flat, [g.numel() for g in grads]))
    for p, g in zip(params, grads):
        p.grad = g.view_as(p)
    return torch.nn.utils.clip_grad_norm_(params, max_norm)


class Interrupted(RuntimeError):
    """Raised by ``stop_after`` (tests of resume): the process 'dies' after that step."""


class Stopped(RuntimeError):
    """``should_stop`` said so (a signal): the step's checkpoint is saved, the round resumable."""


def _optimizer(cfg: OPDConfig, body: list, head: list) -> torch.optim.Optimizer:
    groups = [{"params": body, "lr": cfg.lr}]
    if head:
        groups.append({"params": head, "lr": cfg.head_lr, "is_length_head": True})
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, cfg.adam_beta2),
                             weight_decay=cfg.weight_decay)


def train_opd(target, drafter, seqs: list[dict], cfg: OPDConfig, work_dir: str | Path, *,
              pad_id: int = 0, progress: bool = False, log=None,
              stop_after: int | None = None, should_stop=None) -> dict:
    """Train ``drafter`` (in place) on ``seqs`` for ``cfg.epochs``; resumes from ``work_dir``.

    ``target`` is the frozen Hugging Face causal LM; ``seqs`` dicts with prompt_ids and
    output_ids. With ``cfg.head == "joint"`` the length head (if the drafter has one) trains in
    the same steps. Returns the summary that goes into the manifest's ``training``.
    ``should_stop`` (a callable) is asked after every step; when it answers true the round
    checkpoints and raises :class:`Stopped`, so a signalled job loses at most one step.
    """
    from tqdm.auto import tqdm

    device = drafter.fc.weight.device
    par = Parallel.current(device)
    work_dir = Path(work_dir)
    seqs = [clip_sequence(s, cfg.max_seq_len) for s in seqs]
    seqs = [s for s in seqs if len(s["output_ids"]) >= 2]
    if not seqs:
        raise ValueError("no response of 2 tokens or more to train on")
    drafter.share_target_modules(target.get_input_embeddings(), target.get_output_embeddings())
    for p in target.parameters():
        p.requires_grad_(False)
    target.eval()
    joint = cfg.head == "joint" and drafter.length_head is not None
    body = [p for n, p in drafter.named_parameters() if not n.startswith("thresh_head")]
    head = list(drafter.length_head.parameters()) if joint else []
    params = body + head
    for p in params:
        p.requires_grad_(True)
    opt = _optimizer(cfg, body, head)
    weights = position_weights(drafter.config.block_size, cfg.gamma)
    per_epoch = steps_per_epoch(len(seqs), cfg.batch_size)
    total = cfg.epochs * per_epoch
    ckpt = work_dir / "opd_ckpt.pt"
    step, losses, head_mse = 0, [], []
    if ckpt.exists():
        state = torch.load(ckpt, map_location="cpu", weights_only=False)
        drafter.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        step, losses, head_mse = state["step"], state["losses"], state.get("head_mse", [])
    drafter.train()

    def save():
        if par.rank == 0:
            _save(ckpt, {"model": drafter.state_dict(), "optimizer": opt.state_dict(),
                         "step": step, "losses": losses, "head_mse": head_mse,
                         "config": asdict(cfg)})
        par.barrier()

    bar = tqdm(total=total, initial=step, desc=cfg.loss, disable=not progress or par.rank,
               dynamic_ncols=True)
    clipped_total = 0
    while step < total:
        if step > 0 and step % cfg.ckpt_every == 0:
            save()
        t0 = time.time()
        lr = learning_rate(cfg, step, total)
        opt.param_groups[0]["lr"] = lr
        epoch, indices = batch_indices(cfg, step, len(seqs))
        out = step_loss(target, drafter, seqs, indices, epoch, cfg, weights, pad_id, par,
                        head_loss=joint)
        if out.loss is not None:
            out.loss.backward()
        gnorm = exchange_and_clip(par, params, cfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        stats = par.sum_(out.stats)
        # The step's one host synchronisation: its statistics, for the log.
        loss, ce, kl, clipped, mse, gn = torch.cat([stats, gnorm.double().reshape(1)]).tolist()
        clipped_total += int(clipped)
        losses.append(loss)
        head_mse.append(mse)
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.4f}")
        if log is not None and par.rank == 0:
            log({"event": "step", "step": step, "epoch": epoch, "loss": round(loss, 5),
                 "ce": round(ce, 5), "kl": round(kl, 6), "clipped": int(clipped),
                 "head_mse": round(mse, 5), "grad_norm": round(gn, 4), "lr": lr,
                 "step_s": round(time.time() - t0, 3)})
        if stop_after is not None and step >= stop_after:
            raise Interrupted(f"stopped after step {step}")
        if should_stop is not None and step < total and should_stop():
            bar.close()
            save()
            raise Stopped(f"stopped after step {step} of {total}; the round resumes from there")
    bar.close()
    save()
    last = losses[-per_epoch:]
    summary = {"algorithm": LOSSES[cfg.loss], "loss": cfg.loss, "steps": step,
               "epochs": cfg.epochs, "sequences": len(seqs), "final_loss": sum(last) / len(last),
               "first_loss": losses[0], "alpha": cfg.alpha if cfg.loss != "sft" else 1.0,
               "tau": cfg.tau, "gamma": cfg.gamma, "temperature": cfg.temperature,
               "norm": cfg.norm, "scope": cfg.scope, "t_squared": cfg.t_squared, "lr": cfg.lr,
               "adam_betas": [0.9, cfg.adam_beta2], "weight_decay": cfg.weight_decay,
               "batch_size": cfg.batch_size, "anchors_per_seq": cfg.anchors_per_seq,
               "ranks": par.world}
    if joint:
        tail = head_mse[-per_epoch:]
        summary["length_head"] = {"mode": "joint", "steps": step, "lr": cfg.head_lr,
                                  "final_mse": sum(tail) / len(tail)}
    return summary


def train_head(target, drafter, seqs: list[dict], cfg: OPDConfig, work_dir: str | Path, *,
               pad_id: int = 0, progress: bool = False) -> dict | None:
    """Refit the length head to the trained drafter (``head="refit"``; resumable).

    ``cfg.head_steps`` steps of the head's MSE on the detached states of the drafter, whose
    weights stay as they are; batches and anchors as in training (another seed). Only a drafter
    that already has a head gets one: adding a head would change the buffers a serving process
    holds, and hot reload refuses such a version.
    """
    from tqdm.auto import tqdm

    if drafter.length_head is None or cfg.head_steps < 1 or cfg.head != "refit":
        return None
    seqs = [clip_sequence(s, cfg.max_seq_len) for s in seqs]
    seqs = [s for s in seqs if len(s["output_ids"]) >= 2]
    drafter.share_target_modules(target.get_input_embeddings(), target.get_output_embeddings())
    par = Parallel(device=drafter.fc.weight.device)  # cheap: rank 0 alone
    head = drafter.length_head
    opt = torch.optim.AdamW(head.parameters(), lr=cfg.head_lr)
    ckpt = Path(work_dir) / "head_ckpt.pt"
    step, mse = 0, []
    if ckpt.exists():
        state = torch.load(ckpt, map_location="cpu", weights_only=False)
        head.load_state_dict(state["head"])
        opt.load_state_dict(state["optimizer"])
        step, mse = state["step"], state.get("mse", [])
    weights = position_weights(drafter.config.block_size, cfg.gamma)
    batch_cfg = OPDConfig(**{**asdict(cfg), "scope": "batch"})
    drafter.eval()
    bar = tqdm(total=cfg.head_steps, initial=step, desc="length head", disable=not progress,
               dynamic_ncols=True)
    while step < cfg.head_steps:
        if step > 0 and step % cfg.ckpt_every == 0:
            _save(ckpt, {"head": head.state_dict(), "optimizer": opt.state_dict(), "step": step,
                         "mse": mse})
        epoch, indices = batch_indices(batch_cfg, step, len(seqs), seed_offset=104729)
        out = step_loss(target, drafter, seqs, indices, epoch, batch_cfg, weights, pad_id, par,
                        drafter_loss=False)
        if out.loss is not None:
            out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        mse.append(float(out.stats[4]))  # one host sync per step
        bar.update(1)
    bar.close()
    _save(ckpt, {"head": head.state_dict(), "optimizer": opt.state_dict(), "step": step,
                 "mse": mse})
    return {"mode": "refit", "steps": step, "lr": cfg.head_lr,
            "final_mse": sum(mse[-10:]) / len(mse[-10:])}
