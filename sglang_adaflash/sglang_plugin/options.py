"""ADAFLASH options: environment variables first, then the drafter's ``config.json``.

SGLang 0.5.23 has no generic field for plugin arguments, so ADAFLASH reads its own settings from
documented ``ADAFLASH_*`` environment variables (they reach every SGLang subprocess) and from the
drafter checkpoint (``dflash_config`` / ``adaflash_config`` in ``config.json``). Every variable
is listed in :data:`ENV_VARS` and in ``docs/sglang.md``.

This module imports neither torch nor sglang, so the CLI and server-arg hooks stay cheap.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Verify modes.
#: The target verifies only the chosen lengths, packed ragged ("compact"): real compute savings.
VERIFY_COMPACT = "compact"
#: The target verifies whole blocks; acceptance is capped at the chosen lengths (measures the
#: head's effect on acceptance, saves no target compute).
VERIFY_CAP = "cap"
#: Plain fixed-length DFlash verification (the length head is not used for verification).
VERIFY_FIXED = "fixed"
#: Compact where the attention backend can do ragged verification, else fixed, said at start-up.
VERIFY_AUTO = "auto"
VERIFY_MODES = (VERIFY_AUTO, VERIFY_COMPACT, VERIFY_CAP, VERIFY_FIXED)

#: The verify mode the server-argument hook resolved (``auto`` decided), set in the launcher
#: process and inherited by every SGLang subprocess.
RESOLVED_MODE_ENV = "ADAFLASH_RESOLVED_VERIFY_MODE"


def resolved_verify_mode() -> str | None:
    return os.environ.get(RESOLVED_MODE_ENV) or None

#: Variables ADAFLASH reads, with their meaning (rendered in docs/sglang.md).
ENV_VARS: dict[str, str] = {
    "ADAFLASH_VERIFY_MODE": "auto | compact | cap | fixed (default auto)",
    "ADAFLASH_LENGTH_HEAD": "auto | on | off: use the drafter's length head (default auto: on "
    "when config.json enables use_thresh_head_two_model)",
    "ADAFLASH_LENGTH_RULE": "load_aware (default: the reference engine's step-cost rule) | paper "
    "(clamp(round(ratio*B*rate), min_len, B))",
    "ADAFLASH_LENGTH_RATE": "rate of the paper rule clamp(round(ratio*B*rate), min_len, B); "
    "default from adaflash_config.length_head_rate, else 1.3",
    "ADAFLASH_LENGTH_MIN": "minimum verify length (slot 0 included); default from "
    "adaflash_config.length_head_min_len, else 2",
    "ADAFLASH_COST_FIXED_MS": "step-cost model: length-independent time of a decode step in ms "
    "(default 8.0)",
    "ADAFLASH_COST_PER_TOKEN_US": "step-cost model: target time per verified token in us "
    "(default 16.0)",
    "ADAFLASH_METRICS": "1 (default) to export the adaflash_* Prometheus metrics, 0 to disable",
    "ADAFLASH_HOME": "shared volume with drafters/<version>/ and drafters/latest",
    "ADAFLASH_FLEET_VERSION_FILE": "plain file naming the fleet's drafter version (the operator "
    "mounts ConfigMap key drafter-version at /etc/adaflash/fleet/drafter-version)",
    "ADAFLASH_DESIRED_VERSION_FILE": "older name of ADAFLASH_FLEET_VERSION_FILE, read when that "
    "is unset",
    "ADAFLASH_POD_ANNOTATIONS_FILE": "downward-API annotations file (the operator mounts "
    "/etc/adaflash/pod/annotations); key adaflash.io/desired-drafter-version (canary)",
    "ADAFLASH_POD_NAME": "this pod's name (downward API metadata.name; falls back to POD_NAME): "
    "the pod whose adaflash.io/ annotations are kept up to date",
    "ADAFLASH_POD_NAMESPACE": "this pod's namespace (downward API; falls back to POD_NAMESPACE, "
    "then the service account's namespace)",
    "ADAFLASH_POD_REPORT_S": "seconds between updates of the acceptance-tau and traffic-records "
    "pod annotations (default 15)",
    "ADAFLASH_ADMIN_OVERRIDE_FILE": "file written by POST /adaflash/v1/drafter (highest priority)",
    "ADAFLASH_ADMIN_TOKEN": "POST /adaflash/v1/drafter needs 'Authorization: Bearer <token>'; unset: POST is refused",
    "ADAFLASH_BLOCKED_VERSIONS_FILE": "'<version> <phase>' lines the admin call refuses without force (the operator's ConfigMap key)",
    "ADAFLASH_FOLLOW_LATEST": "1 to follow drafters/latest when nothing else names a version",
    "ADAFLASH_LOADED_VERSION_FILE": "status JSON of the loaded version (GET /adaflash/v1/drafter)",
    "ADAFLASH_RELOAD_POLL_S": "seconds between checks of the desired version (default 5)",
    "ADAFLASH_RELOAD_SYNC_STEPS": "decode steps between tensor-parallel reload agreements "
    "(default 16)",
    "ADAFLASH_RELOAD_REQUIRE_MANIFEST": "1 (default): only hot-reload directories with a "
    "manifest.json",
    "ADAFLASH_DRAFTER_VERSION": "version name of the drafter given at start-up (default: read "
    "from its manifest.json, else the directory name)",
}


class OptionError(ValueError):
    """An ADAFLASH setting that cannot be used; the message names the variable and the fix."""


def _env_choice(env: Mapping[str, str], name: str, choices: tuple[str, ...], default: str) -> str:
    value = env.get(name, "").strip().lower() or default
    if value not in choices:
        raise OptionError(f"{name}={value!r}: expected one of {', '.join(choices)}")
    return value


def _env_float(env: Mapping[str, str], name: str, default: float | None) -> float | None:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        return float(raw)
    except ValueError:
        raise OptionError(f"{name}={raw!r}: expected a number") from None


def _env_int(env: Mapping[str, str], name: str, default: int | None) -> int | None:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        return int(raw)
    except ValueError:
        raise OptionError(f"{name}={raw!r}: expected an integer") from None


def _cached_hub_config(repo_id: str) -> Path | None:
    """config.json of a Hugging Face repo id if SGLang already fetched it (never downloads)."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    try:
        found = try_to_load_from_cache(repo_id, "config.json")
    except Exception:  # not a valid repo id, or no cache
        return None
    return Path(found) if isinstance(found, str) else None


