"""Is this drafter built for this target? Checked once, before serving, with actionable errors."""

from __future__ import annotations

from pathlib import Path

import torch

from ..drafter.config import DrafterConfig
from ..drafter.manifest import MANIFEST_NAME, ManifestError, check_target, read_manifest


class CompatibilityError(ValueError):
    """The drafter cannot serve with this target; the message says which one it needs."""


def check_compatibility(
    cfg: DrafterConfig,
    target,
    *,
    drafter_dtype: torch.dtype | None = None,
    drafter_path: str | Path | None = None,
    allow_dtype_cast: bool = False,
) -> None:
    """Hidden size, vocabulary, mask token, layer ids, dtype and (if published) target identity."""
    where = f"drafter {drafter_path}" if drafter_path else "drafter"
    another = "this drafter was trained for another target; pass the drafter built for this target"
    if cfg.hidden_size != target.hidden_size:
        raise CompatibilityError(
            f"{where}: hidden size {cfg.hidden_size} does not match the target's {target.hidden_size}: {another}"
        )
    if cfg.vocab_size != target.vocab_size:
        raise CompatibilityError(
            f"{where}: vocabulary size {cfg.vocab_size} does not match the target's {target.vocab_size}: {another}"
        )
    if not 0 <= cfg.mask_token_id < target.vocab_size:
        raise CompatibilityError(
            f"{where}: mask_token_id {cfg.mask_token_id} is not a token of the target's vocabulary "
            f"[0, {target.vocab_size}); set dflash_config.mask_token_id to the reserved mask token"
        )
    if cfg.num_target_layers != target.num_layers:
        raise CompatibilityError(
            f"{where}: built for a target with {cfg.num_target_layers} layers, this target has "
            f"{target.num_layers}: {another}"
        )
    bad = [i for i in cfg.target_layer_ids if not 0 <= i < target.num_layers]
    if bad:
        raise CompatibilityError(
            f"{where}: target_layer_ids {bad} do not exist in a {target.num_layers}-layer target"
        )
    if drafter_dtype is not None and drafter_dtype != target.dtype and not allow_dtype_cast:
        raise CompatibilityError(
            f"{where}: weights are {drafter_dtype} but the target runs in {target.dtype}; "
            "pass --dtype to run both in one dtype"
        )
    if drafter_path and (Path(drafter_path) / MANIFEST_NAME).exists() and getattr(target, "path", None):
        try:
            check_target(read_manifest(drafter_path), target.path)
        except ManifestError as e:
            raise CompatibilityError(str(e)) from None
