"""`adaflash drafters import DIR --target T`: a published DFlash checkpoint becomes a volume's
first version, fingerprinted for its target, with a length head that hot reload keeps."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from sglang_adaflash.drafter.checkpoint import load_drafter, read_checkpoint
from sglang_adaflash.drafter.importing import NEUTRAL_RATIO
from sglang_adaflash.drafter.manifest import target_fingerprint
from sglang_adaflash.drafter.store import latest_version, list_versions, verify_version
from sglang_adaflash.testing.tiny_pair import build_tiny_pair

from .test_store_cli import run


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """A tiny pair whose drafter is plain DFlash (no length head), as published upstream."""
    return build_tiny_pair(tmp_path_factory.mktemp("plain") / "p", seed=3, length_head=False)


def test_import_publishes_the_first_version_with_a_neutral_length_head(plain, tmp_path, capsys):
    home = tmp_path / "home"
    assert run("import", str(plain.drafter_dir), "--target", str(plain.target_dir),
               "--home", str(home)) == 0
    assert capsys.readouterr().out.strip() == "v000001"
    assert list_versions(home) == ["v000001"] and latest_version(home) == "v000001"
    manifest = verify_version(home, "v000001")  # hashes checked
    assert manifest["parent"] is None
    fp = target_fingerprint(plain.target_dir)
    assert manifest["target"]["config_digest"] == fp["config_digest"]
    assert manifest["training"]["algorithm"] == "import"
    assert manifest["training"]["length_head"]["mode"] == "neutral"
    drafter = load_drafter(home / "drafters" / "v000001", dtype=torch.float32)
    assert drafter.length_head is not None and drafter.config.use_length_head
    ratio = drafter.length_head(torch.randn(5, drafter.config.block_size,
                                            drafter.config.hidden_size))
    assert torch.allclose(ratio, torch.full((5,), NEUTRAL_RATIO), atol=1e-6)
    # the drafter's own weights are the checkpoint's, untouched
    _, src = read_checkpoint(plain.drafter_dir)
    _, got = read_checkpoint(home / "drafters" / "v000001")
    assert all(torch.equal(src[k], got[k]) for k in src)
    config = json.loads((home / "drafters" / "v000001" / "config.json").read_text())
    assert config["dflash_config"]["use_thresh_head_two_model"] is True


def test_import_keeps_a_head_the_checkpoint_has(tmp_path, capsys):
    pair = build_tiny_pair(tmp_path / "p", seed=4)  # an AdaFlash drafter: it has a head
    home = tmp_path / "home"
    assert run("import", str(pair.drafter_dir), "--target", str(pair.target_dir),
               "--home", str(home)) == 0
    _, src = read_checkpoint(pair.drafter_dir)
    _, got = read_checkpoint(home / "drafters" / "v000001")
    assert src.keys() == got.keys() and all(torch.equal(src[k], got[k]) for k in src)
    assert verify_version(home, "v000001")["training"]["length_head"]["mode"] == "kept"


def test_import_refuses_a_volume_with_versions_and_another_targets_drafter(plain, tmp_path,
                                                                          capsys):
    home = tmp_path / "home"
    assert run("import", str(plain.drafter_dir), "--target", str(plain.target_dir),
               "--home", str(home)) == 0
    capsys.readouterr()
    assert run("import", str(plain.drafter_dir), "--target", str(plain.target_dir),
               "--home", str(home)) == 2
    assert "already holds v000001" in capsys.readouterr().out
    other = build_tiny_pair(tmp_path / "other", seed=5, hidden_size=32, head_dim=8)
    assert run("import", str(plain.drafter_dir), "--target", str(other.target_dir),
               "--home", str(tmp_path / "h2")) == 2
    assert "does not fit target" in capsys.readouterr().out
    assert not (tmp_path / "h2" / "drafters" / "v000001").exists()
    broken = tmp_path / "broken"
    shutil.copytree(plain.drafter_dir, broken)
    (broken / "model.safetensors").write_bytes(b"not weights")
    assert run("import", str(broken), "--target", str(plain.target_dir),
               "--home", str(tmp_path / "h3")) == 2
