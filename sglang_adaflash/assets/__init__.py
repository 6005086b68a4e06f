"""Shipped assets: the embedded model pair, the held-out workloads and the chat format.

Paths are resolved relative to this package so an installed copy finds them too.
"""

from __future__ import annotations

from pathlib import Path

ASSETS_DIR = Path(__file__).resolve().parent
MODELS_DIR = ASSETS_DIR / "models"
TARGET_DIR = MODELS_DIR / "target"
DRAFTER_DIR = MODELS_DIR / "drafter"
WORKLOADS_DIR = ASSETS_DIR / "workloads"
DOMAINS: tuple[str, ...] = ("code", "math", "prose")


def workload_path(domain: str, split: str = "heldout") -> Path:
    """The JSONL prompt file of one domain's split (only held-out splits are shipped)."""
    if domain not in DOMAINS:
        raise ValueError(f"unknown domain {domain!r}: expected one of {', '.join(DOMAINS)}")
    return WORKLOADS_DIR / f"{domain}.{split}.jsonl"
