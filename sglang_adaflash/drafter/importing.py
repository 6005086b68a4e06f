"""Import a published DFlash checkpoint as the first version of a volume (`adaflash drafters
import`, and the operator's bootstrap Job).

A published DFlash drafter (config.json + model.safetensors, as released for Qwen3-8B and
others) has no AdaFlash length head. Hot reload never adds or removes buffers, so a head has to
be there from the first version on, or no later version can have one. The import therefore
gives it a *neutral* head: its output layer has zero weights and a bias of logit(0.95), so it
predicts 95% of the block whatever it reads, and the engine's adaptive verification verifies
(almost) the whole block, which is plain DFlash. The first distillation round trains the head
on that round's traffic, in the same steps as the drafter and on its detached states (the
job's default ``--head joint``), then recalibrates it on the round's held-out records; from
that version on the head predicts. A checkpoint that has a head (an AdaFlash one) keeps it.

The version must be the volume's first: import refuses a volume that has versions already (use
``adaflash drafters publish`` to add a hand-made version to a volume with a history).
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import torch

from .checkpoint import CheckpointError, read_checkpoint
from .manifest import ManifestError, target_fingerprint

#: What a neutral head predicts (E[tau] / B) before the first distillation round trains it.
NEUTRAL_RATIO = 0.95
#: The length head's default width (AdaFlash's bottleneck).
HEAD_BOTTLENECK = 256


def check_fits_target(cfg, target: str | os.PathLike) -> None:
    """A drafter must share the target's width and vocabulary (it borrows its embedding and LM
    head) and read only layers the target has; raises CheckpointError saying which differ."""
    import json

    path = Path(target) / "config.json"
    try:
        tc = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"target {target}: cannot read {path} ({e})") from None
    tc = tc.get("text_config", tc)
    wrong = [f"{k} {getattr(cfg, a)} != target's {tc.get(k)}"
             for k, a in (("hidden_size", "hidden_size"), ("vocab_size", "vocab_size"),
                          ("num_hidden_layers", "num_target_layers"))
             if tc.get(k) is not None and tc.get(k) != getattr(cfg, a)]
    if wrong:
        raise CheckpointError("the drafter does not fit target " + str(target) + ": " +
                              "; ".join(wrong) + ": it was trained for another target; pass "
                              "the drafter built for this one")


def neutral_head(cfg, dtype: torch.dtype, seed: int = 0,
                 ratio: float = NEUTRAL_RATIO) -> tuple[Any, dict[str, torch.Tensor]]:
    """(config with a head, the head's weights under ``thresh_head_two_model.``): hidden layers
    initialised as usual (seeded), the output layer predicting ``ratio`` for every block."""
    from .length_head import AdaptiveLengthHead

    if not 0.0 < ratio < 1.0:
        raise ValueError(f"the neutral head's ratio must lie in (0, 1), got {ratio}")
    bottleneck = cfg.length_head_bottleneck_dim or HEAD_BOTTLENECK
    torch.manual_seed(seed)
    head = AdaptiveLengthHead(cfg.hidden_size, bottleneck)
    with torch.no_grad():
        head.out.weight.zero_()
        head.out.bias.fill_(math.log(ratio / (1.0 - ratio)))
    state = {f"thresh_head_two_model.{k}": v.to(dtype) for k, v in head.state_dict().items()}
    raw = dict(cfg.raw)
    dflash = dict(raw.get("dflash_config") or {})
    dflash.update(use_thresh_head_two_model=True, thresh_head_bottleneck_dim=bottleneck,
                  thresh_head_direct_len=True)
    raw["dflash_config"] = dflash
    return cfg.replace(use_length_head=True, length_head_bottleneck_dim=bottleneck,
                       length_head_direct_len=True, raw=raw), state


def import_checkpoint(home: str | os.PathLike, src: str | os.PathLike,
                      target: str | os.PathLike, *, target_name: str | None = None,
                      ratio: float = NEUTRAL_RATIO) -> str:
    """Publish the DFlash checkpoint ``src`` as the first version under ``home`` for the target
    directory ``target``; returns the version (v000001 on a new volume)."""
    from .store import list_versions, publish_version

    existing = list_versions(home)
    if existing:
        raise CheckpointError(f"{Path(home) / 'drafters'} already holds {existing[-1]}: import "
                              "publishes a volume's first version; add this one with "
                              "`adaflash drafters publish` instead")
    cfg, state = read_checkpoint(src, verify_manifest=False)
    try:
        fingerprint = target_fingerprint(target)
    except ManifestError as e:
        raise CheckpointError(f"target {target}: {e}") from None
    if target_name:
        fingerprint["name"] = target_name
    check_fits_target(cfg, target)
    dtype = next(iter(state.values())).dtype
    if cfg.use_length_head:
        head = {"mode": "kept", "note": "the checkpoint's own length head"}
    else:
        cfg, head_state = neutral_head(cfg, dtype, ratio=ratio)
        state = {**state, **head_state}
        head = {"mode": "neutral", "ratio": ratio,
                "note": "predicts the same share of every block until the first distillation "
                        "round trains it (--head joint) and recalibrates it on that round's "
                        "held-out traffic"}
    training = {"algorithm": "import", "source": Path(src).resolve().name,
                "length_head": head}
    return publish_version(home, cfg, state, target=fingerprint, parent=None,
                           training=training)
