"""Versioned drafters on the shared volume (`$ADAFLASH_HOME/drafters/`).

Layout (docs/contracts.md, "Shared volume"): `drafters/<version>/` is immutable once published
(v000001, v000002, ...); `drafters/latest` names the newest version and is written last, by
rename, so a reader that follows `latest` always finds a complete, hashed directory.
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path
from typing import Any

import torch

from ..fsio import fsync_dir, write_json_atomic, write_text_atomic
from .checkpoint import CheckpointError, write_checkpoint
from .config import DrafterConfig
from .manifest import MANIFEST_NAME, build_manifest

VERSION_RE = re.compile(r"^v(\d{6,})$")
LATEST_NAME = "latest"


def drafters_dir(home: str | os.PathLike) -> Path:
    return Path(home) / "drafters"


def format_version(n: int) -> str:
    return f"v{n:06d}"


def list_versions(home: str | os.PathLike) -> list[str]:
    """Published versions, oldest first (hidden temp directories are ignored)."""
    d = drafters_dir(home)
    if not d.is_dir():
        return []
    found = [p.name for p in d.iterdir() if p.is_dir() and VERSION_RE.match(p.name)]
    return sorted(found, key=lambda v: int(VERSION_RE.match(v).group(1)))


def latest_version(home: str | os.PathLike) -> str | None:
    path = drafters_dir(home) / LATEST_NAME
    try:
        name = path.read_text().strip()
    except FileNotFoundError:
        return None
    if not VERSION_RE.match(name):
        raise CheckpointError(f"{path} names {name!r}, which is not a version like v000001")
    return name


def version_path(home: str | os.PathLike, version: str) -> Path:
    if not VERSION_RE.match(version):
        raise CheckpointError(f"{version!r} is not a drafter version (expected v000001, v000002, ...)")
    return drafters_dir(home) / version


def _write_latest(home: str | os.PathLike, version: str) -> None:
    write_text_atomic(drafters_dir(home) / LATEST_NAME, version + "\n")
    fsync_dir(drafters_dir(home))


def publish_version(
    home: str | os.PathLike,
    cfg: DrafterConfig,
    state: dict[str, torch.Tensor],
    *,
    target: dict[str, str],
    parent: str | None = None,
    training: dict[str, Any] | None = None,
    eval: dict[str, Any] | None = None,
) -> str:
    """Publish the next version: weights, config and manifest in one atomic directory rename."""
    drafters_dir(home).mkdir(parents=True, exist_ok=True)
    existing = list_versions(home)
    number = int(VERSION_RE.match(existing[-1]).group(1)) + 1 if existing else 1
    version = format_version(number)
    staging = Path(tempfile.mkdtemp(dir=drafters_dir(home), prefix=f".{version}.", suffix=".stage"))
    try:
        write_checkpoint(staging / "ckpt", cfg, state)
        manifest = build_manifest(
            staging / "ckpt", version=version, parent=parent, target=target, training=training, eval=eval
        )
        write_json_atomic(staging / "ckpt" / MANIFEST_NAME, manifest, sort_keys=True)
        os.replace(staging / "ckpt", version_path(home, version))
    finally:
        import shutil

        shutil.rmtree(staging, ignore_errors=True)
    fsync_dir(drafters_dir(home))
    _write_latest(home, version)
    return version
