"""Admin endpoint logic, framework-agnostic (the SGLang plugin mounts it on SGLang's HTTP app).

The HTTP process is not the process that serves the drafter, so the two talk through files:
the admin call writes the override the watcher reads, and reads the status the reporters write.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from sglang_adaflash.drafter.store import LATEST_NAME, drafters_dir
from sglang_adaflash.fsio import write_text_atomic

from .contract import ENV_STATUS_FILE, ReloadError, version_number


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
    path: str | os.PathLike, version: str | None, home: str | os.PathLike
) -> dict[str, Any]:
    """Ask the watcher for ``version`` (or clear the override with None); validates first."""
    path = Path(path)
    if version is None:
        path.unlink(missing_ok=True)
        return {"override": None}
    if version != LATEST_NAME:
        version_number(version)
        if not (drafters_dir(home) / version).is_dir():
            raise ReloadError(
                f"drafter version {version} is not published under {drafters_dir(home)}; "
                f"published: {', '.join(sorted(p.name for p in drafters_dir(home).glob('v*'))) or 'none'}"
            )
    write_text_atomic(path, version + "\n")
    return {"override": version}
