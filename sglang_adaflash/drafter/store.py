"""Versioned drafters on the shared volume (`$ADAFLASH_HOME/drafters/`).

Layout (docs/contracts.md, "Shared volume"): `drafters/<version>/` is immutable once published
(v000001, v000002, ...); `drafters/latest` names the newest version and is written last, by
rename, so a reader that follows `latest` always finds a complete, hashed directory.

Several publishers may share one volume (a distillation job, `adaflash drafters publish` run by
hand, a retried job whose predecessor is still finishing). Publishing therefore:

- takes an exclusive `flock` on `drafters/.publish.lock` around choosing the number, renaming
  the directory into place and moving `latest`, so two publishers never pick the same number
  and `latest` is never moved backwards by the slower of two;
- still renames without replacing: a publisher that does not honour the lock (another host on a
  volume whose locks are not shared) makes this one take the next number instead of failing
  or overwriting;
- never reuses a number: the next one is above every directory, `latest` and a hidden
  high-water mark, so deleting a retired version does not let a different drafter appear later
  under its old name (hot-reloaders remember versions they refused by name).

The heavy part (writing and hashing the weights) happens in a hidden staging directory before the
lock is taken, so the lock is held for a rename and two small files.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from ..fsio import fsync_dir, write_json_atomic, write_text_atomic
from ..validation import InvalidVersion, is_version
from ..validation import version_number as _version_number
from .checkpoint import CheckpointError, read_checkpoint, write_checkpoint
from .config import DrafterConfig
from .manifest import MANIFEST_NAME, ManifestError, build_manifest, verify_manifest_files

LATEST_NAME = "latest"
LOCK_NAME = ".publish.lock"
#: Highest number ever published, so a deleted version's number is not handed out again.
HIGH_WATER_NAME = ".high-water"
#: Staging directories older than this are left by a crashed publisher and are removed.
STALE_STAGING_S = 24 * 3600.0
_STAGE_SUFFIX = ".stage"
_RENAME_ATTEMPTS = 64


def drafters_dir(home: str | os.PathLike) -> Path:
    return Path(home) / "drafters"


def format_version(n: int) -> str:
    return f"v{n:06d}"


def version_number(version: str) -> int:
    """``v000042`` -> 42 (ASCII digits only: sglang_adaflash.validation); else CheckpointError."""
    try:
        return _version_number(version)
    except InvalidVersion as e:
        raise CheckpointError(str(e)) from None


def list_versions(home: str | os.PathLike) -> list[str]:
    """Published versions, oldest first (hidden temp directories are ignored)."""
    d = drafters_dir(home)
    if not d.is_dir():
        return []
    found = [p.name for p in d.iterdir() if is_version(p.name) and p.is_dir()]
    return sorted(found, key=version_number)


def latest_version(home: str | os.PathLike) -> str | None:
    path = drafters_dir(home) / LATEST_NAME
    try:
        name = path.read_text().strip()
    except FileNotFoundError:
        return None
    if not is_version(name):
        raise CheckpointError(f"{path} names {name!r}, which is not a version like v000001")
    return name


def version_path(home: str | os.PathLike, version: str) -> Path:
    version_number(version)  # a name that is not a version could escape drafters/
    return drafters_dir(home) / version


@contextlib.contextmanager
def publish_lock(home: str | os.PathLike, *, blocking: bool = True) -> Iterator[None]:
    """Exclusive lock of the publishers of `home` (flock on `drafters/.publish.lock`).

    With ``blocking=False`` a held lock raises BlockingIOError at once.
    """
    import fcntl

    d = drafters_dir(home)
    d.mkdir(parents=True, exist_ok=True)
    fd = os.open(d / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        yield
    finally:
        os.close(fd)  # releases the lock


def _read_high_water(home: str | os.PathLike) -> int:
    try:
        return int((drafters_dir(home) / HIGH_WATER_NAME).read_text().strip() or 0)
    except (FileNotFoundError, ValueError, UnicodeDecodeError):
        return 0


def _next_number(home: str | os.PathLike) -> int:
    """One above everything this volume has ever called a version (call under the lock)."""
    numbers = [version_number(v) for v in list_versions(home)]
    try:
        latest = latest_version(home)
    except (CheckpointError, UnicodeDecodeError, OSError):
        latest = None
    if latest:
        numbers.append(version_number(latest))
    numbers.append(_read_high_water(home))
    return max(numbers, default=0) + 1


def _advance_latest(home: str | os.PathLike, version: str) -> bool:
    """Point `latest` at `version` unless it already names a newer one (call under the lock).

    Returns whether `latest` was written.
    """
    try:
        current = latest_version(home)
    except (CheckpointError, UnicodeDecodeError, OSError):
        current = None  # unreadable: replace it
    if current is not None and version_number(current) >= version_number(version):
        return False
    write_text_atomic(drafters_dir(home) / LATEST_NAME, version + "\n")
    fsync_dir(drafters_dir(home))
    return True


def _rename_noreplace(src: Path, dst: Path) -> bool:
    """Rename directory `src` to `dst` only if `dst` does not exist; False if it does.

    POSIX rename replaces an empty directory silently and fails on a non-empty one, so the
    existence check covers the first case and the error the second (a racing publisher).
    """
    if os.path.lexists(dst):
        return False
    try:
        os.rename(src, dst)
    except OSError as e:
        if e.errno in (errno.ENOTEMPTY, errno.EEXIST):
            return False
        raise
    return True


def sweep_stale_staging(home: str | os.PathLike, max_age_s: float = STALE_STAGING_S) -> list[Path]:
    """Remove staging directories a crashed publisher left (older than `max_age_s`)."""
    d = drafters_dir(home)
    removed = []
    if not d.is_dir():
        return removed
    now = time.time()
    for p in d.iterdir():
        if not (p.name.startswith(".") and p.name.endswith(_STAGE_SUFFIX)):
            continue
        try:
            if now - p.stat().st_mtime > max_age_s:
                shutil.rmtree(p, ignore_errors=True)
                removed.append(p)
        except FileNotFoundError:
            continue
    return removed


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
    """Publish the next version: weights, config and manifest in one atomic directory rename.

    Safe with concurrent publishers (see the module docstring). Returns the version's name.
    """
    d = drafters_dir(home)
    d.mkdir(parents=True, exist_ok=True)
    sweep_stale_staging(home)
    prefix = f".{socket.gethostname()[:32]}.{os.getpid()}."
    staging = Path(tempfile.mkdtemp(dir=d, prefix=prefix, suffix=_STAGE_SUFFIX))
    try:
        ckpt = staging / "ckpt"
        write_checkpoint(ckpt, cfg, state)
        # Hashes are computed once, outside the lock; only the version name is filled in later.
        manifest = build_manifest(ckpt, version="", parent=parent, target=target,
                                  training=training, eval=eval)
        with publish_lock(home):
            number = _next_number(home)
            for _ in range(_RENAME_ATTEMPTS):
                version = format_version(number)
                manifest["version"] = version
                write_json_atomic(ckpt / MANIFEST_NAME, manifest, sort_keys=True)
                fsync_dir(ckpt)
                if _rename_noreplace(ckpt, d / version):
                    break
                number += 1  # taken by a publisher that ignored the lock
            else:
                raise CheckpointError(
                    f"could not find a free version number under {d} after {_RENAME_ATTEMPTS} "
                    "tries: another publisher keeps taking them; retry later"
                )
            fsync_dir(d)
            write_text_atomic(d / HIGH_WATER_NAME, f"{max(number, _read_high_water(home))}\n")
            _advance_latest(home, version)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return version


def publish_checkpoint(
    home: str | os.PathLike,
    src: str | os.PathLike,
    *,
    target: dict[str, str],
    parent: str | None = None,
    training: dict[str, Any] | None = None,
    eval: dict[str, Any] | None = None,
) -> str:
    """Publish a checkpoint directory as the next version (it is fully validated first)."""
    cfg, state = read_checkpoint(src)
    return publish_version(home, cfg, state, target=target, parent=parent, training=training,
                           eval=eval)


def verify_version(home: str | os.PathLike, version: str) -> dict[str, Any]:
    """The manifest of a published version, after checking its hashes and its name.

    Raises CheckpointError saying what is wrong with the directory.
    """
    path = version_path(home, version)
    if not path.is_dir():
        raise CheckpointError(f"{version} is not published under {drafters_dir(home)}")
    try:
        manifest = verify_manifest_files(path)
    except ManifestError as e:
        raise CheckpointError(str(e)) from None
    if manifest.get("version") != version:
        raise CheckpointError(
            f"{path}/{MANIFEST_NAME} says version {manifest.get('version')!r}, not {version!r}: "
            "the directory was renamed or copied over; republish it"
        )
    return manifest


def write_pin(path: str | os.PathLike, home: str | os.PathLike, version: str | None) -> None:
    """Pin serving processes to `version` by writing the fleet version file they poll.

    The version is verified first, so a pin never names a version that every pod would refuse.
    ``None`` removes the pin (the file), and serving falls back to its next source.
    """
    path = Path(path)
    if version is None:
        path.unlink(missing_ok=True)
        return
    verify_version(home, version)
    write_text_atomic(path, version + "\n")
