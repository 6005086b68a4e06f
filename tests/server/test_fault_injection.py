"""Fault injection for `adaflash serve`: poison under concurrent load, and bad drafter versions.

A real server (loopback, mode dflash, 4 slots, a bounded queue) following `drafters/latest`
takes 60 requests from 8 concurrent clients (the official `openai` client, and raw HTTP for
bodies that client cannot send), in two waves. A fixed share of them is poison:

- hazards the engine must serve correctly: temperatures of 1e-38 and 1e-300 and a top_p of
  1e-300 (each of which used to stop the engine loop for everyone) decode greedily;
- input that must be refused with its own 4xx: a body nested 50,000 deep, a lone surrogate,
  NaN and negative temperatures, a top_p of 0, an opt-out that is no documented spelling,
  token ids outside the vocabulary, a request longer than --max-seq-len, n=3, an unknown model;
- a request the engine fails on (a fault injected into its prefill): 500 `engine_fault`.

Between the waves, the drafter reload is fed bad versions: admin calls whose version is a
number, a list, fullwidth digits or unpublished (400), then published versions with corrupted
weights, non-finite weights and another architecture (each refused while serving goes on), then
a good one, which is swapped in.

Every good request and every hazard must come back with exactly plain decoding's (`ar`)
tokens, every poison with its error, and the server must be healthy and idle at the end.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import os

import httpx
import openai
import pytest
import torch
from safetensors.torch import save_file

from sglang_adaflash.cli.main import main as cli_main
from sglang_adaflash.drafter.checkpoint import read_config
from sglang_adaflash.drafter.config import DrafterConfig
from sglang_adaflash.drafter.manifest import MANIFEST_NAME, target_fingerprint
from sglang_adaflash.drafter.store import (
    LATEST_NAME,
    drafters_dir,
    format_version,
    list_versions,
    publish_version,
    version_number,
)
from sglang_adaflash.fsio import write_text_atomic
from sglang_adaflash.testing.fixtures import random_state

from .conftest import LiveServer, inject_prefill_fault, publish_pair_drafter

MODEL = "tiny"
ADMIN = "/adaflash/v1/drafter"
MAX_TOKENS = 8
CONCURRENCY = 8
FAULT_IDS = [13, 13, 13, 13, 13]
GOOD = ["the quiet river", "def add(a, b):", "seven times three", "a list of", "hello there",
        "once upon a time", "print(x)", "rivers and seas"]

# kind -> (body changes, expected HTTP status, expected param or None, a phrase of the message)
POISON = {
    "nested": (None, 400, None, "nested too deeply"),
    "surrogate": (None, 400, "prompt", "lone surrogate"),
    "nan_temperature": (None, 400, "temperature", "greater than or equal to 0"),
    "negative_temperature": ({"temperature": -1}, 400, "temperature", "greater than or equal to 0"),
    "zero_top_p": ({"top_p": 0}, 400, "top_p", "greater than 0"),
    "opt_out": ({"metadata": {"adaflash_no_log": "maybe"}}, 400, "metadata.adaflash_no_log", "true or false"),
    "vocabulary": ({"prompt": [1, 2, 99999]}, 400, None, "outside the vocabulary"),
    "too_long": ({"max_tokens": 100_000}, 400, None, "max_seq_len"),
    "n": ({"n": 3}, 400, "n", "not supported"),
    "model": ({"model": "gpt-9"}, 404, "model", "not served here"),
    "engine_fault": ({"prompt": FAULT_IDS}, 500, None, "the engine failed on this request"),
}
HAZARDS = {"tiny_temperature": {"temperature": 1e-38}, "zero_float32_temperature": {"temperature": 1e-300},
           "zero_float32_top_p": {"temperature": 1.0, "top_p": 1e-300}}


def _schedule(n: int, offset: int) -> list[tuple[str, str]]:
    """(kind, prompt) per request: two good ones, then a hazard or a poison, in turn."""
    bad = [*HAZARDS, *POISON]
    out = []
    for i in range(offset, offset + n):
        kind = bad[(i // 3) % len(bad)] if i % 3 == 2 else "good"
        out.append((kind, GOOD[i % len(GOOD)]))
    return out


async def _send(client: openai.AsyncOpenAI, http: httpx.AsyncClient, i: int, kind: str, prompt: str):
    """One request: ("ok", token ids or text) or ("error", status, param, message)."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
    try:
        if kind == "nested":
            r = await http.post("/v1/completions", content=b'{"model": "tiny", "prompt": ' + b"[" * 50_000)
        elif kind == "surrogate":
            r = await http.post("/v1/completions", content=b'{"model": "tiny", "prompt": "a\\ud800b"}')
        elif kind == "nan_temperature":
            r = await http.post("/v1/completions", content=b'{"model": "tiny", "prompt": "x", "temperature": NaN}')
        else:
            body.update(POISON[kind][0] if kind in POISON else HAZARDS.get(kind, {}))
            model, fields = body.pop("model"), dict(body)
            extra = {k: fields.pop(k) for k in ("metadata", "n", "top_k") if k in fields}
            if i % 2 and kind not in POISON:  # streamed: compare the text
                chunks = [c async for c in await client.completions.create(
                    model=model, **fields, stream=True, extra_body=extra)]
                return "ok", "".join(c.choices[0].text for c in chunks if c.choices)
            out = await client.completions.create(model=model, **fields,
                                                  extra_body={**extra, "return_token_ids": True})
            return "ok", out.choices[0].model_extra["token_ids"]
    except openai.APIStatusError as e:
        err = e.body if isinstance(e.body, dict) else {}
        return "error", e.status_code, err.get("param"), err.get("message", str(e))
    except openai.APIError as e:  # an error event inside a stream
        return "error", None, None, e.message
    err = r.json()["error"]
    return "error", r.status_code, err["param"], err["message"]


