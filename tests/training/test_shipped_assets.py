"""The shipped embedded pair and held-out workloads: present, small, loadable, well formed."""

from __future__ import annotations

import json

import torch

from sglang_adaflash import assets
from sglang_adaflash.assets import chat_format as cf
from training_job.data.common import read_jsonl

MAX_SHIPPED_BYTES = 40 * 1024 * 1024

# No skips when a file is missing: the pair ships with the package, so its absence is a defect
# (tests/test_packaging.py checks that the wheel and the sdist carry it too).


def test_every_shipped_file_is_present():
    for path in (assets.TARGET_DIR / "config.json", assets.TARGET_DIR / "model.safetensors",
                 assets.TARGET_DIR / "tokenizer.json", assets.DRAFTER_DIR / "config.json",
                 assets.DRAFTER_DIR / "model.safetensors", assets.DRAFTER_DIR / "manifest.json"):
        assert path.is_file(), f"{path} is missing: run `make models` or restore it from git"
    for domain in assets.DOMAINS:
        assert assets.workload_path(domain).is_file()


def test_shipped_set_fits_the_budget():
    total = sum(p.stat().st_size for p in assets.ASSETS_DIR.rglob("*") if p.is_file())
    assert total <= MAX_SHIPPED_BYTES, f"shipped assets are {total / 2**20:.1f} MiB"


def test_heldout_workloads_are_well_formed():
    for domain in assets.DOMAINS:
        recs = list(read_jsonl(assets.workload_path(domain)))
        assert len(recs) >= 100, domain
        assert all(r["domain"] == domain and r["prompt"] and r["id"] for r in recs)
        assert len({r["id"] for r in recs}) == len(recs)
        if domain == "math":
            assert all(r["answer"].lstrip("-").isdigit() for r in recs)


def test_target_loads_and_decodes_greedily():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(assets.TARGET_DIR))
    model = AutoModelForCausalLM.from_pretrained(str(assets.TARGET_DIR), dtype=torch.float32)
    assert model.config.model_type == "qwen3" and model.config.tie_word_embeddings
    assert len(tok) == model.config.vocab_size
    assert tok.convert_tokens_to_ids(list(cf.SPECIAL_TOKENS)) == list(range(8))
    assert tok.mask_token_id < model.config.vocab_size
    prompt = cf.render_prompt("Ava has 3 apples and buys 4 more. How many apples does Ava have?")
    ids = tok(prompt, add_special_tokens=False, return_tensors="pt")
    out1 = model.generate(**ids, max_new_tokens=12, do_sample=False)
    out2 = model.generate(**ids, max_new_tokens=12, do_sample=False)
    assert torch.equal(out1, out2)
    assert tok.decode(out1[0, ids["input_ids"].shape[1]:]).startswith("Step 1:")
    report = json.loads((assets.TARGET_DIR / "training_report.json").read_text())
    assert set(report["heldout"]) == set(assets.DOMAINS)


def test_drafter_matches_the_shipped_target():
    from sglang_adaflash.drafter.checkpoint import load_drafter
    from sglang_adaflash.drafter.manifest import check_target, read_manifest

    drafter = load_drafter(assets.DRAFTER_DIR)  # verifies the file hashes
    check_target(read_manifest(assets.DRAFTER_DIR), assets.TARGET_DIR)
    cfg = json.loads((assets.TARGET_DIR / "config.json").read_text())
    assert drafter.config.hidden_size == cfg["hidden_size"]
    assert drafter.config.vocab_size == cfg["vocab_size"]
    assert drafter.config.mask_token_id == cf.SPECIAL_TOKENS.index(cf.MASK)
    assert drafter.config.num_hidden_layers < cfg["num_hidden_layers"]
