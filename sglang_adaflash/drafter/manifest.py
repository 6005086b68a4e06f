"""`manifest.json`: what a published drafter version is, and the hashes that prove it.

Format `adaflash.drafter/v1` (docs/contracts.md, "Manifest"): version, parent, created,
target {name, config_digest, config_sha256}, files {name: sha256}, training {...}, eval {...}.
A reader verifies the hashes before it trusts the weights, so a torn copy or a tampered file is
caught before it is served.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = "adaflash.drafter/v1"
REQUIRED_FILES = ("config.json", "model.safetensors")


class ManifestError(ValueError):
    """A manifest that does not vouch for the files next to it."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def config_digest(config: Any) -> str:
    """sha256 of a parsed config in one canonical serialisation (sorted keys, no whitespace).

    The fingerprint follows the content, not the bytes: re-indenting or re-ordering a target's
    `config.json` does not make its drafters "built for another target"; changing a value does.
    """
    canonical = json.dumps(config, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def _hf_serialisation_sha256(config: Any) -> str:
    """sha256 of the config as Hugging Face's `save_pretrained` writes it (indent 2, sorted keys).

    Manifests written before `config_digest` existed carry only the sha256 of the file's bytes;
    for a config saved by `save_pretrained`, those bytes are this serialisation of its content, so
    an old manifest still matches a target whose file was only re-indented.
    """
    text = json.dumps(config, indent=2, sort_keys=True) + "\n"
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _read_target_config(target_dir: Path) -> Any:
    path = target_dir / "config.json"
    try:
        return json.loads(path.read_bytes().decode("utf-8"))
    except FileNotFoundError:
        raise ManifestError(f"{path} is missing: the target directory is not a model") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ManifestError(f"{path} is not valid JSON ({e}): fix or re-download the target") from None


def target_fingerprint(target_dir: str | os.PathLike) -> dict[str, str]:
    """Identifies a target: its directory name, the digest of its parsed config.json, and (for
    readers older than `config_digest`) the sha256 of the file's bytes."""
    target_dir = Path(target_dir)
    return {
        "name": target_dir.resolve().name,
        "config_digest": config_digest(_read_target_config(target_dir)),
        "config_sha256": _sha256(target_dir / "config.json"),
    }


def target_matches(want: dict[str, Any], target_dir: str | os.PathLike) -> bool:
    """Whether a manifest's `target` entry names the target in `target_dir`.

    `config_digest` (content) decides when present. Older manifests hold only `config_sha256`
    (bytes): they match the file's bytes, or the content in Hugging Face's serialisation.
    An entry with neither pins nothing, and matches.
    """
    target_dir = Path(target_dir)
    digest, raw = want.get("config_digest"), want.get("config_sha256")
    if digest:
        return config_digest(_read_target_config(target_dir)) == digest
    if raw:
        if _sha256(target_dir / "config.json") == raw:
            return True
        return _hf_serialisation_sha256(_read_target_config(target_dir)) == raw
    return True


def build_manifest(
    directory: str | os.PathLike,
    *,
    version: str,
    parent: str | None,
    target: dict[str, str],
    training: dict[str, Any] | None = None,
    eval: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Manifest for the files already in `directory` (hashes computed now)."""
    directory = Path(directory)
    files = {
        p.name: _sha256(p)
        for p in sorted(directory.iterdir())
        if p.is_file() and p.name != MANIFEST_NAME and not p.name.startswith(".")
    }
    return {
        "format": MANIFEST_FORMAT,
        "version": version,
        "parent": parent,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "target": dict(target),
        "files": files,
        "training": training or {},
        "eval": eval or {},
    }


def read_manifest(directory: str | os.PathLike) -> dict[str, Any]:
    path = Path(directory) / MANIFEST_NAME
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise ManifestError(f"{path} is missing: only published versions can be served") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ManifestError(f"{path} is not valid JSON ({e}): the version is corrupt; republish it") from None
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise ManifestError(f"{path}: expected format {MANIFEST_FORMAT!r}, found {found!r}")
    return manifest


def verify_manifest_files(directory: str | os.PathLike) -> dict[str, Any]:
    """Checks every listed file's sha256 and that the required files are listed."""
    directory = Path(directory)
    manifest = read_manifest(directory)
    files = manifest.get("files") or {}
    for name in REQUIRED_FILES:
        if name not in files:
            raise ManifestError(f"{directory}/{MANIFEST_NAME} does not list {name}; the version cannot be verified")
    for name, digest in files.items():
        path = directory / name
        if not path.is_file():
            raise ManifestError(f"{path} is listed in the manifest but missing: the copy is incomplete")
        actual = _sha256(path)
        if actual != digest:
            raise ManifestError(
                f"{path}: sha256 {actual[:12]}... does not match the manifest's {str(digest)[:12]}...: "
                "the file was modified or torn after publishing; do not serve this copy"
            )
    return manifest


def check_target(manifest: dict[str, Any], target_dir: str | os.PathLike) -> None:
    """A drafter is only valid for the target it was trained on."""
    want = manifest.get("target") or {}
    if not isinstance(want, dict) or target_matches(want, target_dir):
        return
    have = target_fingerprint(target_dir)
    name = want.get("name", "?")
    pinned = want.get("config_digest") or want.get("config_sha256") or ""
    raise ManifestError(
        f"this drafter ({manifest.get('version')}) was built for target {name!r} "
        f"(config {pinned[:12]}...), not for {have['name']!r} ({have['config_digest'][:12]}...): "
        f"pass the drafter built for {have['name']!r}"
    )
