"""GET/POST /adaflash/v1/drafter on a FastAPI app, as mounted on SGLang's HTTP server; the
per-request traffic opt-out around SGLang's request logger."""

from __future__ import annotations

import json
import logging

import pytest

pytestmark = pytest.mark.sglang
pytest.importorskip("sglang")
fastapi = pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

from sglang_adaflash.sglang_plugin import http  # noqa: E402

TOKEN = "s3cret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def _env(tmp_path, **extra):
    for v in ("v000002", "v000003"):
        (tmp_path / "home" / "drafters" / v).mkdir(parents=True, exist_ok=True)
    return {
        "ADAFLASH_HOME": str(tmp_path / "home"),
        "ADAFLASH_LOADED_VERSION_FILE": str(tmp_path / "status.json"),
        "ADAFLASH_ADMIN_OVERRIDE_FILE": str(tmp_path / "override"),
        "ADAFLASH_BLOCKED_VERSIONS_FILE": str(tmp_path / "blocked"),
        **extra,
    }


@pytest.fixture
def client(tmp_path):
    env = _env(tmp_path, ADAFLASH_ADMIN_TOKEN=TOKEN)
    app = fastapi.FastAPI()
    http.add_routes(app, env)
    http.add_routes(app, env)  # idempotent
    assert sum(getattr(r, "path", None) == http.ROUTE for r in app.router.routes) == 2  # GET+POST
    return TestClient(app, headers=AUTH), tmp_path, env


def test_status_before_and_after_a_report(client):
    c, tmp, _ = client
    assert c.get(http.ROUTE).json()["loaded_version"] is None
    (tmp / "status.json").write_text(json.dumps({"loaded_version": "v000001", "reloads": {}}))
    assert c.get(http.ROUTE).json()["loaded_version"] == "v000001"


def test_post_sets_and_clears_the_override(client):
    c, tmp, _ = client
    r = c.post(http.ROUTE, json={"version": "v000002"})
    assert r.status_code == 202 and r.json()["override"] == "v000002"
    assert (tmp / "override").read_text().strip() == "v000002"
    assert c.post(http.ROUTE, json={"version": "latest"}).status_code == 202
    assert c.post(http.ROUTE, json={"version": None}).status_code == 202
    assert not (tmp / "override").exists()


@pytest.mark.parametrize(
    "body, match",
    [
        ({"version": "v000009"}, "not published"),
        ({"version": "../../etc"}, "v000001"),
        ({"other": 1}, "expected a JSON body"),
    ],
)
def test_post_rejects_bad_requests(client, body, match):
    c, tmp, _ = client
    r = c.post(http.ROUTE, json=body)
    assert r.status_code == 400 and match in r.json()["error"]
    assert not (tmp / "override").exists()


@pytest.mark.parametrize("token, auth, status", [
    (None, None, 403),  # no token configured: closed, whatever the caller sends
    (None, "Bearer ", 403),
    (TOKEN, None, 401),
    (TOKEN, "Bearer wrong", 401),
    (TOKEN, f"Bearer {TOKEN}x", 401),
    (TOKEN, "Bearer s3cret-tokén".encode(), 401),  # non-ASCII: refused, not a 500
    (TOKEN, f"Bearer {TOKEN}", 202),
])
def test_the_admin_call_is_closed_without_the_right_token(tmp_path, token, auth, status):
    env = _env(tmp_path, **({"ADAFLASH_ADMIN_TOKEN": token} if token else {}))
    app = fastapi.FastAPI()
    http.add_routes(app, env)
    c = TestClient(app)
    r = c.post(http.ROUTE, json={"version": "v000002"},
               headers={"Authorization": auth} if auth else {})
    assert r.status_code == status, r.text
    assert (tmp_path / "override").exists() == (status == 202)
    assert c.get(http.ROUTE).status_code == 200  # reading the status stays open


def test_only_a_loopback_only_server_may_leave_the_admin_call_open(tmp_path):
    env = _env(tmp_path)
    app = fastapi.FastAPI()
    http.add_routes(app, env, open_without_token=True)
    assert TestClient(app).post(http.ROUTE, json={"version": "v000002"}).status_code == 202
    env["ADAFLASH_ADMIN_TOKEN"] = TOKEN  # a configured token applies there too
    assert TestClient(app).post(http.ROUTE, json={"version": "v000002"}).status_code == 401


