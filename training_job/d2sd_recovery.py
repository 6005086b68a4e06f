"""Offline recipe for D2SD's recovery drafter: a variable-prefix DFlash drafter.

    python -m training_job.d2sd_recovery --target DIR --init DRAFTER --data regen.train.jsonl \
        --work WORK --out OUT [--steps N] [--eval-data regen.heldout.jsonl]

The recovery drafter has the first drafter's architecture and starts from its weights (`--init`:
a DFlash checkpoint directory, or a `drafter_ckpt.pt` of training_job.dflash_offline; the length
head is dropped: a branch's length is planned, not read from a head). It is trained on the
data the first drafter was (the target's regenerated responses, training_job.drafter_data.regenerate)
with one change to the block: at a random anchor a and a random prefix length p in [0, B-2],
block slots 0..p hold the true tokens at a..a+p and slots p+1..B-1 mask tokens; slot k > p is
labelled with the token at a+k, weighted exp(-(k-p-1)/gamma) (the first unknown slot weighs 1,
as slot 1 does in DFlash). Context features are the target's hidden states strictly before a,
as in DFlash. At serving time the known slots are the first drafter's chain up to a recovery
point and the alternative token there: the branch is only used when those are the target's
tokens, which is what training conditions on.

Failure placement (`--fail-share F`, `--exclude-chain`): the engine asks the recovery drafter
for its best token at slot r *other than the chain's*, and only ever uses it when the chain's
token at r was rejected. So a share F of the anchors take the prefix where the first drafter
really fails: the first drafter (`--first`, by default the `--init` weights, frozen) fills the
plain block at the anchor, and p = r - 1 for its first wrong slot r. With `--exclude-chain`
slot p + 1 is trained the way it is read: cross-entropy with the first drafter's token there
removed from the softmax (where that token is the right one the branch never matters, and the
slot gets no weight; the later slots keep theirs).

One branch source (`--branch-drafter joint`) asks the recovery drafter for the slot-1 branch
alone: `--max-prefix 0` trains prefix 0 only (any P caps p at P, recorded as the checkpoint's
prefix_range [0, P], which the engine then refuses for the sources that branch deeper),
`--branch-only` drops whole blocks where the chain's token after the prefix is right (a
branch's later slots are read only behind its first token), and `--gamma` sets how fast the
later slots' weights fall.

Output: a DFlash-format checkpoint (config.json, model.safetensors, manifest.json) whose
config.json carries adaflash_config.recovery_drafter (see sglang_adaflash.d2sd.recovery_drafter).
The loop checkpoints atomically every `ckpt_every` steps and resumes.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from sglang_adaflash.assets import chat_format as cf
from sglang_adaflash.d2sd.shared_context import SHARING, tie_modules

from . import dflash_offline as dfo
from .block_losses import IGNORE
from .data.common import atomic_write_text, read_jsonl


@dataclass
class RecoveryTrainConfig:
    steps: int = 600
    batch_size: int = 4
    anchors_per_seq: int = 24
    lr: float = 3e-4
    min_lr: float = 3e-5
    warmup_steps: int = 20
    gamma: float = 7.0
    grad_clip: float = 1.0
    seed: int = 4321
    threads: int = 1
    ckpt_every: int = 50
    save_dtype: str = "bfloat16"
    fail_share: float = 0.0  # anchors whose prefix ends where the first drafter first fails
    exclude_chain: bool = False  # slot p+1 trained without the first drafter's token
    share: str | None = None  # modules used as the first drafter's, frozen (sglang_adaflash.d2sd.shared_context)
    max_prefix: int | None = None  # prefixes in [0, max_prefix] only (None: [0, B-2])
    branch_only: bool = False  # an anchor weighs nothing where the chain's token at p+1 is right


def sample_prefixes(anchors: list[int], seq_len: int, block_size: int, rng: random.Random,
                    p_zero: float = 0.3, max_prefix: int | None = None) -> list[int]:
    """A prefix length p in [0, B-2] per anchor that leaves at least one label (a + p + 1 < seq_len).

    p = 0 (the plain DFlash block) with probability p_zero, else uniform in [1, B-2]: a branch at
    chain slot r has p = r - 1, and the chain fails first at slot 1 most often. `max_prefix`
    caps p (0: the slot-1 branch alone, the one `--branch-drafter joint` asks for)."""
    cap = block_size - 2 if max_prefix is None else min(max_prefix, block_size - 2)
    out = []
    for a in anchors:
        hi = min(cap, seq_len - 2 - a)
        out.append(0 if hi < 1 or rng.random() < p_zero else rng.randint(1, hi))
    return out


def first_drafter_chain(first, feats, ids, lens, anchors, block_size: int, mask_token_id: int):
    """The first drafter's chain at each anchor, as served (the plain DFlash block), and where it
    first fails against the true tokens.

    Returns chain [N, B] (slot 0 unused) and fail [N]: the first slot k >= 1 whose token is wrong,
    or B where every labelled slot is right (or no slot has a label)."""
    chain, fail, _ = _first_drafter_blocks(first, feats, ids, lens, anchors, block_size, mask_token_id)
    return chain, fail


def _first_drafter_blocks(first, feats, ids, lens, anchors, block_size: int, mask_token_id: int):
    """first_drafter_chain, plus the first drafter's logits [N, B, V] of those blocks."""
    blocks = dfo.make_blocks(ids, lens, anchors, block_size, mask_token_id)
    with torch.no_grad():
        logits = first.logits(dfo.drafter_forward(first, feats, blocks))
    chain = logits.argmax(-1)
    wrong = (chain != blocks.labels) & (blocks.labels != IGNORE)
    wrong[:, 0] = False
    k = torch.arange(block_size)[None].expand_as(wrong)
    fail = torch.where(wrong, k, block_size).min(1).values
    return chain, fail, logits


