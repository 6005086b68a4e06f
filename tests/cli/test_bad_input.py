"""Bad input gets a clear error and costs only itself: one bad line fails alone, bad flags exit 2."""

from __future__ import annotations

import json
import os

import pytest

from sglang_adaflash.cli import generate as generate_mod
from sglang_adaflash.cli.main import main
from sglang_adaflash.launch import engine_factory
from sglang_adaflash.launch.loading import load_tokenizer
from sglang_adaflash.launch.prompts import PromptSpec, read_prompts, resolve_prompt_ids

GOOD_A = b'{"id": "a", "prompt": "first question"}'
GOOD_B = b'{"id": "b", "prompt_ids": [1, 4, 70, 71, 6, 5]}'


def _generate(capsys, pair, *argv):
    rc = main(["generate", "--target", str(pair.target_dir), "--drafter", str(pair.drafter_dir), "--mode", "dflash",
               "--max-new-tokens", "4", "--ignore-eos", "--json", "--quiet", *map(str, argv)])
    out, err = capsys.readouterr()
    return rc, [json.loads(line) for line in out.splitlines()], err


@pytest.mark.parametrize("bad, record_id, message", [
    (b'{"id": "s", "prompt": "broken \\ud800 text"}', "s",
     "'prompt' is not valid Unicode text (lone surrogate \\ud800 at character 8)"),
    # a refused id is not echoed: the record keeps the line's default id (its line number)
    (b'{"id": "\\udfff", "prompt": "fine text"}', "2", "'id' is not valid Unicode text (lone surrogate \\udfff at character 1)"),
    (b'{"id": "d", "domain": "\\ud800", "prompt": "fine text"}', "d", "'domain' is not valid Unicode text"),
    (b'{"id": "x", "prompt": "caf\xff"}', "2", "not valid UTF-8 (byte 0xff at byte 27 of the line)"),
    (b'{"id": "e", "prompt": ""}', "e", "'prompt' is empty"),
    (b'{"id": "e", "prompt_ids": []}', "e", "'prompt_ids' is empty"),
])
def test_a_bad_line_fails_alone(tiny_pair, tmp_path, capsys, bad, record_id, message):
    path = tmp_path / "p.jsonl"
    path.write_bytes(b"\n".join([GOOD_A, bad, GOOD_B]) + b"\n")
    rc, recs, err = _generate(capsys, tiny_pair, "--prompts", path)
    assert rc == 1 and "1 of 3 request(s) failed" in err and "Traceback" not in err
    by_index = {r["index"]: r for r in recs}
    assert sorted(by_index) == [0, 1, 2]
    assert [by_index[i]["id"] for i in (0, 2)] == ["a", "b"]
    assert all(by_index[i]["error"] is None and len(by_index[i]["output_ids"]) == 4 for i in (0, 2))
    failed = by_index[1]
    assert failed["finish_reason"] == "error" and failed["output_ids"] == []
    assert failed["error"].startswith(f"{path}:2: {message}")
    assert failed["id"] == record_id


def test_line_separators_inside_strings_do_not_split_lines(tmp_path):
    """U+2028 and U+0085 are legal raw inside JSON strings; only \\n, \\r\\n and \\r end a line."""
    path = tmp_path / "p.jsonl"
    path.write_bytes('{"prompt": "one\u2028two\u0085three"}\r\n{"prompt": "four"}\n'.encode("utf-8"))
    specs = read_prompts(path)
    assert [(s.text, s.where, s.error) for s in specs] == [
        ("one\u2028two\u0085three", f"{path}:1", None), ("four", f"{path}:2", None)]


def test_a_byte_order_mark_is_not_an_error(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"prompt": "bom"}\n')
    (spec,) = read_prompts(path)
    assert spec.error is None and spec.text == "bom"


def test_an_empty_text_prompt_is_refused_even_with_a_chat_template(tiny_pair):
    tok = load_tokenizer(tiny_pair.target_dir)
    assert tok.chat_template  # the template alone would give a non-empty prompt
    with pytest.raises(ValueError, match="prompt is empty"):
        resolve_prompt_ids(PromptSpec(id="0", text="", where="w:1"), tok, use_chat_template=True)


@pytest.mark.parametrize("text, message", [
    (os.fsdecode(b"caf\xff"), "--prompt is not valid UTF-8 text (byte 0xff at character 4)"),
    ("\ud800", "--prompt is not valid UTF-8 text (lone surrogate \\ud800 at character 1)"),
    ("", "--prompt is empty"),
])
def test_bad_prompt_argument_exits_2(tiny_pair, capsys, text, message):
    rc, recs, err = _generate(capsys, tiny_pair, "--prompt", text)
    assert rc == 2 and recs == []
    assert err.startswith("adaflash generate: error: ") and message in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


