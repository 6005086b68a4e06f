"""One OPD (or OSD) round over a buffer of served responses, resumable and data-parallel.

The blocks are the offline recipe's (``training_job.dflash_offline``: random anchors among
response positions, anchor token plus B-1 masks, context strictly before the anchor, slot k
labelled by the token at anchor+k); only the loss differs (:mod:`training_job.opd.loss`).

Determinism is what makes resume and data parallelism exact: the batches of a step are a function
of (seed, epoch) and the anchors of a sequence a function of (seed, epoch, its index), never of
the rank count or of where a previous run stopped. Under ``torchrun`` each rank takes every
``world``-th sequence of the global batch, the loss denominators are all-reduced, and the
gradients are summed across ranks before clipping, so two ranks compute the update one process
would on the whole batch. The gradient exchange is an explicit all-reduce rather than
DistributedDataParallel's forward hooks: the drafter's forward is several calls (context
projection, per-layer K/V, the block), the length head takes no part in it, and the last batch of
an epoch may leave a rank without a sequence, all of which DDP's reducer handles badly.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch

from training_job.dflash_offline import (
    DrafterTrainConfig,
    _save,
    collate,
    drafter_forward,
    make_blocks,
    position_weights,
    sample_anchors,
    train_length_head,
)

from .loss import denominators, opd_loss, osd_loss

#: --loss -> the name the manifest's training.algorithm records.
LOSSES = {"rkl": "opd-rkl", "fkl": "opd-fkl", "sft": "osd-ce"}
#: The old --algorithm names, still accepted.
ALGORITHM_ALIASES = {"opd": "rkl", "osd": "sft"}


@dataclass
class OPDConfig:
    loss: str = "rkl"  # CE on the target argmax + clipped reverse ("rkl") or forward ("fkl")
    # KL; "sft": plain CE on the response tokens (OSD)
    alpha: float = 0.8
    tau: float = 0.01
    temperature: float = 1.0
    gamma: float = 7.0
    lr: float = 3e-4
    epochs: int = 2
    batch_size: int = 8  # sequences per step, over all ranks
    anchors_per_seq: int = 24
    grad_clip: float = 1.0
    weight_decay: float = 0.0
    max_seq_len: int = 1024
    seed: int = 0
    ckpt_every: int = 20
    head_steps: int = 50
    head_lr: float = 2e-4

    def __post_init__(self):
        if self.loss not in LOSSES:
            raise ValueError(f"loss must be one of {sorted(LOSSES)}, got {self.loss!r}")
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"alpha must lie in [0, 1], got {self.alpha}")
        if self.tau <= 0 or self.temperature <= 0 or self.lr <= 0:
            raise ValueError("tau, temperature and lr must be > 0")
        if self.epochs < 1 or self.batch_size < 1 or self.anchors_per_seq < 1:
            raise ValueError("epochs, batch_size and anchors_per_seq must be >= 1")
        if self.max_seq_len < 4:
            raise ValueError(f"max_seq_len must be >= 4, got {self.max_seq_len}")

    @classmethod
    def from_dict(cls, d: dict) -> OPDConfig:
        names = {f.name for f in fields(cls)}
        if "algorithm" in d and "loss" not in d:  # a checkpoint written before --loss
            d = {**d, "loss": ALGORITHM_ALIASES.get(d["algorithm"], d["algorithm"])}
        return cls(**{k: v for k, v in d.items() if k in names})


@dataclass
class Parallel:
    """This process's place among the data-parallel ranks (rank 0 of 1 without torchrun)."""

    rank: int = 0
    world: int = 1

    @classmethod
    def current(cls) -> Parallel:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return cls(dist.get_rank(), dist.get_world_size())
        return cls()

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


@torch.no_grad()
def target_pass(target, ids: torch.Tensor, layer_ids: list[int]):
    """ids [bs, C] -> (context features [bs, C, K*H], logits [bs, C, V]) in one forward."""
    out = target(input_ids=ids, output_hidden_states=True)
    feats = torch.cat([out.hidden_states[i + 1] for i in layer_ids], dim=-1)
    return feats, out.logits


