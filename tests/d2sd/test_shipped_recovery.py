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