async def _wave(srv: LiveServer, schedule: list[tuple[str, str]], offset: int) -> list:
    gate = asyncio.Semaphore(CONCURRENCY)  # bounded load: at most 8 in flight
    client = srv.async_openai(timeout=60)
    async with httpx.AsyncClient(base_url=srv.url, timeout=60,
                                 headers={"content-type": "application/json"}) as http:
        async def one(i, kind, prompt):
            async with gate:
                return await _send(client, http, i, kind, prompt)

        try:
            return await asyncio.gather(*(one(offset + j, k, p) for j, (k, p) in enumerate(schedule)))
        finally:
            await client.close()


def _ar_reference(pair, tmp_path, capsys) -> dict[str, dict]:
    """Plain decoding (`adaflash generate --mode ar`) of every good prompt, as raw completions."""
    path = tmp_path / "good.jsonl"
    path.write_text("".join(json.dumps({"id": p, "prompt": p}) + "\n" for p in GOOD))
    capsys.readouterr()
    assert cli_main(["generate", "--target", str(pair.target_dir), "--prompts", str(path), "--mode", "ar",
                     "--max-new-tokens", str(MAX_TOKENS), "--no-chat-template", "--json", "--quiet"]) == 0
    return {r["id"]: r for r in map(json.loads, capsys.readouterr().out.splitlines())}


def _random_state(pair, seed: int, cfg=None):
    cfg = cfg or read_config(pair.drafter_dir)
    return cfg, {k: v.to(torch.float64) for k, v in random_state(cfg, seed).items()}


def _publish_broken(home, pair, seed: int, how: str) -> str:
    """A version that a careless publisher made: built aside, broken (`corrupt`: bytes changed
    after hashing; `nan`: a NaN weight under a manifest that matches it), then renamed into
    drafters/ and named by `latest`, so the server never sees it unbroken."""
    cfg, state = _random_state(pair, seed)
    scratch = home.parent / f"scratch-{seed}"
    src = drafters_dir(scratch) / publish_version(scratch, cfg, state, target=target_fingerprint(pair.target_dir))
    weights, manifest_path = src / "model.safetensors", src / MANIFEST_NAME
    manifest = json.loads(manifest_path.read_text())
    if how == "corrupt":
        data = bytearray(weights.read_bytes())
        data[-8:] = b"\x00" * 8
        weights.write_bytes(bytes(data))
    else:
        state["fc.weight"][0, 0] = math.nan
        save_file(state, str(weights))
        manifest["files"]["model.safetensors"] = hashlib.sha256(weights.read_bytes()).hexdigest()
    version = format_version(max(map(version_number, list_versions(home))) + 1)
    manifest["version"] = version
    manifest_path.write_text(json.dumps(manifest))
    os.rename(src, drafters_dir(home) / version)
    write_text_atomic(drafters_dir(home) / LATEST_NAME, version + "\n")
    return version