def block_losses(target, drafter, seqs: list[dict], indices: list[int], epoch: int,
                 cfg: OPDConfig, weights: torch.Tensor, pad_id: int, par: Parallel):
    """This rank's share of one global batch -> LossParts (global denominators)."""
    mine = indices[par.rank::par.world]
    device = drafter.fc.weight.device
    blocks = None
    if mine:
        batch = [seqs[i] for i in mine]
        ids, lens, plens = collate(batch, pad_id)
        anchors = [sample_anchors(p, n, cfg.anchors_per_seq, _anchor_rng(cfg.seed, epoch, i))
                   for p, n, i in zip(plens, lens, mine)]
        blocks = make_blocks(ids, lens, anchors, drafter.config.block_size,
                             drafter.config.mask_token_id)
        count, wsum = denominators(blocks.labels, weights)
    else:
        count = wsum = torch.zeros((), dtype=torch.float64)
    totals = par.sum_(torch.stack([count, wsum]))
    if blocks is None or blocks.labels.shape[0] == 0:
        return None, totals
    ids = ids.to(device)
    blocks = type(blocks)(*(t.to(device) for t in (blocks.seq_indices, blocks.input_ids,
                                                    blocks.positions, blocks.labels, blocks.mask)))
    feats, t_logits = target_pass(target, ids, drafter.config.target_layer_ids)
    hidden = drafter_forward(drafter, feats, blocks)
    d_logits = drafter.logits(hidden)
    w = weights.to(device)
    if cfg.loss == "sft":
        return osd_loss(d_logits, blocks.labels, w, weight_sum=totals[1]), totals
    rows = (blocks.positions - 1).clamp(0, ids.shape[1] - 1)  # the target predicts slot k here
    t_sel = t_logits[blocks.seq_indices[:, None], rows]
    return opd_loss(d_logits, t_sel, blocks.labels, w, alpha=cfg.alpha, tau=cfg.tau,
                    temperature=cfg.temperature, count=totals[0], weight_sum=totals[1],
                    divergence=cfg.loss), totals


class Interrupted(RuntimeError):
    """Raised by ``stop_after`` (tests of resume): the process 'dies' after that step."""


class Stopped(RuntimeError):
    """``should_stop`` said so (a signal): the step's checkpoint is saved, the round resumable."""


