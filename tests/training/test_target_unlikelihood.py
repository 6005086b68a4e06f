"""The loop fine-tune: its penalty mask, its loss, and a resumed run equal to an unbroken one."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
import torch

from training_job.target_unlikelihood import repeat_mask, unlikelihood_loss


def test_repeat_mask_flags_every_token_of_each_repeating_ngram():
    a, b, c, d, e = 1, 2, 3, 4, 5
    assert repeat_mask([a, b, c, d, e]) == [False] * 5
    assert repeat_mask([a, b, c, d, a, b, c, d, e]) == [False] * 4 + [True] * 4 + [False]
    # an n-gram overlapping its earlier copy repeats too: a a a a a has (a a a a) twice
    assert repeat_mask([a] * 5) == [False, True, True, True, True]
    # a shared 3-gram is not a repeated 4-gram
    assert repeat_mask([a, b, c, d, e, a, b, c, e]) == [False] * 9
    assert repeat_mask([a, b, a, b, a], n=2) == [False, False, True, True, True]
    assert repeat_mask([a, b]) == [False, False]


def test_unlikelihood_loss_against_a_hand_computed_case():
    logits = torch.tensor([[[0.0, 0.0, 0.0], [math.log(3.0), 0.0, 0.0], [0.0, 0.0, 0.0]]])
    ids = torch.tensor([[2, 0, 1]])
    # position 1 (token 0) is predicted by logits[0]: p = 1/3; position 2 (token 1) by
    # logits[1]: p = 1/5. Only position 2 is flagged; the flag at position 0 is ignored.
    flags = torch.tensor([[True, False, True]])
    loss = unlikelihood_loss(logits, ids, flags, denom=4)
    assert loss.item() == pytest.approx(-math.log(1 - 1 / 5) / 4, rel=1e-6)
    assert unlikelihood_loss(logits, ids, torch.zeros_like(flags), denom=4).item() == 0.0


def test_unlikelihood_gradient_pushes_the_flagged_token_down():
    torch.manual_seed(0)
    logits = torch.randn(1, 4, 6, requires_grad=True)
    ids = torch.tensor([[0, 3, 3, 5]])
    flags = torch.tensor([[False, False, True, False]])
    unlikelihood_loss(logits, ids, flags, denom=3).backward()
    g = logits.grad[0, 1]  # logits that predict position 2 (token 3)
    assert g[3] > 0  # gradient descent lowers the flagged token's logit ...
    assert (g[[0, 1, 2, 4, 5]] < 0).all()  # ... and raises every other one
    assert logits.grad[0, [0, 2, 3]].abs().max() == 0  # unflagged positions get no gradient


def test_a_near_certain_loop_gives_a_finite_loss():
    logits = torch.tensor([[[0.0, 80.0], [0.0, 80.0]]])
    loss = unlikelihood_loss(logits, torch.tensor([[1, 1]]), torch.tensor([[False, True]]), 1)
    assert math.isfinite(loss.item()) and loss.item() > 10


def _toy_base(tmp_path):
    """A toy target trained for a few steps on arithmetic records, as an HF directory."""
    from transformers import AutoTokenizer

    from sglang_adaflash.assets import chat_format as cf
    from training_job.target_lm import TargetConfig, train_target
    from training_job.tokenizer import save_tokenizer, train_tokenizer

    recs = [{"prompt": f"Ava has {i} apples. Ava has {i} apples.",
             "response": f"Step 1: {i} + 1 = {i + 1}. Step 1: {i} + 1 = {i + 1}."}
            for i in range(60)]
    tok = train_tokenizer((cf.render_example(r["prompt"], r["response"]) for r in recs),
                          vocab_size=320)
    save_tokenizer(tok, tmp_path / "tok", 64)
    hf = AutoTokenizer.from_pretrained(str(tmp_path / "tok"))
    cfg = replace(TargetConfig.toy(), vocab_size=len(hf), max_steps=6, amp_bf16=False)
    heldout = {"math": recs[:2]}
    train_target(cfg, hf, recs, heldout, tmp_path / "w", tmp_path / "base", progress=False)
    return tmp_path / "base", recs, heldout


def test_a_resumed_finetune_equals_an_unbroken_one(tmp_path):
    from transformers import AutoModelForCausalLM

    from training_job.target_unlikelihood import UnlikelihoodConfig, finetune

    base, recs, heldout = _toy_base(tmp_path)
    cfg = replace(UnlikelihoodConfig.toy(), steps=4, ckpt_every=2, eval_every=100)
    finetune(cfg, base, recs, heldout, tmp_path / "one", tmp_path / "t_one", progress=False)
    finetune(replace(cfg, steps=2), base, recs, heldout, tmp_path / "two", tmp_path / "t_half",
             progress=False)
    report = finetune(cfg, base, recs, heldout, tmp_path / "two", tmp_path / "t_two",
                      progress=False)
    log = [json.loads(x) for x in (tmp_path / "two" / "train_log.jsonl").open()]
    assert [r["step"] for r in log if r["event"] == "start"] == [0, 2]
    unbroken = [json.loads(x) for x in (tmp_path / "one" / "train_log.jsonl").open()]
    steps = lambda rows: [(r["step"], r["mle"], r["ul"]) for r in rows if r["event"] == "step"]  # noqa: E731
    assert steps(log) == steps(unbroken)
    a = AutoModelForCausalLM.from_pretrained(str(tmp_path / "t_one")).state_dict()
    b = AutoModelForCausalLM.from_pretrained(str(tmp_path / "t_two")).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    base_w = AutoModelForCausalLM.from_pretrained(str(base)).state_dict()
    assert not all(torch.equal(a[k], base_w[k]) for k in a)  # it trained
    assert report["unlikelihood"]["steps"] == 4
    assert report["unlikelihood"]["base_heldout"] is not None
    assert set(report["heldout"]) == {"math"}
