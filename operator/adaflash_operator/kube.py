"""A small async Kubernetes API client on the credentials kopf logged in with.

kopf owns the watch streams; the handlers use this client for the children (get, list, create,
merge-patch, delete). Errors come back as ApiError with the server's status code and message.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
from typing import Any
from urllib.parse import quote, urlencode

import aiohttp
import kopf

from . import contract as c

_info: kopf.ConnectionInfo | None = None
_sessions: dict[int, aiohttp.ClientSession] = {}

# (group/version, plural) of every kind the operator touches; "" group is the core API.
RESOURCES = {
    "Pod": ("v1", "pods"),
    "ConfigMap": ("v1", "configmaps"),
    "Service": ("v1", "services"),
    "ServiceAccount": ("v1", "serviceaccounts"),
    "PersistentVolumeClaim": ("v1", "persistentvolumeclaims"),
    "Deployment": ("apps/v1", "deployments"),
    "Job": ("batch/v1", "jobs"),
    "Role": ("rbac.authorization.k8s.io/v1", "roles"),
    "RoleBinding": ("rbac.authorization.k8s.io/v1", "rolebindings"),
    c.SERVICE_KIND: (c.API_VERSION, c.SERVICE_PLURAL),
    c.DRAFTER_KIND: (c.API_VERSION, c.DRAFTER_PLURAL),
}


class ApiError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.message = message


def configure(info: kopf.ConnectionInfo) -> None:
    """Use these credentials (called from the operator's login handler)."""
    global _info
    _info = info
    _sessions.clear()


def path(kind: str, namespace: str, name: str | None = None, sub: str | None = None) -> str:
    api, plural = RESOURCES[kind]
    root = f"/api/{api}" if "/" not in api else f"/apis/{api}"
    p = f"{root}/namespaces/{quote(namespace)}/{plural}"
    if name:
        p += f"/{quote(name)}"
    if sub:
        p += f"/{sub}"
    return p


def _session() -> aiohttp.ClientSession:
    if _info is None:
        raise RuntimeError("kube.configure() was not called: the operator has not logged in")
    loop = asyncio.get_running_loop()
    s = _sessions.get(id(loop))
    if s is None or s.closed:
        headers = {"Accept": "application/json", **_info.as_http_headers()}
        conn = aiohttp.TCPConnector(ssl=_info.as_ssl_context())
        s = aiohttp.ClientSession(headers=headers, connector=conn,
                                  timeout=aiohttp.ClientTimeout(total=30))
        _sessions[id(loop)] = s
    return s


async def close() -> None:
    for s in list(_sessions.values()):
        await s.close()
    _sessions.clear()


SA_TOKEN = "/var/run/secrets/kubernetes.io/serviceaccount/token"


async def _refresh_token() -> bool:
    """Bound service-account tokens rotate; re-read the mounted one after a 401."""
    global _info
    if _info is None or not os.path.exists(SA_TOKEN):
        return False
    with open(SA_TOKEN, encoding="utf-8") as f:
        token = f.read().strip()
    if not token or token == _info.token:
        return False
    _info = dataclasses.replace(_info, token=token)
    await close()  # the next request opens a session with the new token
    return True


async def _request(method: str, url: str, body: Any = None,
                   content_type: str = "application/json", _retry: bool = True) -> Any:
    data = json.dumps(body) if body is not None else None
    headers = {"Content-Type": content_type} if data is not None else {}
    session = _session()  # raises a clear error before the first login
    assert _info is not None
    full = _info.server.rstrip("/") + url
    async with session.request(method, full, data=data, headers=headers) as r:
        status, text = r.status, await r.text()
    if status == 401 and _retry and await _refresh_token():
        return await _request(method, url, body, content_type, _retry=False)
    if status >= 400:
        try:
            msg = json.loads(text).get("message", text)
        except (ValueError, AttributeError):
            msg = text
        raise ApiError(status, f"{method} {url}: {msg}")
    return json.loads(text) if text else None


async def get(kind: str, namespace: str, name: str) -> dict | None:
    try:
        return await _request("GET", path(kind, namespace, name))
    except ApiError as e:
        if e.status == 404:
            return None
        raise


async def list_(kind: str, namespace: str, selector: dict[str, str] | None = None) -> list[dict]:
    url = path(kind, namespace)
    if selector:
        url += "?" + urlencode({"labelSelector": ",".join(f"{k}={v}" for k, v in selector.items())})
    result = await _request("GET", url)
    items = (result or {}).get("items") or []
    if selector:  # a server that ignores labelSelector must not widen what we act on
        items = [i for i in items
                 if all(((i.get("metadata") or {}).get("labels") or {}).get(k) == v
                        for k, v in selector.items())]
    return items


async def create(body: dict) -> dict:
    meta = body["metadata"]
    return await _request("POST", path(body["kind"], meta["namespace"]), body)


async def patch(kind: str, namespace: str, name: str, body: dict, sub: str | None = None) -> dict:
    return await _request("PATCH", path(kind, namespace, name, sub), body,
                          "application/merge-patch+json")


async def delete(kind: str, namespace: str, name: str) -> None:
    try:
        await _request("DELETE", path(kind, namespace, name),
                       {"kind": "DeleteOptions", "apiVersion": "v1",
                        "propagationPolicy": "Background"})
    except ApiError as e:
        if e.status != 404:
            raise
