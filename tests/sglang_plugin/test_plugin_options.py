"""ADAFLASH options from environment variables and the drafter's config.json (no sglang)."""

from __future__ import annotations

import json

import pytest

from sglang_adaflash.sglang_plugin.options import ENV_VARS, AdaFlashOptions, OptionError


def _draft(tmp_path, head=True, **ada):
    cfg = {
        "block_size": 8,
        "dflash_config": {"mask_token_id": 1, "use_thresh_head_two_model": head},
        "adaflash_config": ada,
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


def test_defaults_come_from_the_drafter_config(tmp_path):
    opts = AdaFlashOptions.resolve(
        _draft(tmp_path, length_head_rate=1.5, length_head_min_len=3), env={}
    )
    assert opts.use_length_head and opts.block_size == 8
    assert opts.rate == 1.5 and opts.min_len == 3
    assert opts.sources == {
        "use_length_head": "config.json",
        "rate": "config.json",
        "min_len": "config.json",
    }
    assert opts.verify_mode == "auto" and opts.metrics


def test_environment_wins(tmp_path):
    env = {
        "ADAFLASH_LENGTH_RATE": "1.1",
        "ADAFLASH_LENGTH_MIN": "1",
        "ADAFLASH_VERIFY_MODE": "CAP",
        "ADAFLASH_LENGTH_HEAD": "off",
        "ADAFLASH_COST_FIXED_MS": "4",
        "ADAFLASH_COST_PER_TOKEN_US": "20",
        "ADAFLASH_METRICS": "0",
    }
    opts = AdaFlashOptions.resolve(_draft(tmp_path, length_head_rate=1.5), env=env)
    assert opts.rate == 1.1 and opts.min_len == 1 and opts.verify_mode == "cap"
    assert not opts.use_length_head and opts.length_head_in_config
    assert opts.cost_fixed_s == pytest.approx(0.004) and opts.cost_per_token_s == pytest.approx(
        2e-5
    )
    assert not opts.metrics and opts.sources["rate"] == "env"


def test_paper_defaults_without_a_local_config():
    opts = AdaFlashOptions.resolve("org/hub-drafter", env={})
    assert (opts.rate, opts.min_len, opts.use_length_head, opts.block_size) == (1.3, 2, False, None)


@pytest.mark.parametrize(
    "env, match",
    [
        ({"ADAFLASH_VERIFY_MODE": "fast"}, "ADAFLASH_VERIFY_MODE='fast': expected one of"),
        ({"ADAFLASH_LENGTH_RATE": "x"}, "expected a number"),
        ({"ADAFLASH_LENGTH_MIN": "9"}, "exceeds the drafter's block_size 8"),
        ({"ADAFLASH_LENGTH_MIN": "0"}, "at least 1"),
        ({"ADAFLASH_COST_PER_TOKEN_US": "0"}, "ADAFLASH_COST_PER_TOKEN_US > 0"),
    ],
)
def test_bad_settings_say_what_to_do(tmp_path, env, match):
    with pytest.raises(OptionError, match=match):
        AdaFlashOptions.resolve(_draft(tmp_path), env=env)


def test_head_on_without_head_weights_is_an_error(tmp_path):
    with pytest.raises(OptionError, match="use_thresh_head_two_model"):
        AdaFlashOptions.resolve(_draft(tmp_path, head=False), env={"ADAFLASH_LENGTH_HEAD": "on"})


def test_corrupt_config_is_reported(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(OptionError, match="cannot be read as JSON"):
        AdaFlashOptions.resolve(tmp_path, env={})


def test_every_variable_is_documented():
    doc = (__import__("pathlib").Path(__file__).parents[2] / "docs" / "sglang.md").read_text()
    missing = [name for name in ENV_VARS if name not in doc]
    assert not missing, f"docs/sglang.md does not document {missing}"


def test_hub_id_config_comes_from_the_local_cache(tmp_path, monkeypatch):
    pytest.importorskip("huggingface_hub")
    cache = tmp_path / "hub"
    snap = cache / "models--org--drafter" / "snapshots" / ("a" * 40)
    snap.mkdir(parents=True)
    (cache / "models--org--drafter" / "refs").mkdir()
    (cache / "models--org--drafter" / "refs" / "main").write_text("a" * 40)
    _draft(snap, length_head_rate=1.7)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "HF_HUB_CACHE", str(cache))
    opts = AdaFlashOptions.resolve("org/drafter", env={})
    assert opts.use_length_head and opts.rate == 1.7 and opts.block_size == 8
