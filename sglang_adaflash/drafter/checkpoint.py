"""Reading and writing drafter checkpoints in the published DFlash / AdaFlash format.

A checkpoint is a directory with `config.json` and `model.safetensors` (plus `manifest.json` when
we published it). Readers trust nothing: every failure names what was expected, what was found,
and what to do, and nothing half-loaded ever reaches a model.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from ..fsio import fsync_dir
from .config import ConfigError, DrafterConfig
from .manifest import MANIFEST_NAME, ManifestError, read_manifest, verify_manifest_files

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"

_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float64: "float64"}


class CheckpointError(ValueError):
    """A drafter checkpoint that must not be loaded; the message says how to fix it."""


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def dtype_name(dtype: torch.dtype) -> str:
    return _DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))


def expected_shapes(cfg: DrafterConfig) -> dict[str, tuple[int, ...]]:
    """Parameter name -> shape of the drafter this config describes (built on the meta device)."""
    from .model import DFlashDrafter

    with torch.device("meta"):
        model = DFlashDrafter(cfg)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def read_config(path: str | os.PathLike, *, resolved: dict | None = None) -> DrafterConfig:
    """The checkpoint's config; ``resolved`` as in :meth:`DrafterConfig.from_dict`."""
    cfg_path = Path(path) / CONFIG_NAME
    if not cfg_path.is_file():
        raise CheckpointError(f"{path} is not a drafter checkpoint: {CONFIG_NAME} is missing")
    try:
        raw = json.loads(cfg_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{cfg_path} is not valid JSON ({e}); the file is corrupt or truncated") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{cfg_path} must hold a JSON object, found {type(raw).__name__}")
    try:
        return DrafterConfig.from_dict(raw, resolved=resolved)
    except ConfigError as e:
        raise CheckpointError(f"{cfg_path}: {e}") from None


def _load_tensors(path: Path) -> dict[str, torch.Tensor]:
    weights = path / WEIGHTS_NAME
    if not weights.is_file():
        raise CheckpointError(f"{path} has no {WEIGHTS_NAME}: copy the weights next to config.json")
    try:
        return load_file(str(weights))
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise CheckpointError(
            f"{weights} cannot be read as safetensors ({e}); the file is truncated or corrupt: "
            "copy it again or republish the version"
        ) from None


def check_state_dict(cfg: DrafterConfig, state: dict[str, torch.Tensor], where: str = "checkpoint") -> None:
    """Full coverage, no strangers, right shapes, one float dtype, finite values."""
    want = expected_shapes(cfg)
    missing = sorted(set(want) - set(state))
    extra = sorted(set(state) - set(want))
    if missing:
        raise CheckpointError(f"{where} lacks {len(missing)} weights, e.g. {missing[:3]}: it does not match its config.json")
    if extra:
        hint = ""
        if any(k.startswith("thresh_head_two_model.") for k in extra):
            hint = " (set dflash_config.use_thresh_head_two_model: true to load the length head)"
        raise CheckpointError(f"{where} has {len(extra)} unexpected weights, e.g. {extra[:3]}{hint}")
    for name, shape in want.items():
        if tuple(state[name].shape) != shape:
            raise CheckpointError(
                f"{where}: weight {name} has shape {tuple(state[name].shape)}, config.json implies {shape}"
            )
    dtypes = {t.dtype for t in state.values()}
    if any(not d.is_floating_point for d in dtypes):
        raise CheckpointError(f"{where} holds non-float weights {sorted(map(str, dtypes))}: quantised drafters are not supported")
    if len(dtypes) > 1:
        raise CheckpointError(f"{where} mixes dtypes {sorted(map(str, dtypes))}: save every weight in one dtype")
    for name, t in state.items():
        if not torch.isfinite(t).all():
            raise CheckpointError(f"{where}: weight {name} contains NaN or Inf; this version is broken, do not serve it")


def read_checkpoint(
    path: str | os.PathLike, *, verify_manifest: bool = True, resolved: dict | None = None
) -> tuple[DrafterConfig, dict[str, torch.Tensor]]:
    """Load and fully validate a checkpoint; returns (config, CPU state dict)."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"drafter checkpoint {path} does not exist or is not a directory")
    if verify_manifest and (path / MANIFEST_NAME).exists():
        try:
            verify_manifest_files(path)
        except ManifestError as e:
            raise CheckpointError(str(e)) from None
    cfg = read_config(path, resolved=resolved)
    state = _load_tensors(path)
    check_state_dict(cfg, state, where=str(path))
    declared = cfg.torch_dtype
    actual = dtype_name(next(iter(state.values())).dtype)
    if declared and declared != actual:
        raise CheckpointError(
            f"{path}: config.json declares torch_dtype {declared} but the weights are {actual}; "
            "fix the config or re-save the weights"
        )
    return cfg, state


def write_checkpoint(
    path: str | os.PathLike,
    cfg: DrafterConfig,
    state: dict[str, torch.Tensor],
    *,
    extra_files: dict[str, Any] | None = None,
    overwrite: bool = False,
) -> Path:
    """Write config.json + model.safetensors (+ JSON extra files) into a new directory, atomically.

    Files go to a hidden sibling directory that is fsynced and renamed into place, so a reader
    never sees a half-written checkpoint. Existing checkpoints are immutable unless overwrite.
    """
    path = Path(path)
    check_state_dict(cfg, state, where="state dict to save")
    if path.exists() and not overwrite:
        raise CheckpointError(f"{path} already exists; published checkpoints are immutable")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp"))
    try:
        cfg = cfg.replace(torch_dtype=dtype_name(next(iter(state.values())).dtype))
        tensors = {k: v.detach().to("cpu").contiguous() for k, v in state.items()}
        save_file(tensors, str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
        (tmp / CONFIG_NAME).write_text(json.dumps(cfg.to_dict(), indent=2, sort_keys=True) + "\n")
        for name, obj in (extra_files or {}).items():
            (tmp / name).write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")
        for f in tmp.iterdir():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        fsync_dir(tmp)
        if path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def load_drafter(path: str | os.PathLike, *, dtype: torch.dtype | None = None, device="cpu", verify_manifest=True):
    """Build a DFlashDrafter from a checkpoint directory (validated first)."""
    from .model import DFlashDrafter

    cfg, state = read_checkpoint(path, verify_manifest=verify_manifest)
    dtype = dtype or next(iter(state.values())).dtype
    with torch.device("meta"):
        model = DFlashDrafter(cfg)
    model.load_state_dict(state, assign=True)
    model = model.to(device=device, dtype=dtype).eval()
    if (Path(path) / MANIFEST_NAME).exists():
        try:
            model.manifest = read_manifest(path)
        except ManifestError:  # verify_manifest=False: an unreadable manifest is no eval, not an error
            model.manifest = None
    return model


def save_drafter(path: str | os.PathLike, model, **kwargs) -> Path:
    return write_checkpoint(path, model.config, model.state_dict(), **kwargs)
