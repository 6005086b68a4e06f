"""The CPU-side parts of ``scripts/sglang_gpu_check.py``: backend choice, the embedded pair's
versions, prompts, the checks, and (with sglang) that SGLang accepts every server command."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from sglang_adaflash.assets import DRAFTER_DIR, TARGET_DIR
from sglang_adaflash.drafter.checkpoint import read_checkpoint
from sglang_adaflash.drafter.manifest import read_manifest, target_matches

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "sglang_gpu_check.py"


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("sglang_gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


def test_backend_follows_the_gpu(gpu_check):
    assert gpu_check.backend_for((9, 0)) == ("fa3", None)  # Hopper
    assert gpu_check.backend_for((8, 0)) == ("fa3", None)  # Ampere
    assert gpu_check.backend_for((10, 0)) == ("fa4", None)  # B200: trtllm_mha is not deterministic
    assert gpu_check.backend_for((12, 0)) == ("triton", None)  # the plugin's ragged Triton


def test_compaction_evidence_from_metrics(gpu_check):
    text = "\n".join([
        'adaflash_spec_draft_tokens_total{domain=""} 150.0',
        'adaflash_spec_verified_tokens_total{domain=""} 60.0',
        'adaflash_spec_verified_tokens_created{domain=""} 1.7e9',
    ])  # fmt: skip
    assert gpu_check.compaction_evidence("adaflash-compact", text)["ok"]
    assert not gpu_check.compaction_evidence("adaflash-fixed", text)["ok"]
    whole = text.replace("60.0", "150.0")  # a silent fallback to whole blocks
    assert not gpu_check.compaction_evidence("adaflash-compact", whole)["ok"]


def test_embedded_pair_is_adopted_and_the_reload_version_differs(gpu_check, tmp_path):
    target, source = gpu_check.embedded_pair()
    assert (target, source) == (TARGET_DIR, DRAFTER_DIR)
    home = tmp_path / "home"
    v1 = gpu_check.adopt_drafter(home, source, target)
    assert v1.name == "v000001" and target_matches(read_manifest(v1)["target"], target)
    v2 = gpu_check.publish_next(home, v1, seed=3)
    assert v2 == "v000002"
    manifest = read_manifest(home / "drafters" / v2)
    assert manifest["parent"] == "v000001" and target_matches(manifest["target"], target)
    a, b = read_checkpoint(v1)[1], read_checkpoint(home / "drafters" / v2)[1]
    assert a.keys() == b.keys() and all(a[k].dtype == b[k].dtype for k in a)
    assert not torch.equal(a["fc.weight"], b["fc.weight"])  # the reload really changes weights
    assert gpu_check.publish_next(home, v1, seed=3) == "v000003"
    c = read_checkpoint(home / "drafters" / "v000003")[1]
    assert all(torch.equal(b[k], c[k]) for k in b)  # a seed fixes the perturbation


def test_prompts_are_chat_formatted_token_ids(gpu_check):
    batch = gpu_check.prompts(TARGET_DIR, 7, max_len=64)
    vocab = json.loads((TARGET_DIR / "config.json").read_text())["vocab_size"]
    assert len(batch) == 7 and all(0 < len(p) <= 64 for p in batch)
    assert all(0 <= t < vocab for p in batch for t in p)
    assert len({tuple(p) for p in batch}) == 7
    assert all(p[-1] == batch[0][-1] for p in batch)  # every prompt ends with <|assistant|>


def test_checks_and_ratios(gpu_check):
    assert gpu_check.check_equal("x", [[1, 2]], [[1, 2]])["ok"]
    bad = gpu_check.check_equal("x", [[1, 2], [3]], [[1, 2], [4]])
    assert not bad["ok"] and bad["mismatching_requests"] == [1]

    def runs(*tps):
        return [{"concurrency": c, "tokens_per_s": t} for c, t in zip((1, 32, 64), tps)]

    rows = gpu_check.ratio_table(
        {"dflash": runs(100, 200, 400), "adaflash-compact": runs(110, 260, 600), "plain": runs(1, 1, 1)}
    )
    assert [(r["adaflash"], r["vs"], r["concurrency"], r["ratio"]) for r in rows] == [
        ("adaflash-compact", "dflash", 1, 1.1),
        ("adaflash-compact", "dflash", 32, 1.3),
        ("adaflash-compact", "dflash", 64, 1.5),
    ]


@pytest.mark.sglang
def test_sglang_accepts_every_server_command(gpu_check):
    """A flag SGLang 0.5.23 does not know would only surface on the GPU machine."""
    pytest.importorskip("sglang")
    from sglang.srt.server_args import prepare_server_args

    from sglang_adaflash.sglang_plugin import register

    register()
    configs = gpu_check.server_configs(
        TARGET_DIR, DRAFTER_DIR, "fa3", gpu_check.ADAFLASH_MODES, "0.5", dspark_draft="/dspark"
    )
    assert [name for name, _, _ in configs] == [
        "plain", "dflash", "adaflash-compact", "adaflash-cap", "adaflash-fixed", "dspark"
    ]  # fmt: skip
    for _, args, _ in configs:
        parsed = prepare_server_args(
            [*args, "--enable-deterministic-inference", "--skip-tokenizer-init", "--enable-metrics"]
        )
        assert parsed.enable_deterministic_inference and parsed.max_running_requests == 64