@pytest.mark.parametrize("flag, value, message", [
    ("--temperature", "nan", "--temperature must be a finite number >= 0"),
    ("--temperature", "inf", "--temperature must be a finite number >= 0"),
    ("--temperature", "-0.5", "--temperature must be a finite number >= 0"),
    ("--top-p", "nan", "--top-p must lie in (0, 1]"),
    ("--top-p", "inf", "--top-p must lie in (0, 1]"),
    ("--top-p", "-0.1", "--top-p must lie in (0, 1]"),
    ("--max-new-tokens", "0", "--max-new-tokens must be >= 1"),
    ("--max-new-tokens", "-5", "--max-new-tokens must be >= 1"),
    ("--max-batch-size", "0", "--max-batch-size must be in 1..4096, got 0"),
    ("--seed", str(10**20), "--seed must be an integer in [0, 2**64)"),
])
def test_bad_flags_exit_2_before_loading(tmp_path, capsys, flag, value, message):
    rc = main(["generate", "--target", str(tmp_path / "none"), "--prompt", "x", "--temperature", "1", flag, value])
    err = capsys.readouterr().err
    assert rc == 2 and message in err and "Traceback" not in err


def test_huge_max_new_tokens_exits_2(tiny_pair, capsys):
    rc, recs, err = _generate(capsys, tiny_pair, "--prompt", "x", "--max-new-tokens", 10**20)
    assert rc == 2 and recs == []
    assert "--max-new-tokens 100000000000000000000 leaves no room for a prompt in the target's 4096 positions" in err


def test_one_lines_huge_max_new_tokens_fails_alone_and_does_not_size_the_cache(tiny_pair, tmp_path, capsys, monkeypatch):
    sizes = []
    real = generate_mod.make_engine
    monkeypatch.setattr(generate_mod, "make_engine", lambda *a, **k: sizes.append(a[3]) or real(*a, **k))
    path = tmp_path / "p.jsonl"
    path.write_bytes(b"\n".join([GOOD_A, b'{"id": "big", "prompt": "x", "max_new_tokens": 100000000000000000000}']))
    rc, recs, _ = _generate(capsys, tiny_pair, "--prompts", path)
    assert rc == 1
    big = next(r for r in recs if r["id"] == "big")
    assert big["error"].startswith(f"{path}:2: ") and "exceeds the target's 4096 positions" in big["error"]
    assert sizes and sizes[0] < 100  # the engine's cache is sized by the good line alone


def test_huge_top_k_keeps_the_whole_vocabulary(tiny_pair, capsys):
    args = ["--prompt", "seeded", "--temperature", "1", "--max-new-tokens", "6", "--seed", "5"]
    rc, (huge,), err = _generate(capsys, tiny_pair, *args, "--top-k", 10**20)
    assert rc == 0, err
    _, (off,), _ = _generate(capsys, tiny_pair, *args, "--top-k", 0)
    assert huge["output_ids"] == off["output_ids"]


def test_huge_max_batch_size_allocates_for_the_requests_present(tiny_pair, tmp_path, capsys, monkeypatch):
    from sglang_adaflash.engine import engine as engine_mod

    slots = []
    real_init = engine_mod.SpecEngine.__init__

    def init(self, *a, max_batch_size, **k):
        assert max_batch_size <= 3, f"engine asked for {max_batch_size} slots for 3 requests"  # before allocating
        slots.append(max_batch_size)
        real_init(self, *a, max_batch_size=max_batch_size, **k)

    monkeypatch.setattr(engine_mod.SpecEngine, "__init__", init)
    path = tmp_path / "p.jsonl"
    path.write_bytes(b"\n".join([GOOD_A, GOOD_B, GOOD_A]))
    rc, recs, _ = _generate(capsys, tiny_pair, "--prompts", path, "--max-batch-size", 4096)
    assert rc == 0 and len(recs) == 3 and slots == [3]