def place_prefixes(anchors: list[list[int]], lens: list[int], fail: torch.Tensor, block_size: int,
                   rng: random.Random, share: float, max_prefix: int | None = None) -> list[list[int]]:
    """Per anchor: with chance `share`, p = fail - 1 (where the first drafter's chain first fails,
    if it fails inside the block and p <= max_prefix), else sample_prefixes' p."""
    cap = block_size - 2 if max_prefix is None else max_prefix
    out, n = [], 0
    for a_list, length in zip(anchors, lens):
        row = sample_prefixes(a_list, length, block_size, rng, max_prefix=max_prefix)
        for j in range(len(a_list)):
            r = int(fail[n + j])
            if r < block_size and r - 1 <= cap and rng.random() < share:
                row[j] = r - 1
        n += len(a_list)
        out.append(row)
    return out


def exclusion_at_prefix(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor, chain: torch.Tensor,
                        prefixes: torch.Tensor, branch_only: bool = False):
    """Slot p+1 as the engine reads it: the chain's token there removed from the softmax where it
    is wrong, and no weight where it is right (the branch is never used then).

    With `branch_only` the whole block of such an anchor weighs nothing: a branch's later slots
    are read only behind its first token, which exists only where the chain's was rejected.
    Returns (logits, weights), new tensors; other slots untouched."""
    n = torch.arange(logits.shape[0])
    slot = (prefixes + 1).clamp(max=logits.shape[1] - 1)
    tok = chain[n, slot]
    right = tok == labels[n, slot]
    out = logits.clone()
    out[n[~right], slot[~right], tok[~right]] = float("-inf")
    w = weights.clone()
    if branch_only:
        w[right] = 0.0
    else:
        w[n[right], slot[right]] = 0.0
    return out, w


def make_prefix_blocks(ids, lens, anchors, prefixes, block_size: int, mask_token_id: int) -> dfo.Blocks:
    """DFlash blocks (dfo.make_blocks) whose slots 1..p also hold the true tokens.

    Labels keep only slots past the prefix; `prefixes` is a list per sequence, parallel to anchors.
    """
    blocks = dfo.make_blocks(ids, lens, anchors, block_size, mask_token_id)
    flat = [p for ps in prefixes for p in ps]
    for n, (i, p) in enumerate(zip(blocks.seq_indices.tolist(), flat)):
        a = int(blocks.positions[n, 0])
        blocks.input_ids[n, 1 : p + 1] = ids[i, a + 1 : a + p + 1]
        blocks.labels[n, : p + 1] = IGNORE
    return blocks


def prefix_weights(prefixes: torch.Tensor, block_size: int, gamma: float) -> torch.Tensor:
    """[N, B]: exp(-(k-p-1)/gamma) for slots k > p, else 0."""
    k = torch.arange(block_size, dtype=torch.float32)[None]
    p = prefixes.float()[:, None]
    return torch.where(k > p, torch.exp(-(k - p - 1) / gamma), torch.zeros(()))