def train_opd(target, drafter, seqs: list[dict], cfg: OPDConfig, work_dir: str | Path, *,
              pad_id: int = 0, progress: bool = False, log=None,
              stop_after: int | None = None, should_stop=None) -> dict:
    """Train ``drafter`` (in place) on ``seqs`` for ``cfg.epochs``; resumes from ``work_dir``.

    ``target`` is the frozen Hugging Face causal LM; ``seqs`` dicts with prompt_ids and
    output_ids. Returns the summary that goes into the manifest's ``training``. ``should_stop``
    (a callable) is asked after every step; when it answers true the round checkpoints and
    raises :class:`Stopped`, so a signalled job loses at most one step.
    """
    from tqdm.auto import tqdm

    par = Parallel.current()
    work_dir = Path(work_dir)
    seqs = [clip_sequence(s, cfg.max_seq_len) for s in seqs]
    seqs = [s for s in seqs if len(s["output_ids"]) >= 2]
    if not seqs:
        raise ValueError("no response of 2 tokens or more to train on")
    drafter.share_target_modules(target.get_input_embeddings(), target.get_output_embeddings())
    for p in target.parameters():
        p.requires_grad_(False)
    target.eval()
    params = [p for n, p in drafter.named_parameters() if not n.startswith("thresh_head")]
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    weights = position_weights(drafter.config.block_size, cfg.gamma)
    per_epoch = steps_per_epoch(len(seqs), cfg.batch_size)
    total = cfg.epochs * per_epoch
    ckpt = work_dir / "opd_ckpt.pt"
    step, losses = 0, []
    if ckpt.exists():
        state = torch.load(ckpt, map_location="cpu", weights_only=False)
        drafter.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        step, losses = state["step"], state["losses"]
    drafter.train()

    def save():
        if par.rank == 0:
            _save(ckpt, {"model": drafter.state_dict(), "optimizer": opt.state_dict(),
                         "step": step, "losses": losses, "config": asdict(cfg)})
        par.barrier()

    bar = tqdm(total=total, initial=step, desc=cfg.loss, disable=not progress or par.rank,
               dynamic_ncols=True)
    clipped_total = 0
    while step < total:
        if step > 0 and step % cfg.ckpt_every == 0:
            save()
        t0 = time.time()
        epoch, i = divmod(step, per_epoch)
        indices = _order(cfg.seed, epoch, len(seqs))[i * cfg.batch_size:(i + 1) * cfg.batch_size]
        parts, _ = block_losses(target, drafter, seqs, indices, epoch, cfg, weights, pad_id, par)
        if parts is not None:
            parts.loss.backward()
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        if par.world > 1:
            flat = par.sum_(torch.cat([g.reshape(-1) for g in grads]))
            grads = list(torch.split(flat, [g.numel() for g in grads]))
        for p, g in zip(params, grads):
            p.grad = g.view_as(p)
        gnorm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        local = torch.tensor([0.0, 0.0, 0.0, 0.0], dtype=torch.float64)
        if parts is not None:
            local = torch.tensor([parts.loss.item(), parts.ce.item(), parts.kl.item(),
                                  float(parts.clipped)], dtype=torch.float64)
        loss, ce, kl, clipped = par.sum_(local).tolist()
        clipped_total += int(clipped)
        losses.append(loss)
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.4f}")
        if log is not None and par.rank == 0:
            log({"event": "step", "step": step, "epoch": epoch, "loss": round(loss, 5),
                 "ce": round(ce, 5), "kl": round(kl, 6), "clipped": int(clipped),
                 "grad_norm": round(float(gnorm), 4), "step_s": round(time.time() - t0, 3)})
        if stop_after is not None and step >= stop_after:
            raise Interrupted(f"stopped after step {step}")
        if should_stop is not None and step < total and should_stop():
            bar.close()
            save()
            raise Stopped(f"stopped after step {step} of {total}; the round resumes from there")
    bar.close()
    save()
    last = losses[-per_epoch:]
    return {"algorithm": LOSSES[cfg.loss], "loss": cfg.loss, "steps": step, "epochs": cfg.epochs,
            "sequences": len(seqs), "final_loss": sum(last) / len(last),
            "first_loss": losses[0], "alpha": cfg.alpha if cfg.loss != "sft" else 1.0,
            "tau": cfg.tau, "gamma": cfg.gamma, "lr": cfg.lr, "batch_size": cfg.batch_size,
            "anchors_per_seq": cfg.anchors_per_seq, "ranks": par.world}


class _TokenIds:
    """What the offline recipe asks a tokenizer for: the mask and pad ids, taken from the
    drafter's config so the head trains on exactly the blocks the drafter saw."""

    def __init__(self, mask_id: int, pad_id: int):
        self._mask, self.pad_token_id = mask_id, pad_id

    def convert_tokens_to_ids(self, _token):
        return self._mask


def train_head(target, drafter, seqs: list[dict], cfg: OPDConfig, work_dir: str | Path, *,
               pad_id: int = 0, progress: bool = False) -> dict | None:
    """Refit the length head to the updated drafter (the offline recipe's loop, resumable).

    Only a drafter that already has a head gets one: adding a head would change the buffers a
    serving process holds, and hot reload refuses such a version.
    """
    if drafter.length_head is None or cfg.head_steps < 1:
        return None
    seqs = [clip_sequence(s, cfg.max_seq_len) for s in seqs]
    drafter.share_target_modules(target.get_input_embeddings(), target.get_output_embeddings())
    dc = drafter.config
    rcfg = DrafterTrainConfig(
        num_layers=dc.num_hidden_layers, target_layer_ids=list(dc.target_layer_ids),
        block_size=dc.block_size, anchors_per_seq=cfg.anchors_per_seq,
        batch_size=cfg.batch_size, head_steps=cfg.head_steps, head_lr=cfg.head_lr,
        seed=cfg.seed, ckpt_every=cfg.ckpt_every, threads=torch.get_num_threads())
    stats = train_length_head(target, _TokenIds(dc.mask_token_id, pad_id), drafter, seqs, rcfg,
                              Path(work_dir), progress=progress)
    return {"steps": stats["steps"], "final_mse": stats["final_mse"]}
