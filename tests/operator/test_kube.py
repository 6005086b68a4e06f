"""The small API client: paths, errors, label filtering, and token rotation."""

from __future__ import annotations

import asyncio
from pathlib import Path

import kopf
import pytest
from adaflash_operator import kube
from aiohttp import web


def test_paths() -> None:
    assert kube.path("Pod", "ml", "p") == "/api/v1/namespaces/ml/pods/p"
    assert kube.path("Deployment", "ml") == "/apis/apps/v1/namespaces/ml/deployments"
    assert kube.path("DrafterVersion", "ml", "d", "status") == \
        "/apis/adaflash.io/v1alpha1/namespaces/ml/drafterversions/d/status"


def _serve(handler) -> tuple[web.AppRunner, str]:
    async def start() -> tuple[web.AppRunner, str]:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", handler)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return runner, f"http://127.0.0.1:{port}"
    return start()  # type: ignore[return-value]


def test_errors_labels_and_token_rotation(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("new-token")
    monkeypatch.setattr(kube, "SA_TOKEN", str(token_file))
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
        return web.json_response({"message": "the spec is invalid"}, status=422)

    async def main() -> None:
        runner, url = await _serve(handler)
        try:
            kube.configure(kopf.ConnectionInfo(server=url, token="old-token"))
            items = await kube.list_("Pod", "ml", {"x": "1"})
            assert [i["metadata"]["name"] for i in items] == ["a"]
            assert seen[:2] == ["Bearer old-token", "Bearer new-token"]  # one retry
            assert await kube.get("Pod", "ml", "missing") is None
            with pytest.raises(kube.ApiError) as e:
                await kube.create({"kind": "Pod", "metadata": {"namespace": "ml", "name": "p"}})
            assert e.value.status == 422 and "the spec is invalid" in str(e.value)
        finally:
            await kube.close()
            await runner.cleanup()

    asyncio.run(main())
