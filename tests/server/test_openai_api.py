"""`adaflash serve` through the official OpenAI client: completions, chat, streaming, T=0 equality
with `adaflash generate --mode ar`, 32 concurrent clients, errors, domains, traffic, metrics."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest

from sglang_adaflash.cli.main import main as cli_main

from .conftest import LiveServer, traffic_records

MODEL = "tiny"
PROMPTS = [
    "def add(a, b): return",
    "the quiet river ran past",
    "what is seven times three",
    "print the list",
]


@pytest.fixture(scope="module")
def server(pair, tmp_path_factory):
    home = tmp_path_factory.mktemp("api-home")
    srv = LiveServer(["--target", str(pair.target_dir), "--drafter", str(pair.drafter_dir), "--home", str(home),
                      "--model-name", MODEL, "--traffic-writer", "api-test", "--max-batch-size", "32",
                      "--reload-poll-s", "60"]).start()
    srv.home = home
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return server.openai()


def _generate_ar(pair, prompt: str, n: int, capsys, chat: bool) -> dict:
    argv = ["generate", "--target", str(pair.target_dir), "--prompt", prompt, "--mode", "ar",
            "--max-new-tokens", str(n), "--json", "--quiet"]
    if not chat:
        argv.append("--no-chat-template")
    capsys.readouterr()
    assert cli_main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_completion_streamed_chunks_join_to_the_non_streamed_text(client):
    for prompt in PROMPTS[:2]:
        full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
        assert full.usage.completion_tokens > 0 and full.choices[0].finish_reason in ("stop", "length")
        chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0,
                                                stream=True))
        assert len(chunks) > 2
        assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
        assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason


def test_chat_streamed_chunks_join_to_the_non_streamed_text(client):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": PROMPTS[2]}]
    full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0)
    assert full.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_t0_output_equals_adaflash_generate_ar(client, pair, capsys):
    """Same token ids as plain decoding, for a chat (chat template) and a raw completion."""
    for prompt in PROMPTS[:2]:
        ref = _generate_ar(pair, prompt, 20, capsys, chat=True)
        out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                             max_tokens=20, temperature=0, extra_body={"return_token_ids": True})
        assert out.choices[0].model_extra["token_ids"] == ref["output_ids"]
        assert out.choices[0].message.content == ref["text"]
        ref = _generate_ar(pair, prompt, 20, capsys, chat=False)
        out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0,
                                        extra_body={"return_token_ids": True})
        assert out.choices[0].model_extra["token_ids"] == ref["output_ids"]
        assert out.usage.prompt_tokens == ref["prompt_tokens"]


def test_stop_strings_end_the_text_the_same_way_streamed_or_not(server, client):
    base = client.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=32, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = base[6:9]
    assert len(stop) == 3 and stop in base
    want = base[: base.index(stop)]
    full = client.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=32, temperature=0, stop=[stop],
                                     extra_body={"ignore_eos": True})
    assert full.choices[0].text == want and full.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=32, temperature=0,
                                            stop=stop, stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "stop"
    # The request left the engine at the stop string instead of running to max_tokens.
    record = server.wait_for(lambda: {r["id"]: r for r in traffic_records(server.home)}.get(full.id),
                             what="the stop request's record")
    assert record["finish_reason"] == "stop" and len(record["output_ids"]) < 32


def test_32_concurrent_clients_are_all_answered_with_their_own_t0_output(server, client):
    prompts = [f"{PROMPTS[i % 4]} {i}" for i in range(32)]
    alone = {p: client.completions.create(model=MODEL, prompt=p, max_tokens=12, temperature=0).choices[0].text
             for p in prompts[:4]}

    async def one(aclient, i, p):
        if i % 2:
            chunks = [c async for c in await aclient.completions.create(
                model=MODEL, prompt=p, max_tokens=12, temperature=0, stream=True)]
            return "".join(c.choices[0].text for c in chunks)
        out = await aclient.completions.create(model=MODEL, prompt=p, max_tokens=12, temperature=0)
        return out.choices[0].text

    async def all_of_them():
        aclient = server.async_openai()
        async with aclient:
            return await asyncio.wait_for(
                asyncio.gather(*(one(aclient, i, p) for i, p in enumerate(prompts))), 120)

    texts = asyncio.run(all_of_them())
    assert len(texts) == 32
    assert [texts[i] for i in range(4)] == [alone[p] for p in prompts[:4]]
    assert server.get("/ready").json()["running"] == 0


@pytest.mark.parametrize("body, param", [
    (b'{"model": "tiny", "prompt": ', None),  # not JSON
    (b'["a list"]', None),
    (b'{"model": "tiny", "prompt": "x", "max_tokens": "many"}', "max_tokens"),
    (b'{"model": "tiny", "prompt": "x", "temperature": -1}', "temperature"),
    (b'{"model": "tiny", "prompt": "x", "n": 3}', "n"),
    (b'{"model": "tiny", "prompt": ""}', "prompt"),
    (b'{"model": "tiny", "prompt": [1, 2, 99999]}', None),  # outside the vocabulary: the engine says so
    (b'{"model": "tiny", "prompt": "x", "max_tokens": 100000}', None),  # past max_seq_len
    (b'{"prompt": "x"}', "model"),
])
def test_malformed_completion_gets_400_openai_error_and_serving_goes_on(server, client, body, param):
    r = httpx.post(server.url + "/v1/completions", content=body, headers={"content-type": "application/json"},
                   timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    assert set(err) == {"message", "type", "param", "code"}
    if param:
        assert err["param"] == param
    assert client.completions.create(model=MODEL, prompt="ok", max_tokens=2, temperature=0).choices


def test_client_errors_are_typed_by_the_official_client(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[], max_tokens=2)
    assert e.value.body["param"] == "messages"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[{"role": "wizard", "content": "x"}])
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-9", prompt="x")
    assert e.value.code == "model_not_found"
    assert [m.id for m in client.models.list()] == [MODEL]


def test_health_ready_and_metrics(server, client):
    assert server.get("/health").json() == {"status": "ok"}
    ready = server.get("/ready").json()
    assert ready["ready"] and ready["model"] == MODEL and ready["mode"] == "adaflash"
    client.completions.create(model=MODEL, prompt="metrics", max_tokens=6, temperature=0,
                              extra_body={"metadata": {"domain": "code"}})
    text = server.get("/metrics").text
    for name in ("adaflash_spec_drafts_total", "adaflash_spec_draft_tokens_total",
                 "adaflash_spec_verified_tokens_total", "adaflash_spec_accepted_tokens_total",
                 "adaflash_candidate_length_bucket", "adaflash_drafter_info", "adaflash_traffic_records_total"):
        assert name in text, name
    assert 'adaflash_spec_drafts_total{domain="code"}' in text
    assert 'adaflash_drafter_info{version="initial:drafter"} 1.0' in text


def test_traffic_records_ids_domain_and_opt_out(server, client):
    tagged = client.completions.create(model=MODEL, prompt="tag me", max_tokens=5, temperature=0,
                                       extra_body={"metadata": {"domain": "math"}, "return_token_ids": True})
    header = client.with_options(default_headers={"x-adaflash-domain": "prose"}).completions.create(
        model=MODEL, prompt="header tag", max_tokens=5, temperature=0)
    secret = client.completions.create(model=MODEL, prompt="do not keep", max_tokens=5, temperature=0,
                                       extra_body={"metadata": {"adaflash_no_log": True}})
    secret2 = client.with_options(default_headers={"x-adaflash-no-log": "1"}).completions.create(
        model=MODEL, prompt="nor this", max_tokens=5, temperature=0)
    def by_id():
        return {r["id"]: r for r in traffic_records(server.home)}

    records = server.wait_for(lambda: (lambda d: d if tagged.id in d and header.id in d else None)(by_id()),
                              what="the traffic records")
    rec = records[tagged.id]
    assert rec["domain"] == "math" and rec["model"] == MODEL
    assert rec["output_ids"] == tagged.choices[0].model_extra["token_ids"]
    assert rec["drafter_version"] == "initial:drafter" and rec["sampling"]["temperature"] == 0.0
    assert "prompt_text" not in rec and "output_text" not in rec  # ids only without --log-text
    assert records[header.id]["domain"] == "prose"
    time.sleep(0.3)  # the writer thread runs in order: later records would be there by now
    later = by_id()
    assert secret.id not in later and secret2.id not in later
