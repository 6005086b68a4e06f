"""What a failing step does to a live `adaflash serve`.

- A fault the engine blames on one request (its prefill raised): that request gets 500
  `engine_fault` (or an error event in its stream), its slot is free again, every other request
  is answered as if nothing happened, and `/health` stays ok.
- A failure nobody can be blamed for (a decode step raised): every outstanding request gets
  503, `/health` answers 503 with the reason, and the server stops by itself; `adaflash serve`
  then exits 1 so that its supervisor restarts it.

Faults are injected into the engine of a real server: the only way to make today's validated
engine fail on purpose.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import textwrap
import time

import httpx
import openai
import pytest

from .conftest import LiveServer, inject_prefill_fault

MODEL = "tiny"
POISON = [13, 13, 13, 13, 13]  # a prompt of token ids the injected fault recognises
PROMPTS = ["the quiet river", "def add(a, b):", "seven times three", "a list of", "hello there"]


def _server(pair, tmp_path, *extra) -> LiveServer:
    return LiveServer(["--target", str(pair.target_dir), "--drafter", str(pair.drafter_dir), "--mode", "dflash",
                       "--home", str(tmp_path / "home"), "--model-name", MODEL, "--no-traffic",
                       "--max-batch-size", "4", "--reload-poll-s", "60", *extra])


def _poison_decode(engine) -> None:
    real = engine._decode_step

    def decode_step():
        if any(s.req.prompt_ids == POISON for s in engine.running):
            raise RuntimeError("injected: a decode step that cannot be blamed on anyone")
        return real()

    engine._decode_step = decode_step


async def _answers(srv: LiveServer, prompts: list, stream_every: int = 2) -> list:
    """Each prompt through the official client at once; text, or the exception it raised."""
    client = srv.async_openai(timeout=60)

    async def one(i, prompt):
        try:
            if i % stream_every:
                chunks = [c async for c in await client.completions.create(
                    model=MODEL, prompt=prompt, max_tokens=10, temperature=0, stream=True)]
                return "".join(c.choices[0].text for c in chunks if c.choices)
            out = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0)
            return out.choices[0].text
        except openai.APIError as e:
            return e

    try:
        return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    finally:
        await client.close()


def test_a_request_the_engine_fails_on_fails_alone(pair, tmp_path):
    srv = _server(pair, tmp_path).start()
    try:
        reference = asyncio.run(_answers(srv, PROMPTS))
        assert all(isinstance(t, str) for t in reference)
        inject_prefill_fault(srv.server.engine, POISON)
        mixed = [POISON, *PROMPTS[:2], POISON, *PROMPTS[2:]]  # non-streamed and streamed poisons
        got = asyncio.run(_answers(srv, mixed))
        for i in (0, 3):
            assert isinstance(got[i], openai.APIError), got[i]
            message = got[i].message if isinstance(got[i], openai.APIStatusError) else str(got[i])
            assert "the engine failed on this request" in message and "injected" in message
        assert isinstance(got[0], openai.InternalServerError) and got[0].code == "engine_fault"
        assert [got[i] for i in (1, 2, 4, 5, 6)] == reference
        assert srv.get("/health").json() == {"status": "ok"}
        ready = srv.wait_for(lambda: (lambda r: r if r["outstanding"] == 0 else None)(srv.get("/ready").json()),
                             what="every slot free again")
        assert ready["ready"] and ready["running"] == 0
        assert asyncio.run(_answers(srv, PROMPTS)) == reference
    finally:
        srv.stop()


def test_a_failure_nobody_can_be_blamed_for_stops_the_server_and_says_why(pair, tmp_path):
    srv = _server(pair, tmp_path)
    srv.server.settings.fatal_exit_grace_s = 1.5
    srv.start()
    try:
        _poison_decode(srv.server.engine)
        got = asyncio.run(_answers(srv, [*PROMPTS[:3], POISON]))
        assert all(isinstance(g, openai.APIError) for g in got), got  # outstanding requests: 503
        assert any(isinstance(g, openai.InternalServerError) and g.status_code == 503 for g in got)
        health = srv.get("/health")  # within the grace: still answering, and saying why
        assert health.status_code == 503 and health.json()["status"] == "failed"
        assert "injected: a decode step that cannot be blamed" in health.json()["error"]
        with pytest.raises(openai.InternalServerError, match="not serving"):
            srv.openai().completions.create(model=MODEL, prompt="late", max_tokens=2)
        srv.wait_for(lambda: not srv.running, timeout=15, what="the server to stop by itself")
        assert srv.server.exit_code == 1
    finally:
        srv.stop()


INJECT = textwrap.dedent("""
    import sys
    from sglang_adaflash.engine.engine import SpecEngine
    real = SpecEngine._decode_step
    def decode_step(self):
        if any(s.req.prompt_ids == {poison} for s in self.running):
            raise RuntimeError("injected decode failure")
        return real(self)
    SpecEngine._decode_step = decode_step
    from sglang_adaflash.cli.main import main
    sys.exit(main(sys.argv[1:]))
""")


def test_serve_exits_1_when_its_engine_loop_fails(pair, tmp_path):
    """The real command in its own process: its supervisor sees a non-zero exit status."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-c", INJECT.format(poison=POISON), "serve", "--target", str(pair.target_dir),
         "--drafter", str(pair.drafter_dir), "--mode", "dflash", "--home", str(tmp_path / "home"),
         "--model-name", MODEL, "--no-traffic", "--port", str(port), "--reload-poll-s", "60",
         "--log-level", "warning"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        ok = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "fine", "max_tokens": 3},
                        timeout=30)
        assert ok.status_code == 200
        bad = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": POISON, "max_tokens": 3},
                         timeout=30)
        assert bad.status_code == 503 and "injected decode failure" in bad.json()["error"]["message"]
        health = httpx.get(url + "/health", timeout=5)
        assert health.status_code == 503 and "injected decode failure" in json.dumps(health.json())
        rc = proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
        out, err = proc.communicate(timeout=10)
    assert rc == 1, err
    assert "adaflash serve: stopped because the engine failed: RuntimeError: injected decode failure; " \
           "exiting 1" in err
