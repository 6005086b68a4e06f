"""The API client on kubernetes_asyncio: paths, errors, label filtering, credentials reloaded
after a 401, retries on 429/5xx, transport errors turned into ApiError, server-side apply."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from adaflash_operator import kube
from aiohttp import web


def test_paths() -> None:
    assert kube.path("Pod", "ml", "p") == "/api/v1/namespaces/ml/pods/p"
    assert kube.path("Deployment", "ml") == "/apis/apps/v1/namespaces/ml/deployments"
    assert kube.path("DrafterVersion", "ml", "d", "status") == \
        "/apis/adaflash.io/v1alpha1/namespaces/ml/drafterversions/d/status"


async def _serve(handler) -> tuple[web.AppRunner, str]:
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"


def _kubeconfig(path: Path, url: str, token: str) -> Path:
    path.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "t",
        "clusters": [{"name": "t", "cluster": {"server": url}}],
        "users": [{"name": "t", "user": {"token": token}}],
        "contexts": [{"name": "t", "context": {"cluster": "t", "user": "t"}}]}))
    return path


@pytest.fixture(autouse=True)
def _fast_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kube, "BACKOFF_S", 0.01)
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)


def test_errors_labels_and_credentials_reloaded_after_401(tmp_path: Path) -> None:
    seen: list[str] = []

    async def handler(request: web.Request) -> web.Response:
        seen.append(request.headers.get("Authorization", ""))
        if request.headers.get("Authorization") != "Bearer new-token":
            return web.json_response({"message": "Unauthorized"}, status=401)
        if request.method == "GET" and request.path.endswith("/pods"):
            return web.json_response({"items": [
                {"metadata": {"name": "a", "labels": {"x": "1"}}},
                {"metadata": {"name": "b", "labels": {"x": "2"}}}]})  # ignores labelSelector
        if request.path.endswith("/missing"):
            return web.json_response({"message": "pods 'missing' not found"}, status=404)
        return web.json_response({"message": "the spec is invalid", "reason": "Invalid"},
                                 status=422)

    async def main() -> None:
        runner, url = await _serve(handler)
        cfg = _kubeconfig(tmp_path / "kubeconfig", url, "old-token")
        try:
            await kube.load_config(str(cfg))
            _kubeconfig(cfg, url, "new-token")  # e.g. an exec plugin's token expired
            items = await kube.list_("Pod", "ml", {"x": "1"})
            assert [i["metadata"]["name"] for i in items] == ["a"]
            assert seen[:2] == ["Bearer old-token", "Bearer new-token"]  # reloaded once
            assert await kube.get("Pod", "ml", "missing") is None
            with pytest.raises(kube.ApiError) as e:
                await kube.create({"kind": "Pod", "metadata": {"namespace": "ml", "name": "p"}})
            assert e.value.status == 422 and "the spec is invalid" in str(e.value)
            assert e.value.reason == "Invalid"
        finally:
            await kube.close()
            await runner.cleanup()

    asyncio.run(main())


def test_retries_on_429_and_5xx_then_gives_up(tmp_path: Path) -> None:
    calls: dict[str, int] = {}

    async def handler(request: web.Request) -> web.Response:
        name = request.path.rsplit("/", 1)[-1]
        calls[name] = calls.get(name, 0) + 1
        if name == "busy" and calls[name] <= 2:
            return web.json_response({"message": "too many requests"}, status=429,
                                     headers={"Retry-After": "0"})
        if name == "flaky" and calls[name] == 1:
            return web.json_response({"message": "etcd leader changed"}, status=503)
        if name == "broken":
            return web.json_response({"message": "internal error"}, status=500)
        if name == "bad":
            return web.json_response({"message": "nope"}, status=400)
        return web.json_response({"metadata": {"name": name}})

    async def main() -> None:
        runner, url = await _serve(handler)
        try:
            await kube.load_config(str(_kubeconfig(tmp_path / "kc", url, "t")))
            assert (await kube.get("Pod", "ml", "busy"))["metadata"]["name"] == "busy"
            assert (await kube.get("Pod", "ml", "flaky"))["metadata"]["name"] == "flaky"
            assert calls == {"busy": 3, "flaky": 2}
            with pytest.raises(kube.ApiError) as e:
                await kube.get("Pod", "ml", "broken")
            assert e.value.status == 500 and calls["broken"] == kube.ATTEMPTS
            with pytest.raises(kube.ApiError):
                await kube.get("Pod", "ml", "bad")
            assert calls["bad"] == 1  # a client error is not retried
        finally:
            await kube.close()
            await runner.cleanup()

    asyncio.run(main())


@pytest.mark.parametrize("reply", [
    b"",  # the server closes the connection: aiohttp's ServerDisconnectedError
    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"a\"",
    # a body cut short: aiohttp's ClientPayloadError
])
def test_transport_errors_become_api_errors(tmp_path: Path, reply: bytes) -> None:
    """The control loop catches ApiError; aiohttp's own errors must not reach it raw."""
    hits = 0

    async def main() -> None:
        async def conn(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            nonlocal hits
            hits += 1
            await reader.readuntil(b"\r\n\r\n")
            writer.write(reply)
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(conn, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        try:
            await kube.load_config(str(_kubeconfig(tmp_path / "kc", f"http://127.0.0.1:{port}",
                                                   "t")))
            with pytest.raises(kube.ApiError) as e:
                await kube.get("Pod", "ml", "p")
            assert e.value.status == 0
        finally:
            await kube.close()
            server.close()
            await server.wait_closed()

    asyncio.run(main())
    assert hits >= kube.ATTEMPTS  # retried before giving up (aiohttp may retry a GET too)


def test_apply_is_server_side_apply_with_our_field_manager(tmp_path: Path) -> None:
    got: list[tuple[str, str, dict, dict]] = []

    async def handler(request: web.Request) -> web.Response:
        body = await request.json()
        got.append((request.method, request.headers["Content-Type"], dict(request.query), body))
        return web.json_response({**body, "metadata": {**body["metadata"], "managedFields": [
            {"manager": "adaflash-operator", "operation": "Apply", "fieldsV1": {"f:data": {}}},
            {"manager": "kubectl-edit", "operation": "Update", "fieldsV1": {"f:x": {}}}]}})

    async def main() -> None:
        runner, url = await _serve(handler)
        try:
            await kube.load_config(str(_kubeconfig(tmp_path / "kc", url, "t")))
            obj = {"apiVersion": "v1", "kind": "ConfigMap",
                   "metadata": {"name": "c", "namespace": "ml"}, "data": {"k": "v"}}
            live = await kube.apply(obj)
            assert kube.managed_fields(live) == {"f:data": {}}
            await kube.patch("Pod", "ml", "p", {"metadata": {"annotations": {"a": "b"}}})
        finally:
            await kube.close()
            await runner.cleanup()

    asyncio.run(main())
    (m1, ct1, q1, b1), (m2, ct2, q2, _) = got
    assert (m1, ct1, q1) == ("PATCH", "application/apply-patch+yaml",
                             {"fieldManager": "adaflash-operator", "force": "true"})
    assert b1["data"] == {"k": "v"}
    assert (m2, ct2, q2) == ("PATCH", "application/merge-patch+json",
                             {"fieldManager": "adaflash-operator"})