def weighted_ce_rows(logits, labels, weights) -> torch.Tensor:
    ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten().clamp(min=0),
                                           reduction="none").view(labels.shape)
    w = weights * (labels != IGNORE)
    ce = torch.where(w > 0, ce, torch.zeros(()))  # an excluded right token is inf where w is 0
    return (ce * w).sum() / w.sum().clamp(min=1e-8)


def continuation_accepts(proposals, labels, prefixes) -> torch.Tensor:
    """Leading correct proposals after each block's prefix: [N]."""
    b = labels.shape[1]
    k = torch.arange(b)[None]
    ok = (proposals == labels) & (labels != IGNORE)
    ok = ok | (k <= prefixes[:, None])  # the known slots do not count as failures
    run = ok.long().cumprod(1).sum(1)
    return run - (prefixes + 1)


def load_init(init: Path, target, mask_id: int):
    """The first drafter's weights, without a length head."""
    from sglang_adaflash.drafter.checkpoint import load_drafter
    from sglang_adaflash.drafter.model import DFlashDrafter

    if init.is_dir():
        first = load_drafter(init, dtype=torch.float32)
    else:
        state = torch.load(init, map_location="cpu", weights_only=False)
        first = dfo.build_drafter(target.config, dfo.DrafterTrainConfig.from_dict(state["config"]), mask_id)
        first.load_state_dict({k: v for k, v in state["model"].items() if not k.startswith("thresh_head")}, strict=False)
    cfg = first.config.replace(use_length_head=False)
    model = DFlashDrafter(cfg)
    model.load_state_dict({k: v.float() for k, v in first.state_dict().items() if not k.startswith("thresh_head")})
    return model


@torch.no_grad()
def evaluate(target, drafter, seqs, layer_ids, block_size, mask_id, pad_id, seed=0, batch=4, first=None,
             width: int = 4) -> dict:
    """Mean accepted continuation after a true prefix, at 4 random anchors per response.

    With `first` (the first drafter), also the recovery drafter's job itself: at each anchor
    where the first drafter's chain fails inside the block, at its first wrong slot r, how often
    the recovery drafter's best token other than the chain's (prefix p = r - 1) is the right one,
    and how often the right one is among its best `width`; beside them the same for the first
    drafter's own next-ranked tokens at r (a tree without the second drafter), and the recovery
    drafter's accepted continuation after r where its token was right."""
    rng = random.Random(seed)
    acc, rec1, recw, fst1, fstw, cont, slot, cont_slot = [], [], [], [], [], [], [], []
    for i in range(0, len(seqs), batch):
        chunk = [s for s in seqs[i : i + batch] if len(s["output_ids"]) >= 4]
        if not chunk:
            continue
        ids, lens, plens = dfo.collate(chunk, pad_id)
        anchors = [dfo.sample_anchors(p, n, 4, rng) for p, n in zip(plens, lens)]
        prefixes = [sample_prefixes(a, n, block_size, rng) for a, n in zip(anchors, lens)]
        blocks = make_prefix_blocks(ids, lens, anchors, prefixes, block_size, mask_id)
        feats = dfo.target_features(target, ids, layer_ids)
        hidden = dfo.drafter_forward(drafter, feats, blocks)
        flat = torch.tensor([p for ps in prefixes for p in ps])
        acc += continuation_accepts(drafter.logits(hidden).argmax(-1), blocks.labels, flat).tolist()
        if first is None:
            continue
        chain, fail, first_logits = _first_drafter_blocks(first, feats, ids, lens, anchors, block_size, mask_id)
        keep = fail < block_size
        if not keep.any():
            continue
        n = torch.arange(len(fail))[keep]
        r = fail[keep]
        at = [[] for _ in anchors]  # the failing anchors again, with p = r - 1
        flat_anchor = [(j, a) for j, a_list in enumerate(anchors) for a in a_list]
        for m in n.tolist():
            at[flat_anchor[m][0]].append(flat_anchor[m][1])
        fail_p = [[int(fail[m]) - 1 for m in n.tolist() if flat_anchor[m][0] == j] for j in range(len(anchors))]
        fb = make_prefix_blocks(ids, lens, at, fail_p, block_size, mask_id)
        rec_logits = drafter.logits(dfo.drafter_forward(drafter, feats, fb))
        k = torch.arange(len(r))
        label = fb.labels[k, r]
        chain_tok = chain[n, r]
        slot += r.tolist()
        for logits_r, hit1, hitw in ((rec_logits[k, r], rec1, recw), (first_logits[n, r], fst1, fstw)):
            ranked = logits_r.float().scatter(1, chain_tok[:, None], float("-inf")).topk(width, 1).indices
            hit1 += (ranked[:, 0] == label).tolist()
            hitw += (ranked == label[:, None]).any(1).tolist()
        ok = rec_logits.argmax(-1) == fb.labels
        run = torch.where(torch.arange(block_size)[None] > r[:, None], ok & (fb.labels != IGNORE), True)
        right = torch.tensor(rec1[-len(r):], dtype=torch.bool)
        cont += (run.long().cumprod(1).sum(1) - (r + 1))[right].tolist()
        cont_slot += r[right].tolist()
    out = {"continuation_accepted_mean": sum(acc) / max(len(acc), 1), "blocks": len(acc)}
    if first is not None:
        def mean(x):
            return round(sum(x) / max(len(x), 1), 4)

        out["at_first_failure"] = {"anchors": len(rec1), "width": width,
                                   "recovery_top1": mean(rec1), f"recovery_top{width}": mean(recw),
                                   "first_next_top1": mean(fst1), f"first_next_top{width}": mean(fstw),
                                   "recovery_continuation_when_right": mean(cont)}

        def at1(x, where):  # the slot-1 failures alone: all that --branch-drafter joint asks of it
            return mean([v for v, r in zip(x, where) if r == 1])

        out["at_slot1_failure"] = {"anchors": slot.count(1), "width": width,
                                   "recovery_top1": at1(rec1, slot), f"recovery_top{width}": at1(recw, slot),
                                   "first_next_top1": at1(fst1, slot), f"first_next_top{width}": at1(fstw, slot),
                                   "recovery_continuation_when_right": at1(cont, cont_slot)}
    return out


