"""Staging: read and verify a published version off the critical path.

Everything that can fail slowly or partly (disk reads, hashes, shape checks, dtype casts,
pinning) happens here, on the watcher thread, so the decode loop only ever sees a version that
is complete, verified and already in host memory in the live dtypes.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from sglang_adaflash.drafter.checkpoint import CheckpointError, read_checkpoint
from sglang_adaflash.drafter.manifest import (
    MANIFEST_NAME,
    ManifestError,
    check_target,
    read_manifest,
)

from .contract import ENV_REQUIRE_MANIFEST, ReloadError

#: Config fields a hot reload must not change: they shape buffers, CUDA graphs and the target
#: features the drafter reads. Changing them needs a restart.
FROZEN_CONFIG_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "block_size",
    "mask_token_id",
    "target_layer_ids",
    "use_length_head",
    "length_head_bottleneck_dim",
)


@dataclass
class StagedDrafter:
    """A verified drafter version held in CPU memory, ready to be copied in."""

    version: str
    path: Path
    config: Any  # DrafterConfig
    state: dict[str, torch.Tensor]  # checkpoint name -> CPU tensor in the live dtype
    manifest: dict[str, Any] | None
    signature: tuple  # the version directory's files (name, size, mtime) when it was read
    staged_at: float = field(default_factory=time.time)


def dir_signature(path: Path) -> tuple:
    """Names, sizes and mtimes of a directory's files: changes when a torn copy is completed."""
    try:
        entries = sorted(p for p in path.iterdir() if p.is_file())
    except FileNotFoundError:
        return ()
    return tuple((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in entries)


TensorSpec = tuple[tuple[int, ...], torch.dtype]


def check_against_live(
    state: Mapping[str, torch.Tensor], expected: Mapping[str, TensorSpec], where: str
) -> None:
    """Full coverage both ways and equal shapes between a checkpoint and the live weights."""
    missing = sorted(set(expected) - set(state))
    extra = sorted(set(state) - set(expected))
    if missing:
        raise ReloadError(
            f"{where} lacks {len(missing)} weights the serving drafter has, e.g. {missing[:3]}; "
            "a hot reload must replace every weight: publish a complete checkpoint"
        )
    if extra:
        raise ReloadError(
            f"{where} has {len(extra)} weights the serving drafter does not, e.g. {extra[:3]}; "
            "it was built with another architecture: restart the server to switch drafters"
        )
    for name, (shape, _dtype) in expected.items():
        found = tuple(state[name].shape)
        if found != tuple(shape):
            raise ReloadError(
                f"{where}: {name} has shape {found}, the serving drafter has {tuple(shape)}; "
                "restart the server to switch to a differently sized drafter"
            )
    for name, tensor in state.items():
        if not tensor.dtype.is_floating_point:
            raise ReloadError(f"{where}: {name} is {tensor.dtype}, expected a floating dtype")


def check_config_frozen(live_config: Any, new_config: Any, where: str) -> None:
    if live_config is None:
        return
    changed = [
        f"{name}: {getattr(live_config, name)!r} -> {getattr(new_config, name)!r}"
        for name in FROZEN_CONFIG_FIELDS
        if getattr(live_config, name, None) != getattr(new_config, name, None)
    ]
    if changed:
        raise ReloadError(
            f"{where} changes settings a hot reload cannot change ({'; '.join(changed)}); "
            "restart the server with the new drafter instead"
        )


def stage_drafter(
    path: str | os.PathLike,
    *,
    version: str,
    expected: Mapping[str, TensorSpec],
    live_config: Any = None,
    require_manifest: bool = True,
    pin_memory: bool | None = None,
    target_dir: str | os.PathLike | None = None,
    config_resolved: dict | None = None,
) -> StagedDrafter:
    """Read and verify a published version; returns it in CPU memory in the live dtypes.

    Raises :class:`ReloadError` (never a half-checked state) when the directory is missing,
    torn, unhashed, tampered with, or does not fit the serving drafter exactly.
    """
    path = Path(path)
    signature = dir_signature(path)
    if not path.is_dir():
        raise ReloadError(f"drafter version {version} not found at {path}; is it published?")
    has_manifest = (path / MANIFEST_NAME).exists()
    if require_manifest and not has_manifest:
        raise ReloadError(
            f"{path} has no manifest.json: only published versions can be hot-reloaded "
            f"(set {ENV_REQUIRE_MANIFEST}=0 to allow unsigned directories)"
        )
    try:
        config, state = read_checkpoint(path, verify_manifest=True, resolved=config_resolved)
        manifest = read_manifest(path) if has_manifest else None
    except (CheckpointError, ValueError) as e:
        raise ReloadError(f"drafter version {version} rejected: {e}") from None
    if manifest is not None and manifest.get("version") not in (None, version):
        raise ReloadError(
            f"{path}/manifest.json says version {manifest.get('version')!r}, but the directory "
            f"is {version!r}: the volume is inconsistent; republish the version"
        )
    if manifest is not None and target_dir is not None:
        try:
            check_target(manifest, target_dir)  # a drafter fits only the target it learned from
        except ManifestError as e:
            raise ReloadError(f"drafter version {version} rejected: {e}") from None
    check_config_frozen(live_config, config, str(path))
    check_against_live(state, expected, str(path))
    if dir_signature(path) != signature:
        raise ReloadError(f"{path} changed while it was being read; will retry when it settles")
    if pin_memory is None:
        pin_memory = torch.cuda.is_available()
    converted = {}
    for name, tensor in state.items():
        t = tensor.to(expected[name][1]).contiguous()
        converted[name] = t.pin_memory() if pin_memory else t
    return StagedDrafter(version, path, config, converted, manifest, signature)