@pytest.mark.parametrize("phase", ["Rejected", "RolledBack"])
def test_a_blocked_version_cannot_be_pinned_without_force(client, phase):
    c, tmp, _ = client
    (tmp / "blocked").write_text(f"v000003 {phase}\nnot-a-version Rejected\n")
    r = c.post(http.ROUTE, json={"version": "v000003"})
    assert r.status_code == 409 and phase in r.json()["error"] and "force" in r.json()["error"]
    assert not (tmp / "override").exists()
    # `latest` naming the blocked version is the same mistake.
    (tmp / "home" / "drafters" / "latest").write_text("v000003\n")
    assert c.post(http.ROUTE, json={"version": "latest"}).status_code == 409
    assert c.post(http.ROUTE, json={"version": "v000003", "force": "yes"}).status_code == 400
    assert not (tmp / "override").exists()
    # A version not listed is fine; force gets past the list, and says so.
    assert c.post(http.ROUTE, json={"version": "v000002"}).status_code == 202
    r = c.post(http.ROUTE, json={"version": "v000003", "force": True})
    assert r.status_code == 202 and r.json()["forced_past"] == f"v000003 {phase}"
    assert (tmp / "override").read_text().strip() == "v000003"


def test_admin_calls_are_logged_with_the_caller(client, caplog):
    c, _, _ = client
    with caplog.at_level(logging.INFO, logger=http.logger.name):
        assert c.post(http.ROUTE, json={"version": "v000002"}).status_code == 202
        assert c.post(http.ROUTE, json={"version": None}).status_code == 202
        assert c.post(http.ROUTE, json={"version": "v000002"},
                      headers={"Authorization": "Bearer no"}).status_code == 401
    lines = [r.getMessage() for r in caplog.records]
    assert any("testclient" in m and "override to v000002" in m for m in lines), lines
    assert any("testclient" in m and "none (cleared)" in m for m in lines), lines
    assert any("refused" in m and "testclient" in m for m in lines), lines
    assert not any(TOKEN in m for m in lines)


def _request(headers):
    from starlette.requests import Request

    return Request({"type": "http", "method": "POST", "path": "/generate", "query_string": b"",
                    "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()]})


def test_an_opted_out_request_leaves_no_sglang_request_log(tmp_path, monkeypatch):
    """SGLang's own request logger (level 3, JSON, a directory: what the operator configures),
    with the plugin's hooks applied as SGLang applies them."""
    from sglang.srt.managers.io_struct import GenerateReqInput
    from sglang.srt.plugins.hook_registry import HookRegistry
    from sglang.srt.utils import request_logger as rlog

    for target in http.REQUEST_LOG_METHODS:  # undone after the test
        monkeypatch.setattr(rlog.RequestLogger, target.rsplit(".", 1)[1],
                            getattr(rlog.RequestLogger, target.rsplit(".", 1)[1]))
    monkeypatch.setattr(HookRegistry, "_hooks", type(HookRegistry._hooks)(list))
    monkeypatch.setattr(HookRegistry, "_patched", set())
    monkeypatch.setenv("ADAFLASH_LOADED_VERSION_FILE", str(tmp_path / "s.json"))
    monkeypatch.setenv("ADAFLASH_ADMIN_OVERRIDE_FILE", str(tmp_path / "o"))
    http.install_routes_when_server_starts()
    for target in http.REQUEST_LOG_METHODS:
        HookRegistry._apply_target(target, HookRegistry._hooks[target])
    logdir = tmp_path / "traffic" / "pod-0"
    logger = rlog.RequestLogger(log_requests=True, log_requests_level=3,
                                log_requests_format="json", log_requests_target=[str(logdir)])

    def serve(text, headers):
        obj = GenerateReqInput(text=text, sampling_params={}, rid=text)
        request = _request(headers)
        logger.log_received_request(obj, None, request)
        logger.log_openai_received_request({"prompt": text}, request=request)
        logger.log_finished_request(obj, {"meta_info": {"e2e_latency": 0.1}, "text": text},
                                    request=request)

    serve("private-prompt", {"x-adaflash-no-log": "1"})
    serve("private-two", {"X-AdaFlash-No-Log": "true"})
    serve("public-prompt", {"x-adaflash-no-log": "0"})
    for h in logger.targets[0].handlers:
        h.flush()
    logged = "".join(p.read_text() for p in logdir.iterdir())
    assert logged.count("public-prompt") >= 3  # the control: the log works and holds text
    assert "private" not in logged


def test_runtime_files_default_to_one_shared_directory():
    env = {}
    status, override = http.ensure_runtime_files(env)
    assert status.endswith("drafter-status.json") and override.endswith("desired-drafter-version")
    assert env["ADAFLASH_LOADED_VERSION_FILE"] == status
    assert http.ensure_runtime_files(env) == (status, override)  # stable once set


def test_routes_hook_is_registered_on_sglangs_launch_server(monkeypatch):
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    monkeypatch.setattr(HookRegistry, "_hooks", type(HookRegistry._hooks)(list))
    http.install_routes_when_server_starts()
    hooks = HookRegistry._hooks["sglang.srt.entrypoints.http_server.launch_server"]
    assert [(t, h) for t, h, _ in hooks] == [(HookType.BEFORE, http._before_launch_server)]