def train(target, tokenizer, drafter, seqs, cfg: RecoveryTrainConfig, work: Path, log=print, first=None) -> dict:
    """`first`: the first drafter (frozen), needed for cfg.fail_share > 0 or cfg.exclude_chain."""
    if (cfg.fail_share > 0 or cfg.exclude_chain) and first is None:
        raise ValueError("fail_share and exclude_chain need the first drafter")
    if cfg.branch_only and not cfg.exclude_chain:
        raise ValueError("branch_only is a weighting of exclude_chain's blocks: set exclude_chain too")
    work.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)
    mask_id = drafter.config.mask_token_id
    layer_ids = list(drafter.config.target_layer_ids)
    b = drafter.config.block_size
    for p in target.parameters():
        p.requires_grad_(False)
    params = [p for p in drafter.parameters() if p.requires_grad]  # (shared modules are the first's, frozen)
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95))
    ckpt, step = work / "recovery_ckpt.pt", 0
    if ckpt.exists():
        state = torch.load(ckpt, map_location="cpu", weights_only=False)
        drafter.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        step = state["step"]
    usable = [s for s in seqs if len(s["output_ids"]) >= 4]
    per_epoch = max(1, len(usable) // cfg.batch_size)
    drafter.train()
    while step < cfg.steps:
        lr = dfo._lr(step, cfg.lr, cfg.min_lr, cfg.warmup_steps, cfg.steps)
        for g in opt.param_groups:
            g["lr"] = lr
        if step > 0 and step % cfg.ckpt_every == 0:
            dfo._save(ckpt, {"model": drafter.state_dict(), "optimizer": opt.state_dict(), "step": step})
        t0 = time.time()
        epoch, i = divmod(step, per_epoch)
        order = list(range(len(usable)))
        random.Random(cfg.seed * 1000 + epoch).shuffle(order)
        batch = [usable[j] for j in order[i * cfg.batch_size : (i + 1) * cfg.batch_size]]
        rng = random.Random(cfg.seed * 7919 + step)
        ids, lens, plens = dfo.collate(batch, tokenizer.pad_token_id)
        anchors = [dfo.sample_anchors(p, n, cfg.anchors_per_seq, rng) for p, n in zip(plens, lens)]
        feats = dfo.target_features(target, ids, layer_ids)
        if first is not None:
            chain, fail = first_drafter_chain(first, feats, ids, lens, anchors, b, mask_id)
            prefixes = place_prefixes(anchors, lens, fail, b, rng, cfg.fail_share, cfg.max_prefix)
        else:
            prefixes = [sample_prefixes(a, n, b, rng, max_prefix=cfg.max_prefix) for a, n in zip(anchors, lens)]
        blocks = make_prefix_blocks(ids, lens, anchors, prefixes, b, mask_id)
        flat = torch.tensor([p for ps in prefixes for p in ps])
        hidden = dfo.drafter_forward(drafter, feats, blocks)
        logits = drafter.logits(hidden)
        weights = prefix_weights(flat, b, cfg.gamma)
        if cfg.exclude_chain:
            logits, weights = exclusion_at_prefix(logits, blocks.labels, weights, chain, flat, cfg.branch_only)
        loss = weighted_ce_rows(logits, blocks.labels, weights)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        if step % 10 == 0:
            with torch.no_grad():
                acc = continuation_accepts(logits.argmax(-1), blocks.labels, flat).float().mean().item()
            # (with exclude_chain, slot p+1's argmax is the best token other than the chain's)
            log(json.dumps({"step": step, "loss": round(loss.item(), 4), "cont_acc": round(acc, 3),
                            "lr": lr, "step_s": round(time.time() - t0, 2)}))
    dfo._save(ckpt, {"model": drafter.state_dict(), "optimizer": opt.state_dict(), "step": step})
    drafter.eval()
    return {"steps": step}


def export(drafter, target_dir: Path, out: Path, cfg: RecoveryTrainConfig, training: dict, evaluation: dict,
           version: str = "recovery-v1", initialised_from: str = "dflash drafter") -> Path:
    from sglang_adaflash.d2sd.recovery_drafter import RECOVERY_KEY, recovery_marker
    from sglang_adaflash.drafter.checkpoint import write_checkpoint
    from sglang_adaflash.drafter.manifest import build_manifest, target_fingerprint

    dc = drafter.config
    raw = dict(dc.raw)
    ada = dict(raw.get("adaflash_config") or {})
    shared = {"shared": cfg.share} if cfg.share else {}
    top = dc.block_size - 2 if cfg.max_prefix is None else min(cfg.max_prefix, dc.block_size - 2)
    ada[RECOVERY_KEY] = recovery_marker(prefix_range=[0, top], initialised_from=initialised_from, **shared)
    raw["adaflash_config"] = ada
    dc = dc.replace(raw=raw)
    dtype = getattr(torch, cfg.save_dtype)
    write_checkpoint(out, dc, {k: v.to(dtype) for k, v in drafter.state_dict().items()}, overwrite=True)
    manifest = build_manifest(out, version=version, parent=None, target=target_fingerprint(target_dir),
                              training=training, eval=evaluation)
    atomic_write_text(out / "manifest.json", json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return out


def _init_name(init: Path) -> str:
    """What training started from, for the manifest: a checkpoint's version, else the file's name
    (no machine paths)."""
    manifest = init / "manifest.json"
    if manifest.is_file():
        try:
            return str(json.loads(manifest.read_text())["version"])
        except (OSError, ValueError, KeyError, TypeError):  # unreadable, torn, or not an object
            pass
    return init.name


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m training_job.d2sd_recovery", description=__doc__.split("\n")[0])
    ap.add_argument("--target", required=True, type=Path)
    ap.add_argument("--init", required=True, type=Path, help="first drafter: checkpoint dir or drafter_ckpt.pt")
    ap.add_argument("--first", type=Path, default=None,
                    help="the first drafter the recovery drafter serves with (default: --init), for "
                         "--fail-share, --exclude-chain and the at-first-failure evaluation")
    ap.add_argument("--fail-share", type=float, default=RecoveryTrainConfig.fail_share,
                    help="share of anchors whose prefix ends where the first drafter first fails")
    ap.add_argument("--exclude-chain", action="store_true",
                    help="train slot p+1 without the first drafter's token (the way the engine reads it)")
    ap.add_argument("--share", choices=SHARING, default=None,
                    help="use the first drafter's (--first) modules of this kind, frozen, and mark the "
                         "checkpoint so that the engine ties them: 'context' (the context and block K/V "
                         "path: one context cache for both drafters), 'attention' (also layer 0's queries "
                         "and output projection)")
    ap.add_argument("--max-prefix", type=int, default=None,
                    help="train prefixes 0..P only (0: the slot-1 branch, all --branch-drafter joint "
                         "asks of the recovery drafter); recorded as the checkpoint's prefix_range")
    ap.add_argument("--branch-only", action="store_true",
                    help="with --exclude-chain: a block weighs nothing where the chain's token after its "
                         "prefix is right (the branch is read only where it is rejected)")
    ap.add_argument("--gamma", type=float, default=RecoveryTrainConfig.gamma,
                    help="slot k > p weighs exp(-(k-p-1)/gamma)")
    ap.add_argument("--lr", type=float, default=RecoveryTrainConfig.lr)
    ap.add_argument("--seed", type=int, default=RecoveryTrainConfig.seed)
    ap.add_argument("--data", required=True, type=Path, help="regenerated responses (JSONL)")
    ap.add_argument("--eval-data", type=Path, default=None)
    ap.add_argument("--work", required=True, type=Path)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--steps", type=int, default=RecoveryTrainConfig.steps)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--domains", default="code,prose")
    ap.add_argument("--version", default="recovery-v1", help="the version its manifest names")
    args = ap.parse_args(argv)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not 0.0 <= args.fail_share <= 1.0:
        ap.error(f"--fail-share must be in [0, 1], got {args.fail_share}")
    if args.max_prefix is not None and args.max_prefix < 0:
        ap.error(f"--max-prefix must be >= 0, got {args.max_prefix}")
    if args.branch_only and not args.exclude_chain:
        ap.error("--branch-only needs --exclude-chain")
    if not args.gamma > 0 or args.gamma == float("inf"):  # (NaN fails the first test)
        ap.error(f"--gamma must be a finite number > 0, got {args.gamma}")
    cfg = RecoveryTrainConfig(steps=args.steps, threads=args.threads, fail_share=args.fail_share,
                              exclude_chain=args.exclude_chain, lr=args.lr, min_lr=args.lr / 10, seed=args.seed,
                              share=args.share, max_prefix=args.max_prefix, branch_only=args.branch_only,
                              gamma=args.gamma)
    torch.set_num_threads(cfg.threads)
    target = AutoModelForCausalLM.from_pretrained(str(args.target), dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(args.target))
    mask_id = tokenizer.convert_tokens_to_ids(cf.MASK)
    drafter = load_init(args.init, target, mask_id)
    if args.max_prefix is not None and args.max_prefix > drafter.config.block_size - 2:
        ap.error(f"--max-prefix must be at most block_size - 2 = {drafter.config.block_size - 2}, got {args.max_prefix}")
    from sglang_adaflash.d2sd.recovery_drafter import RECOVERY_KEY

    # a recovery drafter trained on (--init one) says so in the marker it exports
    started = ("recovery drafter " + _init_name(args.init)
               if RECOVERY_KEY in (drafter.config.raw.get("adaflash_config") or {}) else "dflash drafter")
    drafter.share_target_modules(target.get_input_embeddings(), target.get_output_embeddings())
    first = load_init(args.first or args.init, target, mask_id).eval()
    first.share_target_modules(target.get_input_embeddings(), target.get_output_embeddings())
    for prm in first.parameters():
        prm.requires_grad_(False)
    if cfg.share:  # the same module objects: frozen with the first, and exported with its weights
        tie_modules(drafter, first, cfg.share)
    domains = set(args.domains.split(","))
    seqs = [s for s in read_jsonl(args.data) if s.get("domain") in domains]
    ev = [s for s in read_jsonl(args.eval_data) if s.get("domain") in domains] if args.eval_data else seqs[:64]
    layer_ids, b = list(drafter.config.target_layer_ids), drafter.config.block_size
    before = evaluate(target, drafter, ev, layer_ids, b, mask_id, tokenizer.pad_token_id, first=first)
    print(json.dumps({"eval_before": before}), flush=True)
    needs_first = cfg.fail_share > 0 or cfg.exclude_chain
    stats = train(target, tokenizer, drafter, seqs, cfg, args.work, log=lambda s: print(s, flush=True),
                  first=first if needs_first else None)
    after = evaluate(target, drafter, ev, layer_ids, b, mask_id, tokenizer.pad_token_id, first=first)
    print(json.dumps({"eval_after": after}), flush=True)
    training = {"algorithm": "d2sd-recovery-offline", "records": len(seqs), **stats, "config": asdict(cfg),
                "domains": sorted(domains), "init": _init_name(args.init)}
    evaluation = {"init": before, "trained": after,
                  "method": "accepted continuation after a true prefix p in [0, B-2], 4 anchors per held-out response"}
    export(drafter, args.target, args.out, cfg, training, evaluation, version=args.version, initialised_from=started)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
