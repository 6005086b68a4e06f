"""Which drafter version this process should serve, read from files it does not own.

Every source is a file someone else writes (an admin call, the kubelet's downward API, a
ConfigMap, the training job's ``drafters/latest``) and is polled from the watcher thread, so a
file that is missing, unreadable, not text or not a version name counts as no value (logged,
not raised) and serving goes on with what is loaded.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from sglang_adaflash.drafter.checkpoint import CheckpointError
from sglang_adaflash.drafter.store import LATEST_NAME, drafters_dir, latest_version

from .contract import (
    DEFAULT_HOME,
    DESIRED_ANNOTATION,
    ENV_ANNOTATIONS_FILE,
    ENV_FLEET_VERSION_FILE,
    ENV_FOLLOW_LATEST,
    ENV_HOME,
    ENV_OVERRIDE_FILE,
    ENV_VERSION_FILE_ALIAS,
    ReloadError,
    is_version,
    version_number,
)

logger = logging.getLogger(__name__)


def read_latest(home: str | os.PathLike) -> str | None:
    """The version named by ``drafters/latest``, or None (absent or unreadable: logged)."""
    try:
        return latest_version(home)
    except UnicodeDecodeError as e:  # a version name is ASCII: these bytes are not one
        logger.warning("ignoring drafters/latest: it is not text (%s)", e)
        return None
    except (CheckpointError, OSError) as e:
        logger.warning("ignoring drafters/latest: %s", e)
        return None


def resolve_version_dir(home: str | os.PathLike, version: str) -> Path:
    """The directory of ``version`` on the shared volume (``latest`` is resolved first)."""
    if version == LATEST_NAME:
        resolved = read_latest(home)
        if resolved is None:
            raise ReloadError(f"{drafters_dir(home) / LATEST_NAME} names no published version yet")
        version = resolved
    version_number(version)  # rejects names that could escape drafters/
    return drafters_dir(home) / version


def parse_downward_annotations(text: str) -> dict[str, str]:
    """Parse a Kubernetes downward-API ``annotations`` file: lines of ``key="quoted value"``.

    Values are Go-quoted strings; JSON string syntax covers what annotation values contain.
    Malformed lines are skipped (the kubelet rewrites the file atomically, so they are rare).
    """
    out: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, raw = line.partition("=")
        if not sep or not key.strip():
            continue
        raw = raw.strip()
        if len(raw) >= 2 and raw[0] == raw[-1] == '"':
            try:
                value = json.loads(raw)
            except json.JSONDecodeError:
                value = raw[1:-1]
        else:
            value = raw
        out[key.strip()] = value
    return out


def read_optional_text(path: Path | None) -> str | None:
    """A small file's text, or None when it is absent, unreadable or not UTF-8.

    Callers poll these files from the watcher and must keep serving whatever a volume, a
    ConfigMap or a person put in them, so bad bytes are logged and treated as no value.
    """
    if path is None:
        return None
    try:
        data = path.read_bytes()
    except (FileNotFoundError, IsADirectoryError, PermissionError):
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        logger.warning("ignoring %s: it is not UTF-8 text (%s)", path, e)
        return None


@dataclass
class DesiredVersionSource:
    """Reads which drafter version this process should serve.

    Priority: ``override_file`` (admin HTTP call) > ``annotations_file`` key
    ``annotation_key`` (per-pod canary) > ``version_file`` (fleet version, from
    ``ADAFLASH_FLEET_VERSION_FILE``) > ``drafters/latest`` when ``follow_latest``. A source that is absent, empty or not a version name is skipped; the
    value ``latest`` in any of them means the version ``drafters/latest`` names.
    """

    home: Path
    version_file: Path | None = None
    annotations_file: Path | None = None
    override_file: Path | None = None
    follow_latest: bool = False
    annotation_key: str = DESIRED_ANNOTATION

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> DesiredVersionSource:
        env = os.environ if env is None else env

        def path(name: str) -> Path | None:
            return Path(env[name]) if env.get(name) else None

        return cls(
            home=Path(env.get(ENV_HOME) or DEFAULT_HOME),
            version_file=path(ENV_FLEET_VERSION_FILE) or path(ENV_VERSION_FILE_ALIAS),
            annotations_file=path(ENV_ANNOTATIONS_FILE),
            override_file=path(ENV_OVERRIDE_FILE),
            follow_latest=env.get(ENV_FOLLOW_LATEST, "0").lower() in ("1", "true", "yes"),
        )

    def _candidates(self) -> Iterable[tuple[str, str | None]]:
        override = read_optional_text(self.override_file)
        yield "admin override", override.strip() if override else None
        annotations = read_optional_text(self.annotations_file)
        if annotations is not None:
            yield "pod annotation", parse_downward_annotations(annotations).get(self.annotation_key)
        fleet = read_optional_text(self.version_file)
        yield "fleet version file", fleet.strip() if fleet else None
        if self.follow_latest:
            yield "drafters/latest", LATEST_NAME

    def read(self) -> tuple[str, str] | None:
        """(version, which source said so), or None when no source names a version."""
        for origin, value in self._candidates():
            if not value:
                continue
            if value == LATEST_NAME:
                latest = read_latest(self.home)
                if latest is not None:
                    return latest, f"{origin} (latest)"
                continue
            if is_version(value):
                return value, origin
            logger.warning("%s names %r, which is not a drafter version; ignored", origin, value)
        return None
