"""Fixtures for the plugin tests. Importing this file needs neither sglang nor a GPU."""

from __future__ import annotations

import json
import os

import pytest
import torch

TARGET_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 256,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "torch_dtype": "bfloat16",
    "tie_word_embeddings": False,
}


def drafter_raw(block_size=8, head=True):
    return dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=256,
        num_target_layers=4,
        block_size=block_size,
        dflash_config=dict(
            mask_token_id=255, use_thresh_head_two_model=head, thresh_head_bottleneck_dim=16
        ),
    )


@pytest.fixture(scope="session")
def model_pair(tmp_path_factory):
    """A target config directory and published drafters (block 8 with a head, block 4 without)."""
    from sglang_adaflash.drafter.config import DrafterConfig
    from sglang_adaflash.drafter.model import DFlashDrafter
    from sglang_adaflash.drafter.store import publish_version

    root = tmp_path_factory.mktemp("pair")
    target = root / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps(TARGET_CONFIG))
    home = root / "home"
    fp = {"name": "target", "config_sha256": "0" * 64}
    out = {"target": target, "home": home}
    for key, raw in [("head", drafter_raw(8, True)), ("nohead", drafter_raw(4, False))]:
        cfg = DrafterConfig.from_dict(raw)
        torch.manual_seed(0)
        version = publish_version(home, cfg, DFlashDrafter(cfg).state_dict(), target=fp)
        out[key] = home / "drafters" / version
    return out


@pytest.fixture
def clean_env(monkeypatch):
    """ADAFLASH_* and SGLANG_RAGGED_VERIFY_MODE removed for the test, restored after."""
    for name in list(os.environ):
        if name.startswith("ADAFLASH_") or name == "SGLANG_RAGGED_VERIFY_MODE":
            monkeypatch.delenv(name)
    return monkeypatch


@pytest.fixture
def sglang_registry():
    """Snapshot SGLang's speculative registry and restore it after the test."""
    pytest.importorskip("sglang")
    from sglang.srt.speculative import spec_registry

    saved = dict(spec_registry._REGISTRY)
    yield spec_registry._REGISTRY
    spec_registry._REGISTRY.clear()
    spec_registry._REGISTRY.update(saved)
