"""Each answer says how it was decoded (the ``adaflash`` extension), and ``/ready`` says how long
each hot reload held the loop: what the closed-loop demo reads live tau and the reload pause from."""

from __future__ import annotations

from .conftest import publish_pair_drafter

MODEL = "tiny"


def test_answers_carry_decode_steps_and_committed_tokens_by_version(pair, tmp_path, live_server):
    home = tmp_path / "home"
    v1 = publish_pair_drafter(home, pair)
    server = live_server(["--target", str(pair.target_dir), "--home", str(home), "--model-name", MODEL,
                          "--mode", "dflash", "--no-traffic"])
    client = server.openai()
    out = client.completions.create(model=MODEL, prompt="count the steps", max_tokens=12, temperature=0,
                                    extra_body={"ignore_eos": True})
    spec = out.model_dump()["adaflash"]
    assert spec["by_version"] == [{"version": v1, "decode_steps": spec["decode_steps"],
                                   "committed_tokens": spec["committed_tokens"]}]
    # prefill commits the first token; every decode step at least one more (its bonus)
    assert 1 <= spec["decode_steps"] <= out.usage.completion_tokens - 1 <= spec["committed_tokens"]
    assert spec["tau"] == spec["committed_tokens"] / spec["decode_steps"]

    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "count the steps"}], max_tokens=12,
        temperature=0, stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    last = chunks[-1].model_dump()
    assert last["usage"]["completion_tokens"] == 12 and last["adaflash"]["by_version"][0]["version"] == v1
    assert all("adaflash" not in c.model_dump() or c.usage is not None for c in chunks)


def test_mode_ar_answers_one_token_per_step(pair, tmp_path, live_server):
    server = live_server(["--target", str(pair.target_dir), "--home", str(tmp_path / "home"), "--mode", "ar",
                          "--model-name", MODEL, "--no-traffic"])
    out = server.openai().completions.create(model=MODEL, prompt="plain", max_tokens=6, temperature=0,
                                             extra_body={"ignore_eos": True})
    spec = out.model_dump()["adaflash"]
    assert spec["tau"] == 1.0 and spec["decode_steps"] == 5
    assert spec["by_version"] == [{"version": None, "decode_steps": 5, "committed_tokens": 5}]


def test_mode_d2sd_serves_trees_equal_to_ar(pair, tmp_path, live_server):
    """`serve --mode d2sd --recovery-drafter DIR`: the answers equal plain decoding at T=0 and
    say how many tokens each step committed; a missing recovery drafter is refused at start."""
    import pytest

    from sglang_adaflash.cli.main import build_parser
    from sglang_adaflash.errors import CLIError
    from sglang_adaflash.server.cli import build_server

    from ..d2sd.test_recovery_checkpoint import make_recovery

    rec = make_recovery(pair.drafter_dir, tmp_path / "rec")
    common = ["--target", str(pair.target_dir), "--drafter", str(pair.drafter_dir), "--home",
              str(tmp_path / "home"), "--model-name", MODEL, "--no-traffic"]
    ar = live_server([*common, "--mode", "ar"])
    tree = live_server([*common, "--mode", "d2sd", "--recovery-drafter", str(rec), "--tree-k", "2",
                        "--branch-len", "2", "--tree-rule", "fixed"])
    for prompt in ("hello world", "a tree of drafts", "count to ten"):
        want = ar.openai().completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0,
                                              extra_body={"ignore_eos": True})
        got = tree.openai().completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0,
                                               extra_body={"ignore_eos": True})
        assert got.choices[0].text == want.choices[0].text
        spec = got.model_dump()["adaflash"]
        assert spec["committed_tokens"] >= spec["decode_steps"] >= 1
    with pytest.raises(CLIError, match="recovery drafter"):
        build_server(build_parser().parse_args(["serve", "--port", "0", *common, "--mode", "d2sd"]))
