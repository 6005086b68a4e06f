"""The target fingerprint follows a config's content, and old manifests stay readable."""

from __future__ import annotations

import hashlib
import json

import pytest

from sglang_adaflash.drafter.manifest import ManifestError, check_target, target_fingerprint

CONFIG = {"model_type": "qwen3", "hidden_size": 64, "num_hidden_layers": 4, "vocab_size": 320,
          "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}}


def _target(tmp_path, text: str, name: str = "target"):
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(text)
    return d


def _hf_text(cfg) -> str:  # what transformers' save_pretrained writes
    return json.dumps(cfg, indent=2, sort_keys=True) + "\n"


def _manifest(target: dict) -> dict:
    return {"version": "v000001", "target": target}


def test_reindented_config_still_matches(tmp_path):
    built = _target(tmp_path, _hf_text(CONFIG), "built")
    manifest = _manifest(target_fingerprint(built))
    reindented = _target(tmp_path, json.dumps(CONFIG, indent=4), "reindented")
    reordered = _target(tmp_path, json.dumps(dict(reversed(list(CONFIG.items())))), "reordered")
    check_target(manifest, reindented)
    check_target(manifest, reordered)


def test_changed_value_is_refused(tmp_path):
    built = _target(tmp_path, _hf_text(CONFIG), "built")
    manifest = _manifest(target_fingerprint(built))
    other = _target(tmp_path, _hf_text({**CONFIG, "hidden_size": 128}), "other")
    with pytest.raises(ManifestError, match="built for target 'built'.*pass the drafter built for 'other'"):
        check_target(manifest, other)


def test_old_manifest_with_byte_hash_reads_a_reindented_config(tmp_path):
    text = _hf_text(CONFIG)
    old = _manifest({"name": "t", "config_sha256": hashlib.sha256(text.encode()).hexdigest()})
    check_target(old, _target(tmp_path, text, "same-bytes"))
    check_target(old, _target(tmp_path, json.dumps(CONFIG, indent=1), "reindented"))
    with pytest.raises(ManifestError):
        check_target(old, _target(tmp_path, _hf_text({**CONFIG, "vocab_size": 321}), "changed"))


def test_unpinned_manifest_matches_anything(tmp_path):
    check_target(_manifest({}), _target(tmp_path, _hf_text(CONFIG)))


def test_unreadable_target_config_is_a_clear_error(tmp_path):
    built = _target(tmp_path, _hf_text(CONFIG), "built")
    manifest = _manifest(target_fingerprint(built))
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_bytes(b"{\xff")
    with pytest.raises(ManifestError, match="not valid JSON"):
        check_target(manifest, bad)
