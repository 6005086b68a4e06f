"""Bounded admission, disconnects and timeouts: a server with one slot and one queue place."""

from __future__ import annotations

import httpx
import openai
import pytest

from .conftest import LiveServer, traffic_records

MODEL = "tiny"
LONG = {"model": MODEL, "prompt": "a long one", "max_tokens": 2000, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(pair, tmp_path_factory):
    home = tmp_path_factory.mktemp("limits-home")
    srv = LiveServer(["--target", str(pair.target_dir), "--drafter", str(pair.drafter_dir), "--home", str(home),
                      "--model-name", MODEL, "--traffic-writer", "limits", "--max-batch-size", "1",
                      "--max-queue", "1", "--reload-poll-s", "60"]).start()
    srv.home = home
    yield srv
    srv.stop()


def _idle(server) -> bool:
    state = server.get("/ready").json()
    return state["running"] == 0 and state["waiting"] == 0 and state["outstanding"] == 0


def _record(server, rid: str) -> dict:
    return server.wait_for(lambda: {r["id"]: r for r in traffic_records(server.home)}.get(rid),
                           what=f"the traffic record of {rid}")


def _open_stream(http: httpx.Client, body: dict):
    ctx = http.stream("POST", "/v1/completions", json={**body, "stream": True})
    response = ctx.__enter__()
    assert response.status_code == 200
    return ctx, response


def test_a_full_queue_answers_429_and_frees_up_again(server):
    client = server.openai()
    with httpx.Client(base_url=server.url, timeout=30) as http:
        running = _open_stream(http, LONG)  # takes the one slot
        queued = _open_stream(http, LONG)  # takes the one queue place
        server.wait_for(lambda: server.get("/ready").json()["outstanding"] == 2, what="two outstanding")
        with pytest.raises(openai.RateLimitError) as e:
            client.completions.create(model=MODEL, prompt="one too many", max_tokens=2)
        assert e.value.status_code == 429 and e.value.code == "queue_full"
        assert e.value.body["type"] == "rate_limit_error"
        for ctx, _ in (running, queued):
            ctx.__exit__(None, None, None)  # both clients go away
    server.wait_for(lambda: _idle(server), what="the slot and the queue place to free")
    assert client.completions.create(model=MODEL, prompt="room again", max_tokens=3, temperature=0).choices


def test_a_client_that_disconnects_mid_stream_frees_its_slot(server):
    client = server.openai()
    with httpx.Client(base_url=server.url, timeout=30) as http:
        ctx, response = _open_stream(http, LONG)
        lines = response.iter_lines()
        data = [line for line in (next(lines) for _ in range(8)) if line.startswith("data: ")]
        rid = __import__("json").loads(data[0][len("data: "):])["id"]
        ctx.__exit__(None, None, None)  # mid-stream: 2000 tokens were asked for
    # With one slot, this request can only run once the abandoned one is gone.
    out = client.completions.create(model=MODEL, prompt="next in line", max_tokens=4, temperature=0, timeout=20)
    assert out.choices[0].finish_reason in ("length", "stop")
    server.wait_for(lambda: _idle(server), what="the slot to free")
    record = _record(server, rid)
    assert record["finish_reason"] == "abort" and 0 < len(record["output_ids"]) < 2000


def test_a_client_that_gives_up_on_a_non_streamed_request_frees_its_slot(server):
    before = {r["id"] for r in traffic_records(server.home)}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=LONG, timeout=httpx.Timeout(30, read=0.5))
    server.wait_for(lambda: _idle(server), what="the slot to free")
    new = server.wait_for(lambda: [r for r in traffic_records(server.home) if r["id"] not in before],
                          what="the aborted request's record")
    assert new[0]["finish_reason"] == "abort" and len(new[0]["output_ids"]) < 2000


def test_a_request_past_its_timeout_is_aborted_and_answered_504(server):
    client = server.openai()
    settings = server.server.settings
    saved, settings.request_timeout_s = settings.request_timeout_s, 0.4
    try:
        with pytest.raises(openai.InternalServerError) as e:
            client.completions.create(model=MODEL, prompt="too slow", max_tokens=2000, temperature=0,
                                      extra_body={"ignore_eos": True})
        assert e.value.status_code == 504 and e.value.code == "timeout"
        with pytest.raises(openai.APIError, match="request-timeout"):
            for _ in client.completions.create(model=MODEL, prompt="too slow", max_tokens=2000, temperature=0,
                                               stream=True, extra_body={"ignore_eos": True}):
                pass
    finally:
        settings.request_timeout_s = saved
    server.wait_for(lambda: _idle(server), what="the timed-out requests to be dropped")
