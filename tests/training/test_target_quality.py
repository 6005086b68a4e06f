"""training_job.target_quality: the repeated-4-gram share by hand, and the command on a tiny model."""

from __future__ import annotations

import json

import pytest

from training_job import target_quality as tq


def test_repeated_4gram_share_by_hand():
    # 4-grams of "a b c d a b c d": abcd bcda cdab dabc abcd; only the last repeats.
    assert tq.repeated_ngrams("a b c d a b c d".split()) == (1, 5)
    assert tq.repeated_ngram_share(["a b c d a b c d".split()]) == pytest.approx(0.2)
    # A loop of period 1: aaaa three times, the second and third repeat the first.
    assert tq.repeated_ngrams(list("aaaaaa")) == (2, 3)
    # Fresh text, and outputs too short to have a 4-gram.
    assert tq.repeated_ngrams(list("abcdefg")) == (0, 4)
    assert tq.repeated_ngrams(list("abc")) == (0, 0)
    assert tq.repeated_ngram_share([list("abc"), []]) is None
    # Over outputs: the mean of 0.2 and 0 (the 3-token output has no 4-gram and is left out), or
    # pooled, (1 + 0) repeats over (5 + 1) 4-grams; a 4-gram of one output is no repeat in another.
    outs = ["a b c d a b c d".split(), list("abcd"), list("xyz")]
    assert tq.repeated_ngram_share(outs) == pytest.approx(0.1)
    assert tq.repeated_ngram_share(outs, how="pooled") == pytest.approx(1 / 6)
    assert tq.repeated_ngram_share([list("aaaaaa"), list("abcdefg")]) == pytest.approx(1 / 3)
    with pytest.raises(ValueError):
        tq.repeated_ngram_share(outs, how="median")
    # Token ids work the same as strings.
    assert tq.repeated_ngrams([5, 6, 7, 8, 5, 6, 7, 8, 5]) == (2, 6)


def test_answer_accuracy_and_stop_cut():
    texts = ["Step 1: 2 + 3 = 5.\nThe answer is 5.", "The answer is 4.", "Step 1: 7 * 3 ="]
    acc = tq.answer_accuracy(texts, [5, 5, 21])
    assert acc == {"correct": 1, "total": 3, "no_answer": 1, "accuracy": pytest.approx(1 / 3)}
    assert tq.cut_at_stop([9, 10, 6, 11], (6, 2)) == ([9, 10], True)
    assert tq.cut_at_stop([9, 10], (6, 2)) == ([9, 10], False)


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    from sglang_adaflash.testing import build_tiny_pair

    pair = build_tiny_pair(tmp_path_factory.mktemp("pair") / "p", seed=0, target_layers=2,
                           hidden_size=32, intermediate_size=64, num_attention_heads=2,
                           num_key_value_heads=1, head_dim=16, block_size=4,
                           length_head_bottleneck_dim=16)
    return pair.target_dir


@pytest.fixture
def workloads(tmp_path):
    recs = {
        "code": [{"prompt": f"def f{i}(x):\n    \"\"\"Return x plus {i}.\"\"\"\n",
                  "response": f"    return x + {i}\n"} for i in range(5)],
        "math": [{"prompt": f"Ava has {i} apples and buys 2 more. How many now?",
                  "response": f"Step 1: {i} + 2 = {i + 2}.\nThe answer is {i + 2}.",
                  "answer": str(i + 2)} for i in range(5)],
        "prose": [{"prompt": f"Genesis {i}\n1 In the beginning.\n",
                   "response": "2 And the earth was without form.\n"} for i in range(1, 6)],
    }
    for d, rs in recs.items():
        with open(tmp_path / f"{d}.heldout.jsonl", "w") as f:
            for j, r in enumerate(rs):
                f.write(json.dumps({"id": f"{d}/{j}", "domain": d, **r}) + "\n")
    return tmp_path


def test_command_on_a_tiny_model(tiny_target, workloads, tmp_path, capsys):
    out = tmp_path / "q.json"
    args = ["--target", str(tiny_target), "--workloads", str(workloads), "--prompts", "4",
            "--max-new-tokens", "12", "--answer-max-new-tokens", "16", "--batch-size", "3",
            "--threads", "1", "--quiet", "--out", str(out)]
    assert tq.main(args) == 0
    table = capsys.readouterr().out
    assert "rep4 T=0" in table and "prose" in table
    rep = json.loads(out.read_text())
    assert rep["format"] == tq.FORMAT and set(rep["domains"]) == {"code", "math", "prose"}
    assert not rep["target"].startswith("/") and not rep["workloads"].startswith("/")
    for e in rep["domains"].values():
        assert e["ppl"] > 1 and e["ppl_records"] == 5 and e["prompts"] == 4
        for kind in ("greedy", "sampled"):
            g = e[kind]
            assert g["mean_tokens"] <= 12
            for k in ("rep4_share", "rep4_pooled"):
                assert g[k] is None or 0.0 <= g[k] <= 1.0
            assert g["repeated_4grams"] <= g["4grams"]
    assert rep["domains"]["math"]["math_answers"]["total"] == 4
    assert "math_answers" not in rep["domains"]["code"]
    # Seeded samples: a second run gives the same report (bar the wall clock).
    assert tq.main(args + ["--json"]) == 0
    again = json.loads(capsys.readouterr().out)
    assert again["domains"] == rep["domains"]


def test_batched_greedy_equals_one_at_a_time(tiny_target):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_target))
    model = AutoModelForCausalLM.from_pretrained(str(tiny_target), dtype=torch.float32).eval()
    prompts = ["def f(x):", "Genesis 1\n1 In the beginning", "Ava has 3 apples.", "x"]
    batched = tq.generate(model, tok, prompts, 10, batch_size=4)
    single = tq.generate(model, tok, prompts, 10, batch_size=1)
    assert batched == single
    assert all(len(t) <= 10 for t, _ in batched)
