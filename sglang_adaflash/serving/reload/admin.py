"""Admin endpoint logic, framework-agnostic (the SGLang plugin mounts it on SGLang's HTTP app).

The HTTP process is not the process that serves the drafter, so the two talk through files:
the admin call writes the override the watcher reads, and reads the status the reporters write.

The override outranks the fleet version the operator's gate, canary and rollback decide, so it
must not undo their verdicts by accident: a version the operator blocked (its DrafterVersion is
Rejected or RolledBack; the operator lists them in a ConfigMap key mounted into the pod) is
refused unless the caller says ``force``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from sglang_adaflash.drafter.store import LATEST_NAME, drafters_dir
from sglang_adaflash.fsio import write_text_atomic

from .contract import ENV_STATUS_FILE, ReloadError, is_version, version_number
from .source import read_latest, read_optional_text


class BlockedVersion(ReloadError):
    """The override names a version the operator took out of service (the caller may force it)."""


def read_blocked_versions(path: str | os.PathLike | None) -> dict[str, str]:
    """version -> why it is blocked, from lines ``v000003 Rejected``; absent file: none.

    The file is the operator's (a ConfigMap key the kubelet refreshes), so lines that are not a
    version are skipped rather than failing the admin call.
    """
    text = read_optional_text(Path(path)) if path else None
    out: dict[str, str] = {}
    for line in (text or "").splitlines():
        version, _, why = line.strip().partition(" ")
        if is_version(version):
            out[version] = why.strip() or "blocked"
    return out


def read_status(path: str | os.PathLike | None) -> dict[str, Any]:
    """The status a serving process last reported, or a 'not reported yet' stub."""
    if path is None:
        return {"loaded_version": None, "error": f"{ENV_STATUS_FILE} is not set"}
    try:
        return json.loads(Path(path).read_bytes())
    except FileNotFoundError:
        return {"loaded_version": None, "error": "the serving process has not reported yet"}
    except (json.JSONDecodeError, UnicodeDecodeError) as e:  # written atomically: a foreign writer
        return {"loaded_version": None, "error": f"{path} is not valid JSON: {e}"}


def set_override(
    path: str | os.PathLike,
    version: str | None,
    home: str | os.PathLike,
    *,
    blocked: dict[str, str] | None = None,
    force: bool = False,
) -> dict[str, Any]:
    """Ask the watcher for ``version`` (or clear the override with None); validates first.

    ``latest`` is checked against ``blocked`` as it resolves now: the check guards against a
    mistake at the time of the call, not against later publications.
    """
    path = Path(path)
    if version is None:
        path.unlink(missing_ok=True)
        return {"override": None}
    resolved = version
    if version == LATEST_NAME:
        resolved = read_latest(home)
    else:
        version_number(version)
        if not (drafters_dir(home) / version).is_dir():
            raise ReloadError(
                f"drafter version {version} is not published under {drafters_dir(home)}; "
                f"published: {', '.join(sorted(p.name for p in drafters_dir(home).glob('v*'))) or 'none'}"
            )
    why = (blocked or {}).get(resolved) if resolved else None
    if why and not force:
        raise BlockedVersion(
            f"drafter version {resolved} is {why} by the operator's gate or rollback; send "
            '"force": true to pin it anyway'
        )
    write_text_atomic(path, version + "\n")
    out: dict[str, Any] = {"override": version}
    if why:
        out["forced_past"] = f"{resolved} {why}"
    return out
