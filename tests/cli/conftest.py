"""A tiny random float64 pair (lossless equality is checked bit for bit) and a prompt file."""

from __future__ import annotations

import json

import pytest

from sglang_adaflash.testing import build_tiny_pair

TINY = dict(target_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1,
            head_dim=16, drafter_layers=1, block_size=4, length_head_bottleneck_dim=16, dtype="float64")


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory):
    return build_tiny_pair(tmp_path_factory.mktemp("pair") / "p", seed=0, **TINY)


@pytest.fixture(scope="session")
def other_pair(tmp_path_factory):
    """A pair with another hidden size: its drafter does not fit tiny_pair's target."""
    return build_tiny_pair(tmp_path_factory.mktemp("pair2") / "p", seed=1, **{**TINY, "hidden_size": 48})


def write_jsonl(path, rows) -> str:
    with open(path, "w") as f:
        for r in rows:
            f.write(r if isinstance(r, str) else json.dumps(r))
            f.write("\n")
    return str(path)
