"""`adaflash generate` end to end on a tiny random pair (float64, so T=0 outputs compare exactly)."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from sglang_adaflash.cli.main import main
from sglang_adaflash.launch.prompts import CLIError, read_prompts

from .conftest import write_jsonl

RECORD_KEYS = {"id", "index", "domain", "prompt_tokens", "output_ids", "text", "accept_lens", "verify_lens", "tau", "steps",
               "finish_reason", "error"}


def _run(capsys, *argv):
    rc = main(["generate", *map(str, argv)])
    out, err = capsys.readouterr()
    return rc, [json.loads(line) for line in out.splitlines() if line.startswith("{")], out, err


def _pair_args(pair, mode="adaflash"):
    return ["--target", pair.target_dir, "--drafter", pair.drafter_dir, "--mode", mode]


def test_text_prompt_json_fields(tiny_pair, capsys):
    rc, recs, _, _ = _run(capsys, *_pair_args(tiny_pair), "--prompt", "hello world", "--max-new-tokens", 9,
                          "--ignore-eos", "--json")
    assert rc == 0
    (rec,) = recs
    assert set(rec) == RECORD_KEYS
    assert rec["error"] is None and rec["finish_reason"] == "length"
    assert len(rec["output_ids"]) == 9
    # the first token comes from prefill; every decode step commits tau tokens
    assert sum(rec["accept_lens"]) == 8 and rec["steps"] == len(rec["accept_lens"])
    assert rec["tau"] == pytest.approx(8 / rec["steps"])
    assert all(1 <= v <= 4 for v in rec["verify_lens"])
    tok = AutoTokenizer.from_pretrained(str(tiny_pair.target_dir))
    assert rec["text"] == tok.decode(rec["output_ids"], skip_special_tokens=True)


def test_chat_template_is_applied_unless_disabled(tiny_pair, capsys):
    tok = AutoTokenizer.from_pretrained(str(tiny_pair.target_dir))
    chat = tok.apply_chat_template([{"role": "user", "content": "abc"}], add_generation_prompt=True, tokenize=True)
    chat_ids = chat["input_ids"] if hasattr(chat, "keys") else chat
    _, (rec,), _, _ = _run(capsys, *_pair_args(tiny_pair, "ar"), "--prompt", "abc", "--max-new-tokens", 2, "--json")
    assert rec["prompt_tokens"] == len(chat_ids) == len("abc") + 4  # <|bos|><|user|>abc<|end|><|assistant|>
    _, (raw,), _, _ = _run(capsys, *_pair_args(tiny_pair, "ar"), "--prompt", "abc", "--max-new-tokens", 2, "--json",
                           "--no-chat-template")
    assert raw["prompt_tokens"] == 3


def test_jsonl_bad_lines_fail_alone(tiny_pair, tmp_path, capsys):
    path = write_jsonl(tmp_path / "p.jsonl", [
        {"id": "good-text", "prompt": "two plus two", "domain": "math", "max_new_tokens": 5},
        {"id": "good-ids", "prompt_ids": [1, 4, 70, 71, 6, 5]},
        "{not json",
        {"id": "oov", "prompt_ids": [1, 100000]},
        {"id": "both", "prompt": "x", "prompt_ids": [1]},
        "",
        {"id": "neg", "prompt": "x", "max_new_tokens": -3},
    ])
    rc, recs, _, err = _run(capsys, *_pair_args(tiny_pair), "--prompts", path, "--max-new-tokens", 7,
                            "--ignore-eos", "--json")
    assert rc == 1 and "4 of 6 request(s) failed" in err
    by_id = {r["id"]: r for r in recs}
    # finish order: lines refused before decoding first, then as requests finish; index = prompt position
    assert [r["id"] for r in recs[:3]] == ["3", "both", "neg"]
    recs.sort(key=lambda r: r["index"])
    assert [r["index"] for r in recs] == list(range(6))
    assert [r["id"] for r in recs] == ["good-text", "good-ids", "3", "oov", "both", "neg"]
    assert len(by_id["good-text"]["output_ids"]) == 5 and by_id["good-text"]["domain"] == "math"
    assert len(by_id["good-ids"]["output_ids"]) == 7
    assert by_id["3"]["error"].startswith(f"{path}:3: invalid JSON")
    assert by_id["oov"]["error"].startswith(f"{path}:4:") and "outside the vocabulary" in by_id["oov"]["error"]
    assert "exactly one of 'prompt'" in by_id["both"]["error"] and f"{path}:5" in by_id["both"]["error"]
    assert f"{path}:7" in by_id["neg"]["error"]
    for r in recs[2:]:
        assert r["finish_reason"] == "error" and r["output_ids"] == []


def test_modes_agree_at_temperature_zero(tiny_pair, tmp_path, capsys):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"prompt number {i} " * (i + 1)} for i in range(5)])
    outs = {}
    for mode in ("ar", "dflash", "adaflash"):
        rc, recs, _, _ = _run(capsys, *_pair_args(tiny_pair, mode), "--prompts", path, "--max-new-tokens", 13,
                              "--max-batch-size", 2, "--ignore-eos", "--json")
        assert rc == 0
        outs[mode] = [r["output_ids"] for r in sorted(recs, key=lambda r: r["index"])]
    assert all(len(o) == 13 for o in outs["ar"])
    assert outs["dflash"] == outs["ar"] and outs["adaflash"] == outs["ar"]


def test_sampling_is_seeded(tiny_pair, capsys):
    args = [*_pair_args(tiny_pair), "--prompt", "seeded", "--temperature", "1.0", "--top-k", "50", "--top-p", "0.9",
            "--max-new-tokens", 12, "--ignore-eos", "--json"]
    a = _run(capsys, *args, "--seed", 3)[1][0]["output_ids"]
    b = _run(capsys, *args, "--seed", 3)[1][0]["output_ids"]
    c = _run(capsys, *args, "--seed", 4)[1][0]["output_ids"]
    assert a == b and len(a) == 12
    assert a != c


def test_human_output(tiny_pair, capsys):
    rc, _, out, _ = _run(capsys, *_pair_args(tiny_pair, "dflash"), "--prompt", "hi", "--max-new-tokens", 3, "--ignore-eos")
    assert rc == 0 and out.startswith("=== 0  3 tokens")


@pytest.mark.parametrize(
    "drafter, message",
    [
        ("missing", "does not exist: pass a DFlash checkpoint directory"),
        ("target", "has no num_target_layers (top level or in dflash_config)"),
        ("other", "hidden size 48 does not match the target's 32"),
    ],
)
def test_bad_drafter_exits_2_with_one_line(tiny_pair, other_pair, tmp_path, capsys, drafter, message):
    path = {"missing": tmp_path / "nope", "target": tiny_pair.target_dir, "other": other_pair.drafter_dir}[drafter]
    rc = main(["generate", "--target", str(tiny_pair.target_dir), "--drafter", str(path), "--prompt", "x"])
    out, err = capsys.readouterr()
    assert rc == 2 and out == ""
    assert err.startswith("adaflash generate: error: ") and message in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_bad_target_and_prompt_file_exit_2(tiny_pair, tmp_path, capsys):
    assert main(["generate", "--target", str(tmp_path), "--drafter", str(tiny_pair.drafter_dir), "--prompt", "x"]) == 2
    assert "config.json is missing" in capsys.readouterr().err
    rc = main(["generate", *map(str, _pair_args(tiny_pair)), "--prompts", str(tmp_path / "none.jsonl")])
    assert rc == 2 and "does not exist" in capsys.readouterr().err


@pytest.mark.parametrize("flag, value, message", [
    ("--temperature", "-1", "--temperature must be a finite number >= 0"),
    ("--top-p", "0", "--top-p must lie in (0, 1]"),
    ("--top-k", "-2", "--top-k must be an integer >= 0"),
])
def test_bad_sampling_flags_exit_2_before_loading(tmp_path, capsys, flag, value, message):
    rc = main(["generate", "--target", str(tmp_path / "none"), "--prompt", "x", flag, value])
    err = capsys.readouterr().err
    assert rc == 2 and message in err and "Traceback" not in err


def test_adaflash_needs_a_length_head(tmp_path, capsys):
    from sglang_adaflash.testing import build_tiny_pair

    from .conftest import TINY

    pair = build_tiny_pair(tmp_path / "nohead", **{**TINY, "length_head": False})
    rc = main(["generate", *map(str, _pair_args(pair)), "--prompt", "x"])
    assert rc == 2 and "use mode 'dflash'" in capsys.readouterr().err
    assert main(["generate", *map(str, _pair_args(pair, "dflash")), "--prompt", "x", "--max-new-tokens", "2"]) == 0


def test_read_prompts_errors(tmp_path):
    with pytest.raises(CLIError, match="does not exist"):
        read_prompts(tmp_path / "missing.jsonl")
    empty = write_jsonl(tmp_path / "e.jsonl", ["", "  "])
    with pytest.raises(CLIError, match="no prompts"):
        read_prompts(empty)
    (spec,) = read_prompts(write_jsonl(tmp_path / "a.jsonl", ['[1, 2]']))
    assert "expected a JSON object" in spec.error and spec.error.startswith(f"{tmp_path / 'a.jsonl'}:1")
