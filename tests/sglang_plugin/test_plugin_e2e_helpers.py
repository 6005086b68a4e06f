"""The GPU e2e script's CPU-side parts: building and versioning the model pair, the checks."""

from __future__ import annotations

import json

from sglang_adaflash.drafter.checkpoint import read_checkpoint
from sglang_adaflash.sglang_plugin import e2e


def test_random_pair_and_next_version(tmp_path, monkeypatch):
    monkeypatch.setenv("ADAFLASH_E2E_RANDOM_PAIR", "1")
    target, draft = e2e.build_random_pair(tmp_path, vocab=256, block_size=8, seed=0)
    hf = json.loads((target / "config.json").read_text())
    assert hf["architectures"] == ["Qwen3ForCausalLM"] and hf["vocab_size"] == 256
    cfg, state = read_checkpoint(draft)  # published: manifest hashes verified
    assert cfg.block_size == 8 and cfg.use_length_head and cfg.mask_token_id == 255
    assert cfg.num_target_layers == hf["num_hidden_layers"]
    assert any(k.startswith("thresh_head_two_model.") for k in state)
    home = tmp_path / "home"
    v2 = e2e.publish_next(home, draft, seed=5)
    assert v2 == "v000002" and (home / "drafters" / "latest").read_text().strip() == v2
    cfg2, state2 = read_checkpoint(home / "drafters" / v2)
    assert cfg2.block_size == 8
    assert not all(state[k].equal(state2[k]) for k in state)  # new weights for the random pair
    manifest = json.loads((home / "drafters" / v2 / "manifest.json").read_text())
    assert manifest["parent"] == "v000001"


def test_adopting_a_users_drafter(tmp_path, monkeypatch):
    monkeypatch.setenv("ADAFLASH_E2E_RANDOM_PAIR", "1")
    _, draft = e2e.build_random_pair(tmp_path / "a", vocab=256, block_size=4, seed=0)
    adopted = e2e.adopt_drafter(tmp_path / "home", draft)
    assert adopted.name == "v000001"
    monkeypatch.delenv("ADAFLASH_E2E_RANDOM_PAIR")
    v2 = e2e.publish_next(tmp_path / "home", adopted, seed=1)
    a, b = read_checkpoint(adopted)[1], read_checkpoint(tmp_path / "home" / "drafters" / v2)[1]
    assert all(a[k].equal(b[k]) for k in a)  # a real pair republishes the same weights


def test_checks_and_prompts():
    assert e2e.check_equal("x", [[1, 2]], [[1, 2]])["ok"]
    bad = e2e.check_equal("x", [[1, 2], [3]], [[1, 2], [4]])
    assert not bad["ok"] and bad["mismatching_requests"] == [1]
    p = e2e.prompts(3, 100, seed=1)
    assert p == e2e.prompts(3, 100, seed=1) and all(0 <= t < 96 for row in p for t in row)