def _publish_other_architecture(home, pair, seed: int) -> str:
    cfg = read_config(pair.drafter_dir)
    cfg, state = _random_state(pair, seed, DrafterConfig.from_dict({**cfg.raw, "intermediate_size": cfg.intermediate_size * 2}))
    return publish_version(home, cfg, state, target=target_fingerprint(pair.target_dir))


def _feed_bad_versions(srv: LiveServer, home, pair) -> dict:
    """Bad admin calls, three bad versions, then a good one; each verdict awaited (bounded)."""
    def status():
        return srv.get(ADMIN).json()

    for version in (5, ["v000001"], "v００００02", "../../etc", "v000099"):
        r = httpx.post(srv.url + ADMIN, json={"version": version}, timeout=10)
        assert r.status_code == 400, (version, r.text)
    refused = {}
    for seed, kind in ((21, "corrupt"), (22, "nan"), (23, "wider")):
        version = _publish_other_architecture(home, pair, seed) if kind == "wider" else \
            _publish_broken(home, pair, seed, kind)
        refused[kind] = srv.wait_for(lambda v=version: (lambda s: s if s.get("last_error_version") == v else None)(
            status()), what=f"{version} ({kind}) to be refused")
    cfg, state = _random_state(pair, 24)
    good = publish_version(home, cfg, state, target=target_fingerprint(pair.target_dir))
    srv.wait_for(lambda: status()["loaded_version"] == good, what=f"{good} to be swapped in")
    return {"refused": refused, "good": good}


@pytest.mark.timeout(180)
def test_poison_and_bad_versions_under_load_harm_no_good_request(pair, tmp_path, capsys):
    reference = _ar_reference(pair, tmp_path, capsys)
    home = tmp_path / "home"
    v1 = publish_pair_drafter(home, pair)
    srv = LiveServer(["--target", str(pair.target_dir), "--home", str(home), "--mode", "dflash",
                      "--model-name", MODEL, "--traffic-writer", "faults", "--max-batch-size", "4",
                      "--max-queue", "32", "--reload-poll-s", "0.1"]).start()
    try:
        inject_prefill_fault(srv.server.engine, FAULT_IDS)
        assert srv.get(ADMIN).json()["loaded_version"] == v1
        first, second = _schedule(36, 0), _schedule(24, 36)

        async def run():
            wave = asyncio.create_task(_wave(srv, first, 0))
            feed = await asyncio.to_thread(_feed_bad_versions, srv, home, pair)
            return await wave, feed, await _wave(srv, second, 36)  # the second wave: after the good reload

        got1, feed, got2 = asyncio.run(run())
        results = list(zip(first + second, got1 + got2))

        for n, ((kind, prompt), got) in enumerate(results):
            if kind in POISON:
                _, status, param, phrase = POISON[kind]
                assert got[0] == "error" and got[1] == status, (n, kind, got)
                assert param is None or got[2] == param, (n, kind, got)
                assert phrase in got[3], (n, kind, got)
            else:  # good requests and hazards: plain decoding's tokens (or its text, streamed)
                want = reference[prompt]
                assert got == ("ok", want["text"] if n % 2 else want["output_ids"]), (n, kind, got, want)
        kinds = {kind for kind, _ in first + second}
        assert kinds == {"good", *HAZARDS, *POISON}  # every poison was sent

        # the reloads: three refusals (each for its reason), one swap, the bad admin calls ignored
        refused = feed["refused"]
        assert "sha256" in refused["corrupt"]["last_error"]
        assert "NaN or Inf" in refused["nan"]["last_error"]
        assert "intermediate_size" in refused["wider"]["last_error"] or "shape" in refused["wider"]["last_error"]
        status = srv.get(ADMIN).json()
        assert status["loaded_version"] == feed["good"] and status["reloads"] == {"success": 1, "rejected": 3}
        assert [v for v, _ in srv.server.loop.swaps] == [feed["good"]]

        # healthy and idle at the end, and still answering
        assert srv.get("/health").json() == {"status": "ok"}
        ready = srv.wait_for(lambda: (lambda r: r if r["outstanding"] == 0 else None)(srv.get("/ready").json()),
                             what="every request to leave the engine")
        assert ready["ready"] and ready["running"] == 0 and ready["waiting"] == 0
        out = srv.openai().completions.create(model=MODEL, prompt=GOOD[0], max_tokens=MAX_TOKENS, temperature=0,
                                              extra_body={"return_token_ids": True})
        assert out.choices[0].model_extra["token_ids"] == reference[GOOD[0]]["output_ids"]
        assert out.system_fingerprint == feed["good"]
    finally:
        srv.stop()
