"""Hot reload in `adaflash serve`: a new drafters/latest is swapped in under load without losing a
request or changing a T=0 output; a bad version is refused while serving goes on; the admin call
moves the server; the admin call is closed to the network without a token."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
import torch

from sglang_adaflash.drafter.checkpoint import read_config
from sglang_adaflash.drafter.manifest import target_fingerprint
from sglang_adaflash.drafter.store import publish_version
from sglang_adaflash.testing.fixtures import random_state

from .conftest import publish_pair_drafter, traffic_records

MODEL = "tiny"
PROMPTS = ["reload one", "reload two two", "three is a prime", "def f(x): return x"]
ROUTE = "/adaflash/v1/drafter"


def _publish_random(home, pair, seed: int) -> str:
    cfg = read_config(pair.drafter_dir)
    state = {k: v.to(torch.float64) for k, v in random_state(cfg, seed).items()}
    return publish_version(home, cfg, state, target=target_fingerprint(pair.target_dir))


class Load:
    """Clients that keep sending the same T=0 requests (half streamed) until told to stop."""

    def __init__(self, server, clients: int = 6, max_requests: int = 400):
        self.server = server
        self.results: list[tuple[str, str, str]] = []  # (prompt, text, system_fingerprint)
        self.errors: list[BaseException] = []
        self.stop = threading.Event()
        self._budget = iter(range(max_requests))  # bounds every loop
        self._lock = threading.Lock()
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(clients)]

    def _run(self, i: int) -> None:
        client = self.server.openai(timeout=30)
        n = i
        while not self.stop.is_set():
            with self._lock:
                if next(self._budget, None) is None:
                    return
            prompt = PROMPTS[n % len(PROMPTS)]
            try:
                if n % 2:
                    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=12,
                                                            temperature=0, stream=True))
                    text, fp = "".join(c.choices[0].text for c in chunks), chunks[-1].system_fingerprint
                else:
                    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
                    text, fp = out.choices[0].text, out.system_fingerprint
                with self._lock:
                    self.results.append((prompt, text, fp))
            except Exception as e:  # every failure is a lost request
                with self._lock:
                    self.errors.append(e)
            n += 1

    def __enter__(self):
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for t in self.threads:
            t.join(60)

    def count(self) -> int:
        with self._lock:
            return len(self.results) + len(self.errors)


def test_hot_reload_under_load_loses_no_request_and_changes_no_t0_output(pair, tmp_path, live_server):
    home = tmp_path / "home"
    v1 = publish_pair_drafter(home, pair)
    server = live_server(["--target", str(pair.target_dir), "--home", str(home), "--model-name", MODEL,
                          "--traffic-writer", "reload", "--reload-poll-s", "0.1", "--max-batch-size", "8"])
    status = lambda: server.get(ROUTE).json()  # noqa: E731
    assert status()["loaded_version"] == v1
    client = server.openai()
    reference = {p: client.completions.create(model=MODEL, prompt=p, max_tokens=12, temperature=0).choices[0].text
                 for p in PROMPTS}

    with Load(server) as load:
        server.wait_for(lambda: load.count() >= 12, what="load before the reload")
        v2 = _publish_random(home, pair, seed=7)
        server.wait_for(lambda: status()["loaded_version"] == v2, what=f"{v2} to be loaded")
        seen = load.count()
        server.wait_for(lambda: load.count() >= seen + 12, what="load after the reload")

        v3 = _publish_random(home, pair, seed=8)
        weights = home / "drafters" / v3 / "model.safetensors"
        data = bytearray(weights.read_bytes())
        data[-8:] = b"\x00" * 8
        weights.write_bytes(bytes(data))  # the manifest's hash no longer matches
        refused = server.wait_for(lambda: (lambda s: s if s.get("last_error_version") == v3 else None)(status()),
                                  what=f"{v3} to be refused")
        seen = load.count()
        server.wait_for(lambda: load.count() >= seen + 12, what="load after the refusal")

    assert not load.errors, load.errors[:3]
    assert {fp for _, _, fp in load.results} >= {v1, v2}
    assert all(text == reference[prompt] for prompt, text, _ in load.results)
    assert refused["loaded_version"] == v2 and "sha256" in refused["last_error"]
    assert refused["reloads"] == {"success": 1, "rejected": 1}
    versions = {r["drafter_version"] for r in traffic_records(home)}
    assert {v1, v2} <= versions and v3 not in versions
    swaps = server.server.loop.swaps
    assert [v for v, _ in swaps] == [v2]
    # /ready reports the pause of each swap against the steps just before it, and the gap the
    # running requests saw between the last step before the swap and the first after it
    (entry,) = server.get("/ready").json()["swaps"]
    assert entry["version"] == v2 and entry["after_step"] > 0 and entry["pause_s"] == swaps[0][1]
    assert entry["pause_steps"] == entry["pause_s"] / entry["median_step_s"]
    assert entry["pause_s"] <= entry["gap_s"]
    metrics = server.get("/metrics").text
    assert 'adaflash_drafter_reloads_total{result="success"} 1.0' in metrics
    assert 'adaflash_drafter_reloads_total{result="rejected"} 1.0' in metrics
    assert f'adaflash_drafter_info{{version="{v2}"}} 1.0' in metrics

    # The admin call (open on a loopback-only server) moves it back to v1; outputs stay put.
    r = httpx.post(server.url + ROUTE, json={"version": v1}, timeout=10)
    assert r.status_code == 202 and r.json()["override"] == v1
    server.wait_for(lambda: status()["loaded_version"] == v1, what="the admin override")
    out = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=0)
    assert out.choices[0].text == reference[PROMPTS[0]] and out.system_fingerprint == v1


def test_a_pinned_version_is_served_and_latest_is_not_followed(pair, tmp_path, live_server):
    home = tmp_path / "home"
    v1 = publish_pair_drafter(home, pair)
    server = live_server(["--target", str(pair.target_dir), "--home", str(home), "--drafter-version", v1,
                          "--model-name", MODEL, "--no-traffic", "--reload-poll-s", "0.1"])
    _publish_random(home, pair, seed=9)
    time.sleep(0.5)  # five polls
    assert server.get(ROUTE).json()["loaded_version"] == v1
    status = server.server.reloader.status  # desired_* reach the status file only with a change
    assert (status.desired_version, status.desired_from) == (v1, "--drafter-version")


@pytest.mark.parametrize("host, token, auth, status", [
    ("0.0.0.0", None, None, 403),  # reachable from the network, no token: closed
    ("0.0.0.0", "s3cret", None, 401),
    ("0.0.0.0", "s3cret", "Bearer s3cret", 202),
    ("127.0.0.1", None, None, 202),  # loopback only: open, as in a local test
    ("::1", None, None, 202),
])
def test_the_admin_call_needs_a_token_unless_the_server_is_loopback_only(tmp_path, host, token, auth, status):
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from sglang_adaflash.server.reload import mount_admin, reload_env

    home = tmp_path / "home"
    (home / "drafters" / "v000001").mkdir(parents=True)
    env = reload_env(home, follow_latest=False, base={} if token is None else {"ADAFLASH_ADMIN_TOKEN": token})
    app = FastAPI()
    mount_admin(app, env, host)
    headers = {"authorization": auth} if auth else {}
    r = TestClient(app).post(ROUTE, json={"version": "v000001"}, headers=headers)
    assert r.status_code == status, r.text
    assert TestClient(app).get(ROUTE).status_code == 200  # reading the status stays open


def test_mode_ar_serves_without_a_drafter_and_says_why_it_cannot_reload(pair, tmp_path, live_server):
    server = live_server(["--target", str(pair.target_dir), "--home", str(tmp_path / "home"), "--mode", "ar",
                          "--model-name", MODEL, "--no-traffic"])
    out = server.openai().completions.create(model=MODEL, prompt="plain", max_tokens=4, temperature=0)
    assert out.usage.completion_tokens == 4 and out.system_fingerprint is None
    state = server.get(ROUTE).json()
    assert state["loaded_version"] is None and "mode ar" in state["reload"]
    assert "adaflash_spec_drafts_total{" not in server.get("/metrics").text  # ar drafts nothing


@pytest.mark.parametrize("shared", [None, "context"])
def test_joint_drafting_follows_a_hot_reload(pair, tmp_path, live_server, shared):
    """`serve --mode d2sd --branch-drafter joint`: the two drafters run as one stacked pass, a
    copy of their weights; a reloaded first drafter (written in place) is what the next pass
    reads, and T=0 answers stay those of plain decoding before and after. A recovery drafter
    sharing the first's context modules reads the reloaded ones (the same objects)."""
    from sglang_adaflash.d2sd.recovery_drafter import recovery_marker

    from ..d2sd.test_recovery_checkpoint import make_recovery

    home = tmp_path / "home"
    v1 = publish_pair_drafter(home, pair)
    rec = make_recovery(pair.drafter_dir, tmp_path / "rec",
                        marker=recovery_marker(shared=shared) if shared else True)
    common = ["--target", str(pair.target_dir), "--home", str(home), "--model-name", MODEL, "--no-traffic"]
    ar = live_server([*common, "--mode", "ar"]).openai()
    server = live_server([*common, "--mode", "d2sd", "--recovery-drafter", str(rec), "--branch-drafter", "joint",
                          "--tree-k", "2", "--branch-len", "2", "--reload-poll-s", "0.1"])
    client = server.openai()

    def answers():
        return [client.completions.create(model=MODEL, prompt=p, max_tokens=12, temperature=0).choices[0].text
                for p in PROMPTS]

    want = [ar.completions.create(model=MODEL, prompt=p, max_tokens=12, temperature=0).choices[0].text
            for p in PROMPTS]
    assert server.get(ROUTE).json()["loaded_version"] == v1
    assert answers() == want
    engine = server.server.loop.engine
    joint = engine.proposer.joint
    built = joint.rebuilds
    v2 = _publish_random(home, pair, seed=7)
    server.wait_for(lambda: server.get(ROUTE).json()["loaded_version"] == v2, what=f"{v2} to be loaded")
    assert answers() == want
    assert joint.rebuilds > built
    torch.testing.assert_close(joint._weights()["fc"][0], engine.drafter.fc.weight.t())
    assert engine.proposer.shared_context == (shared is not None)
    if shared:
        assert engine.recovery.fc is engine.drafter.fc
        torch.testing.assert_close(joint._weights()["fc"][1], engine.drafter.fc.weight.t())


def test_a_swap_makes_the_engine_forget_the_old_drafters_acceptance():
    """The engine loop tells the engine when a new version is swapped in between two steps, so
    the calibration reads the new drafter afresh (SpecEngine.drafter_swapped)."""
    from types import SimpleNamespace

    from sglang_adaflash.server.engine_loop import EngineLoop

    calls = []
    engine = SimpleNamespace(block_size=1, drafter_swapped=lambda manifest: calls.append(manifest))
    versions = iter(["v000002", None])
    manifest = {"eval": {"tau_by_domain": {"math": 3.0}}}  # the new version's (planner.prior)
    reloader = SimpleNamespace(status=SimpleNamespace(loaded_version="v000001"),
                               at_step_boundary=lambda: next(versions), loaded_manifest=manifest)
    loop = EngineLoop(engine, capacity=1, post=lambda fn: fn(), reloader=reloader)
    loop._boundary()
    assert calls == [manifest] and loop.version == "v000002"
    loop._boundary()  # nothing swapped: nothing forgotten
    assert calls == [manifest]
