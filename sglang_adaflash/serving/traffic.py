"""Traffic records for on-policy distillation, in the shared-volume format of DESIGN.md.

    $ADAFLASH_HOME/traffic/<writer>/<seq>.jsonl           closed shards (immutable)
    $ADAFLASH_HOME/traffic/<writer>/<seq>.jsonl.partial   the shard being written

A writer appends one JSON object per line to its ``.partial`` shard and closes it (flush, fsync,
rename to ``.jsonl``) when it holds ``max_records`` records or is ``max_age_s`` old, and on
:meth:`TrafficWriter.close`. Readers (the training job) take closed shards and may also read a
``.partial`` one, whose last line can be torn. A writer that restarts closes the shards a crash
left behind, dropping a torn last line, before it writes anything new.

Record fields: ``id``, ``ts``, ``model``, ``drafter_version``, ``domain`` (optional tag from the
request), ``prompt_ids``, ``output_ids``, ``sampling`` (temperature, top_p, top_k),
``accept_lens``, ``finish_reason``; ``prompt_text`` / ``output_text`` only when the operator of
the service opts in (``include_text=True``).

SGLang pods need not use this: SGLang's own request log is read by the training job directly
(see docs/sglang.md). The embedded runtime writes records through this module.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..fsio import fsync_dir
from .metrics import MetricsSink, NullSink

SHARD_SUFFIX = ".jsonl"
PARTIAL_SUFFIX = ".jsonl.partial"
_SHARD_RE = re.compile(r"^(\d{8})\.jsonl(\.partial)?$")
_WRITER_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class TrafficError(ValueError):
    """A record or writer setting that cannot be written; the message says what to fix."""


@dataclass
class TrafficRecord:
    id: str
    model: str
    drafter_version: str | None
    prompt_ids: list[int]
    output_ids: list[int]
    sampling: dict[str, Any]  # temperature, top_p, top_k
    accept_lens: list[int]  # per decode step: committed tokens (accepted proposals + bonus)
    finish_reason: str | None
    domain: str | None = None
    ts: float = field(default_factory=time.time)
    prompt_text: str | None = None
    output_text: str | None = None

    def validate(self) -> None:
        if not self.id:
            raise TrafficError("traffic record needs a non-empty id")
        for name in ("prompt_ids", "output_ids", "accept_lens"):
            values = getattr(self, name)
            if not isinstance(values, list) or not all(
                isinstance(v, int) and not isinstance(v, bool) for v in values
            ):
                raise TrafficError(f"traffic record {self.id}: {name} must be a list of ints")
        if sum(self.accept_lens) > len(self.output_ids) + len(self.accept_lens):
            raise TrafficError(
                f"traffic record {self.id}: accept_lens sum to {sum(self.accept_lens)} but only "
                f"{len(self.output_ids)} output tokens were produced"
            )
        unknown = set(self.sampling) - {"temperature", "top_p", "top_k"}
        if unknown:
            raise TrafficError(
                f"traffic record {self.id}: sampling has unknown keys {sorted(unknown)}; "
                "expected temperature, top_p, top_k"
            )

    def to_json(self, include_text: bool) -> dict[str, Any]:
        out = {
            "id": self.id,
            "ts": self.ts,
            "model": self.model,
            "drafter_version": self.drafter_version,
            "domain": self.domain,
            "prompt_ids": self.prompt_ids,
            "output_ids": self.output_ids,
            "sampling": self.sampling,
            "accept_lens": self.accept_lens,
            "finish_reason": self.finish_reason,
        }
        if include_text:
            out["prompt_text"] = self.prompt_text
            out["output_text"] = self.output_text
        return out


def _shard_seq(path: Path) -> int | None:
    m = _SHARD_RE.match(path.name)
    return int(m.group(1)) if m else None


def recover_partial(path: Path) -> Path | None:
    """Close a ``.partial`` shard left by a crash: drop a torn last line, fsync, rename.

    Returns the closed shard, or None when nothing complete was in it (the file is removed).
    """
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1  # keep only whole lines
    good = data[:end]
    if not good.strip():
        path.unlink()
        return None
    if end != len(data):
        with open(path, "r+b") as f:
            f.truncate(end)
            f.flush()
            os.fsync(f.fileno())
    final = path.with_name(path.name[: -len(".partial")])
    os.replace(path, final)
    fsync_dir(path.parent)
    return final


class TrafficWriter:
    """Appends traffic records to rotating shards of one writer (thread-safe)."""

    def __init__(
        self,
        home: str | os.PathLike,
        writer: str,
        *,
        max_records: int = 1000,
        max_age_s: float = 300.0,
        include_text: bool = False,
        sink: MetricsSink | None = None,
        clock=time.time,
    ):
        if not _WRITER_RE.match(writer):
            raise TrafficError(
                f"writer name {writer!r} must be 1-128 characters of letters, digits, '.', '_' "
                "or '-' (use the pod name)"
            )
        if max_records < 1:
            raise TrafficError(f"max_records must be at least 1, found {max_records}")
        self.dir = Path(home) / "traffic" / writer
        self.dir.mkdir(parents=True, exist_ok=True)
        self.max_records = max_records
        self.max_age_s = max_age_s
        self.include_text = include_text
        self.sink = sink or NullSink()
        self._clock = clock
        self._lock = threading.Lock()
        self._file = None
        self._path: Path | None = None
        self._count = 0
        self._opened_at = 0.0
        self.recovered = [p for p in sorted(self.dir.glob(f"*{PARTIAL_SUFFIX}"))]
        self.recovered = [recover_partial(p) for p in self.recovered]
        seqs = [s for s in (_shard_seq(p) for p in self.dir.iterdir()) if s is not None]
        self._next_seq = max(seqs, default=0) + 1

    def write(self, record: TrafficRecord) -> None:
        record.validate()
        line = json.dumps(record.to_json(self.include_text), separators=(",", ":")) + "\n"
        with self._lock:
            if self._file is not None and self._clock() - self._opened_at >= self.max_age_s:
                self._close_shard()
            if self._file is None:
                self._open_shard()
            self._file.write(line)
            self._file.flush()  # a reader of the partial shard sees whole lines
            self._count += 1
            if self._count >= self.max_records:
                self._close_shard()
        self.sink.count_traffic_records(1, record.domain)

    def rotate(self) -> Path | None:
        """Close the current shard now (e.g. on a timer); returns it, or None if none was open."""
        with self._lock:
            return self._close_shard()

    def close(self) -> None:
        self.rotate()

    def __enter__(self) -> TrafficWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _open_shard(self) -> None:
        self._path = self.dir / f"{self._next_seq:08d}{PARTIAL_SUFFIX}"
        self._next_seq += 1
        self._file = open(self._path, "x")  # never reuse a name
        self._count = 0
        self._opened_at = self._clock()

    def _close_shard(self) -> Path | None:
        if self._file is None:
            return None
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        final = self._path.with_name(self._path.name[: -len(".partial")])
        os.replace(self._path, final)
        fsync_dir(self.dir)
        self._file, self._path = None, None
        return final


def iter_records(directory: str | os.PathLike, *, include_partial: bool = False) -> Iterator[dict]:
    """Records of one writer's shards in order; a torn last line of a partial shard is skipped."""
    directory = Path(directory)
    shards = sorted(
        (p for p in directory.iterdir() if _shard_seq(p) is not None),
        key=lambda p: (_shard_seq(p), p.name),
    )
    for shard in shards:
        partial = shard.name.endswith(".partial")
        if partial and not include_partial:
            continue
        lines = shard.read_text().split("\n")
        for i, line in enumerate(lines):
            if not line.strip():
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                if partial and i == len(lines) - 1:
                    return  # still being written
                raise TrafficError(
                    f"{shard}:{i + 1} is not valid JSON; the shard is corrupt"
                ) from None
