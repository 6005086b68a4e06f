"""`seed` through the OpenAI client: the same seed gives the same sampled text, even with other
requests in flight; a bad seed is a 400 and the server keeps serving."""

from __future__ import annotations

import asyncio

import openai
import pytest

MODEL = "tiny"
PROMPT = "the quiet river ran past"


@pytest.fixture(scope="module")
def server(pair, tmp_path_factory):
    from .conftest import LiveServer

    home = tmp_path_factory.mktemp("seed-home")
    srv = LiveServer(["--target", str(pair.target_dir), "--drafter", str(pair.drafter_dir), "--home", str(home),
                      "--model-name", MODEL, "--mode", "dflash", "--max-batch-size", "8",
                      "--reload-poll-s", "60"]).start()
    yield srv
    srv.stop()


def _text(client, seed, prompt=PROMPT):
    return client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=1.0,
                                     seed=seed).choices[0].text


def test_same_seed_same_text_alone_and_under_load(server):
    client = server.openai()
    alone = _text(client, 1234)
    assert _text(client, 1234) == alone

    async def crowd():
        aclient = server.async_openai()
        noise = [aclient.completions.create(model=MODEL, prompt=f"noise {i} and more", max_tokens=16,
                                            temperature=1.0) for i in range(6)]
        mine = aclient.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=1.0, seed=1234)
        outs = await asyncio.gather(*noise, mine)
        return outs[-1].choices[0].text

    assert asyncio.run(crowd()) == alone
    # control: other seeds sample other text
    assert alone not in {_text(client, s) for s in (1, 2, 3)}


@pytest.mark.parametrize("bad", [-5, 2**63])
def test_a_bad_seed_is_a_400_and_serving_goes_on(server, bad):
    client = server.openai()
    with pytest.raises(openai.BadRequestError) as e:
        _text(client, bad)
    assert "seed" in str(e.value)
    assert _text(client, 7)