def read_draft_config(draft_path: str | os.PathLike | None) -> dict[str, Any]:
    """The drafter's config.json as a dict: from a local directory, or from the local Hugging
    Face cache for a hub id (SGLang fetches the config before ADAFLASH reads it); {} otherwise."""
    if not draft_path:
        return {}
    path = Path(draft_path) / "config.json"
    if not path.is_file():
        path = _cached_hub_config(str(draft_path))
        if path is None:
            return {}
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise OptionError(
            f"{path} cannot be read as JSON ({e}); fix the drafter's config"
        ) from None
    return raw if isinstance(raw, dict) else {}


@dataclass(frozen=True)
class AdaFlashOptions:
    verify_mode: str = VERIFY_AUTO
    use_length_head: bool = False
    length_head_in_config: bool = False
    block_size: int | None = None
    length_rule: str = "load_aware"
    rate: float = 1.3
    min_len: int = 2
    cost_fixed_s: float = 0.008
    cost_per_token_s: float = 16e-6
    metrics: bool = True
    sources: dict[str, str] = field(default_factory=dict, compare=False)

    @classmethod
    def resolve(
        cls, draft_path: str | os.PathLike | None, env: Mapping[str, str] | None = None
    ) -> AdaFlashOptions:
        """Environment variables win over config.json, which wins over the defaults."""
        env = os.environ if env is None else env
        raw = read_draft_config(draft_path)
        dflash = raw.get("dflash_config") or {}
        ada = raw.get("adaflash_config") or {}
        sources: dict[str, str] = {}

        in_config = bool(dflash.get("use_thresh_head_two_model", False))
        head = _env_choice(env, "ADAFLASH_LENGTH_HEAD", ("auto", "on", "off"), "auto")
        if head == "on" and not in_config:
            raise OptionError(
                "ADAFLASH_LENGTH_HEAD=on, but the drafter's config.json does not enable "
                "dflash_config.use_thresh_head_two_model, so it has no length head weights; "
                "use a drafter trained with the head or set ADAFLASH_LENGTH_HEAD=auto"
            )
        use_head = in_config if head == "auto" else head == "on"
        sources["use_length_head"] = "env" if head != "auto" else "config.json"

        def pick(name: str, env_value, cfg_value, default):
            if env_value is not None:
                sources[name] = "env"
                return env_value
            if cfg_value is not None:
                sources[name] = "config.json"
                return cfg_value
            sources[name] = "default"
            return default

        rate = pick(
            "rate", _env_float(env, "ADAFLASH_LENGTH_RATE", None), ada.get("length_head_rate"), 1.3
        )
        min_len = pick(
            "min_len", _env_int(env, "ADAFLASH_LENGTH_MIN", None), ada.get("length_head_min_len"), 2
        )
        block = dflash.get("block_size", raw.get("block_size"))  # both spellings, as DFLASH
        fixed_ms = _env_float(env, "ADAFLASH_COST_FIXED_MS", 8.0)
        per_token_us = _env_float(env, "ADAFLASH_COST_PER_TOKEN_US", 16.0)
        opts = cls(
            verify_mode=_env_choice(env, "ADAFLASH_VERIFY_MODE", VERIFY_MODES, VERIFY_AUTO),
            use_length_head=use_head,
            length_head_in_config=in_config,
            block_size=int(block) if block is not None else None,
            length_rule=_env_choice(
                env, "ADAFLASH_LENGTH_RULE", ("load_aware", "paper"), "load_aware"
            ),
            rate=float(rate),
            min_len=int(min_len),
            cost_fixed_s=fixed_ms / 1e3,
            cost_per_token_s=per_token_us / 1e6,
            metrics=env.get("ADAFLASH_METRICS", "1").strip() not in ("0", "false", "no"),
            sources=sources,
        )
        opts.validate()
        return opts

    def validate(self) -> None:
        if self.rate <= 0:
            raise OptionError(
                f"length rate must be positive, found {self.rate} (ADAFLASH_LENGTH_RATE)"
            )
        if self.min_len < 1:
            raise OptionError(
                f"minimum verify length must be at least 1 (slot 0), found {self.min_len} "
                "(ADAFLASH_LENGTH_MIN)"
            )
        if self.block_size is not None and self.min_len > self.block_size:
            raise OptionError(
                f"ADAFLASH_LENGTH_MIN={self.min_len} exceeds the drafter's block_size "
                f"{self.block_size}; use a value in 1..{self.block_size}"
            )
        if self.cost_fixed_s < 0 or self.cost_per_token_s <= 0:
            raise OptionError(
                "step-cost model needs ADAFLASH_COST_FIXED_MS >= 0 and "
                f"ADAFLASH_COST_PER_TOKEN_US > 0, found {self.cost_fixed_s * 1e3} ms and "
                f"{self.cost_per_token_s * 1e6} us"
            )
