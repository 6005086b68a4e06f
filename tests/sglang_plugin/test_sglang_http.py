"""GET/POST /adaflash/v1/drafter on a FastAPI app, as mounted on SGLang's HTTP server."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.sglang
pytest.importorskip("sglang")
fastapi = pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

from sglang_adaflash.sglang_plugin import http  # noqa: E402


@pytest.fixture
def client(tmp_path):
    (tmp_path / "home" / "drafters" / "v000002").mkdir(parents=True)
    env = {
        "ADAFLASH_HOME": str(tmp_path / "home"),
        "ADAFLASH_LOADED_VERSION_FILE": str(tmp_path / "status.json"),
        "ADAFLASH_ADMIN_OVERRIDE_FILE": str(tmp_path / "override"),
    }
    app = fastapi.FastAPI()
    http.add_routes(app, env)
    http.add_routes(app, env)  # idempotent
    assert sum(getattr(r, "path", None) == http.ROUTE for r in app.router.routes) == 2  # GET+POST
    return TestClient(app), tmp_path, env


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


def test_admin_token(client):
    c, _, env = client
    env["ADAFLASH_ADMIN_TOKEN"] = "s3cret"
    assert c.post(http.ROUTE, json={"version": "v000002"}).status_code == 401
    r = c.post(http.ROUTE, json={"version": "v000002"}, headers={"Authorization": "Bearer s3cret"})
    assert r.status_code == 202


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