def test_caches_that_cannot_fit_are_refused_clearly(tiny_pair, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(engine_factory, "available_memory", lambda device: 2**20)
    path = tmp_path / "p.jsonl"
    path.write_bytes(b"\n".join([GOOD_A] * 40))
    rc, recs, err = _generate(capsys, tiny_pair, "--prompts", path, "--max-batch-size", 1000, "--max-new-tokens", 2000)
    assert rc == 2 and recs == []
    assert "the KV caches for 40 concurrent request(s) of up to 2018 tokens need" in err
    assert "more than the 1.0 MiB free on cpu; lower --max-batch-size" in err and "Traceback" not in err


# -- issue 43: the last tracebacks and silently wrong answers of `adaflash generate` --------------


@pytest.mark.parametrize("temperature", ["1e-300", "1e-38", "5e-324", "0.000001"])
def test_a_vanishing_temperature_decodes_greedily(tiny_pair, capsys, temperature):
    """--temperature 1e-300 was a traceback (NaN probabilities); below 1e-5 it is greedy."""
    args = ["--prompt", "hot or not", "--max-new-tokens", "6"]
    rc, (rec,), err = _generate(capsys, tiny_pair, *args, "--temperature", temperature)
    assert rc == 0 and "Traceback" not in err, err
    _, (greedy,), _ = _generate(capsys, tiny_pair, *args, "--temperature", "0")
    assert rec["output_ids"] == greedy["output_ids"]


def test_a_vanishing_top_p_keeps_the_top_token(tiny_pair, capsys):
    args = ["--prompt", "nucleus", "--max-new-tokens", "6"]
    rc, (rec,), err = _generate(capsys, tiny_pair, *args, "--temperature", "1", "--top-p", "1e-300")
    assert rc == 0 and "Traceback" not in err, err
    _, (greedy,), _ = _generate(capsys, tiny_pair, *args, "--temperature", "0")
    assert rec["output_ids"] == greedy["output_ids"]


@pytest.mark.parametrize("bad_id, found", [('{"a": 1}', "object"), ("[1, 2]", "array"), ("true", "boolean"),
                                           ("1.5", "number 1.5")])
def test_an_id_that_is_not_a_string_or_an_integer_fails_its_line(tiny_pair, tmp_path, capsys, bad_id, found):
    """An object id came out as its Python repr (`{'a': 1}`)."""
    path = tmp_path / "p.jsonl"
    path.write_bytes(b"\n".join([GOOD_A, b'{"id": %s, "prompt": "fine text"}' % bad_id.encode(), GOOD_B,
                                 b'{"id": 7, "prompt": "an integer id is fine"}']))
    rc, recs, err = _generate(capsys, tiny_pair, "--prompts", path)
    assert rc == 1 and "1 of 4 request(s) failed" in err
    by_index = {r["index"]: r for r in recs}
    assert by_index[1]["id"] == "2"  # the line's default id, not a repr
    assert by_index[1]["error"] == f"{path}:2: 'id' must be a string or an integer, found {found}"
    assert by_index[3]["id"] == "7" and by_index[3]["error"] is None


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_a_max_batch_size_past_the_limit_exits_2_before_loading(tmp_path, capsys, command):
    argv = [command, "--target", str(tmp_path / "none"), "--max-batch-size", "100000000"]
    rc = main(argv + (["--prompt", "x"] if command == "generate" else []))
    err = capsys.readouterr().err
    assert rc == 2 and "--max-batch-size must be in 1..4096, got 100000000" in err, err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("keep", [0.5, 5])  # half the file; the first 5 bytes (not even a header)
def test_a_truncated_target_is_one_line_not_a_traceback(tiny_pair, tmp_path, capsys, keep):
    import shutil

    target = tmp_path / "target"
    shutil.copytree(tiny_pair.target_dir, target)
    weights = target / "model.safetensors"
    os.truncate(weights, int(weights.stat().st_size * keep) if keep < 1 else keep)
    rc = main(["generate", "--target", str(target), "--prompt", "x", "--mode", "ar"])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert f"{weights} cannot be read as safetensors" in err and "is truncated or corrupt" in err


def test_an_engine_failure_keeps_what_finished_and_fails_the_rest_in_records(tiny_pair, tmp_path, capsys,
                                                                             monkeypatch):
    """A decode step that raises (no request to blame) was a traceback that lost the run."""
    from sglang_adaflash.engine.engine import SpecEngine

    real = SpecEngine._decode_step

    def decode_step(self):
        if any(len(s.output) >= 3 and s.req.request_id == "r1" for s in self.running):
            raise RuntimeError("injected decode failure")
        return real(self)

    monkeypatch.setattr(SpecEngine, "_decode_step", decode_step)
    path = tmp_path / "p.jsonl"
    path.write_bytes(b"\n".join([b'{"id": "short", "prompt": "x", "max_new_tokens": 1}', GOOD_A, GOOD_B]))
    rc, recs, err = _generate(capsys, tiny_pair, "--prompts", path, "--max-new-tokens", 8)
    assert rc == 1 and "Traceback" not in err, err
    assert "adaflash generate: the engine failed (RuntimeError: injected decode failure)" in err
    by_id = {r["id"]: r for r in recs}
    assert sorted(by_id) == ["a", "b", "short"]
    assert by_id["short"]["error"] is None and len(by_id["short"]["output_ids"]) == 1
    for rid in ("a", "b"):
        assert by_id[rid]["finish_reason"] == "error"
        assert "the engine failed (RuntimeError: injected decode failure) before this request finished" \
            in by_id[rid]["error"]
