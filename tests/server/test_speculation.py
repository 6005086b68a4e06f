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
