"""Shared helpers of the workload builders: records, deterministic splits, atomic JSONL."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from sglang_adaflash.fsio import write_bytes_atomic

SPLITS: tuple[str, ...] = ("train", "heldout")


def stable_hash(text: str) -> int:
    """A hash that is the same in every process and on every machine (unlike ``hash``)."""
    return int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "big")


def is_heldout(key: str, percent: float, salt: str) -> bool:
    """Whether the unit named ``key`` (a module, a chapter, ...) belongs to the held-out split."""
    return stable_hash(f"{salt}:{key}") % 10_000 < int(percent * 100)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file, fsync and rename."""
    write_bytes_atomic(path, data)


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def dumps_jsonl(records: Iterable[dict[str, Any]]) -> str:
    return "".join(json.dumps(r, ensure_ascii=False, sort_keys=True) + "\n" for r in records)


def write_jsonl(path: Path, records: Iterable[dict[str, Any]]) -> int:
    """Write records atomically, one JSON object per line; return how many were written."""
    records = list(records)
    atomic_write_text(path, dumps_jsonl(records))
    return len(records)


def read_jsonl(path: Path) -> Iterator[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if line:
                yield json.loads(line)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
