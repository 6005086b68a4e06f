"""The shipped recovery drafter: present, loadable against the shipped first drafter, declared."""

from __future__ import annotations

import json

import torch

from sglang_adaflash import assets
from sglang_adaflash.d2sd.cli import RECOVERY_DIR
from sglang_adaflash.d2sd.recovery_drafter import RECOVERY_KEY, load_recovery_drafter
from sglang_adaflash.drafter.checkpoint import load_drafter
from sglang_adaflash.drafter.manifest import target_matches, verify_manifest_files


def test_shipped_recovery_drafter_fits_the_shipped_pair():
    assert RECOVERY_DIR.parent == assets.MODELS_DIR
    first = load_drafter(assets.DRAFTER_DIR, dtype=torch.float32)
    rec = load_recovery_drafter(RECOVERY_DIR, first)
    assert rec.config.raw["adaflash_config"][RECOVERY_KEY]["prefix"] == "variable"
    assert rec.length_head is None
    verify_manifest_files(RECOVERY_DIR)
    manifest = json.loads((RECOVERY_DIR / "manifest.json").read_text())
    assert target_matches(manifest["target"], assets.TARGET_DIR)
    # trained, not a copy of the first drafter
    assert not torch.equal(rec.layers[0].mlp.up_proj.weight, first.layers[0].mlp.up_proj.weight.to(rec.fc.weight.dtype))
    ev = manifest["eval"]
    assert ev["trained"]["continuation_accepted_mean"] > ev["init"]["continuation_accepted_mean"]


def test_shipped_shared_recovery_drafter_ties_to_the_shipped_first_drafter():
    """`--recovery-drafter embedded-shared`: trained with the first drafter's context modules
    frozen, so its stored copies of them are the first drafter's, and it loads tied."""
    from sglang_adaflash.d2sd.cli import RECOVERY_SHARED_DIR, _recovery_dir
    from sglang_adaflash.d2sd.shared_context import shared_modules, sharing
    from sglang_adaflash.drafter.checkpoint import read_config

    assert _recovery_dir("embedded-shared") == str(RECOVERY_SHARED_DIR)
    assert _recovery_dir("embedded") == str(RECOVERY_DIR) and _recovery_dir("x/y") == "x/y"
    verify_manifest_files(RECOVERY_SHARED_DIR)
    manifest = json.loads((RECOVERY_SHARED_DIR / "manifest.json").read_text())
    assert target_matches(manifest["target"], assets.TARGET_DIR)
    assert manifest["training"]["config"]["share"] == "context"
    first = load_drafter(assets.DRAFTER_DIR, dtype=torch.float32)
    stored = load_drafter(RECOVERY_SHARED_DIR, dtype=torch.float32)  # untied: the file as written
    for name in shared_modules(first.config, "context"):
        assert torch.equal(stored.get_submodule(name).weight, first.get_submodule(name).weight), name
    assert not torch.equal(stored.layers[0].mlp.up_proj.weight, first.layers[0].mlp.up_proj.weight)
    assert read_config(RECOVERY_SHARED_DIR).raw["adaflash_config"][RECOVERY_KEY]["shared"] == "context"
    assert sharing(first, load_recovery_drafter(RECOVERY_SHARED_DIR, first)) == "context"
    # trained for the slot-1 branch that --branch-drafter joint reads (its best few tokens other
    # than the chain's become the branches), and better there, in its best four, than its
    # initialisation (the first drafter) and than the first drafter's own next ranks
    assert read_config(RECOVERY_SHARED_DIR).raw["adaflash_config"][RECOVERY_KEY]["prefix_range"] == [0, 0]
    ev = manifest["eval"]
    at1, before = ev["trained"]["at_slot1_failure"], ev["init"]["at_slot1_failure"]
    # the held-out responses' slot-1 failures of the shipped first drafter: 77 with the current one
    # (a better first drafter fails at slot 1 less often: 84, 99 and 189 with the three before it).
    # On the current first drafter training adds at top-4 (0.883 -> 0.896) and costs at top-1
    # (0.649 -> 0.571; v4 on the drafter before had kept top-1 where it started): docs/d2sd.md,
    # "The recovery drafter"
    assert at1["anchors"] == before["anchors"] >= 70
    assert at1["recovery_top4"] > before["recovery_top4"] and at1["recovery_top4"] > at1["first_next_top4"]
