from __future__ import annotations

import pytest

from sglang_adaflash.assets import chat_format as cf
from training_job.tokenizer import load_tokenizer, save_tokenizer, train_tokenizer

TEXTS = [
    cf.render_example("def add(a, b):\n    \"\"\"Add.\"\"\"\n", "    return a + b\n"),
    cf.render_example("Ava has 3 apples and buys 4 more.", "Step 1: 3 + 4 = 7.\nThe answer is 7."),
    cf.render_example("Genesis 1\n1 In the beginning", "2 And the earth was without form"),
] * 20


@pytest.fixture(scope="module")
def hf_tok(tmp_path_factory):
    tok = train_tokenizer(TEXTS, vocab_size=400)
    out = tmp_path_factory.mktemp("tok")
    save_tokenizer(tok, out, model_max_length=128)
    return load_tokenizer(out)


@pytest.mark.parametrize("text", [
    "plain words", "    indented = {'a': [1, 2]}\n\ttab", "naïve café ∑ 数学 🙂", "", "12345 + 678",
])
def test_round_trip(hf_tok, text):
    ids = hf_tok(text, add_special_tokens=False)["input_ids"]
    assert hf_tok.decode(ids) == text


def test_special_tokens_are_single_reserved_ids(hf_tok):
    for i, t in enumerate(cf.SPECIAL_TOKENS):
        assert hf_tok(t, add_special_tokens=False)["input_ids"] == [i]
    assert hf_tok.mask_token_id == cf.SPECIAL_TOKENS.index(cf.MASK) < len(hf_tok)
    assert hf_tok.bos_token_id == 1 and hf_tok.eos_token_id == 2 and hf_tok.pad_token_id == 0


def test_no_implicit_special_tokens_and_digits_split(hf_tok):
    ids = hf_tok("x 907", add_special_tokens=True)["input_ids"]
    assert all(i >= len(cf.SPECIAL_TOKENS) for i in ids)
    assert [hf_tok.decode([i]) for i in ids[-3:]] == ["9", "0", "7"]


def test_chat_template_matches_render_prompt(hf_tok):
    msgs = [{"role": "user", "content": "Hi there"}]
    text = hf_tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert text == cf.render_prompt("Hi there")
    assert cf.strip_response("answer<|end|>junk") == "answer"
