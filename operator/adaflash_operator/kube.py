"""The operator's Kubernetes API calls, on kubernetes_asyncio (docs/operator.md, "API client").

kopf owns the watch streams. The handlers use this module for the children: get, list, create,
server-side apply (field manager `adaflash-operator`), merge-patch, delete and pod logs.
kubernetes_asyncio loads the credentials (in-cluster service account with token rotation, or a
kubeconfig, exec plugins included) and does TLS, auth and serialisation. On top of it this
module adds what the library does not do:

- retries: 429 (honouring Retry-After), 500/502/503/504 and dropped connections are retried with
  exponential backoff; a 401 reloads the credentials once (rotated tokens, expired exec tokens);
- one error type: every failure, transport errors included, is an ApiError with the HTTP status
  (0 for a connection that never answered) and the server's message, so the control loop has
  one thing to catch.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
from typing import Any
from urllib.parse import quote

import aiohttp
from kubernetes_asyncio import client as k8s
from kubernetes_asyncio import config as k8s_config
from kubernetes_asyncio.config.config_exception import ConfigException

from . import contract as c

logger = logging.getLogger(__name__)

FIELD_MANAGER = "adaflash-operator"
# Retries of one call: attempts in all, first delay, cap of one delay (seconds).
ATTEMPTS = 5
BACKOFF_S = 0.2
MAX_DELAY_S = 10.0
RETRY_STATUS = (429, 500, 502, 503, 504)
TIMEOUT_S = 30.0

# (group/version, plural) of every kind the operator touches; "v1" is the core API.
RESOURCES = {
    "Pod": ("v1", "pods"),
    "ConfigMap": ("v1", "configmaps"),
    "Service": ("v1", "services"),
    "ServiceAccount": ("v1", "serviceaccounts"),
    "Secret": ("v1", "secrets"),
    "PersistentVolumeClaim": ("v1", "persistentvolumeclaims"),
    "Deployment": ("apps/v1", "deployments"),
    "Job": ("batch/v1", "jobs"),
    "CronJob": ("batch/v1", "cronjobs"),
    "Role": ("rbac.authorization.k8s.io/v1", "roles"),
    "RoleBinding": ("rbac.authorization.k8s.io/v1", "rolebindings"),
    "PodDisruptionBudget": ("policy/v1", "poddisruptionbudgets"),
    "NetworkPolicy": ("networking.k8s.io/v1", "networkpolicies"),
    "HorizontalPodAutoscaler": ("autoscaling/v2", "horizontalpodautoscalers"),
    "ScaledObject": ("keda.sh/v1alpha1", "scaledobjects"),
    "Lease": ("coordination.k8s.io/v1", "leases"),
    "JobSet": ("jobset.x-k8s.io/v1alpha2", "jobsets"),
    c.SERVICE_KIND: (c.API_VERSION, c.SERVICE_PLURAL),
    c.DRAFTER_KIND: (c.API_VERSION, c.DRAFTER_PLURAL),
}
# Which optional APIs the cluster serves, and when that was looked up (discovery is cheap, but
# an API appears when someone installs it: look again after this long).
_apis: dict[str, tuple[bool, float]] = {}
API_RECHECK_S = 300.0


class ApiError(Exception):
    def __init__(self, status: int, message: str, reason: str = ""):
        super().__init__(f"HTTP {status}: {message}" if status else message)
        self.status = status
        self.message = message
        self.reason = reason  # the Status object's reason, e.g. AlreadyExists, Conflict


_config: k8s.Configuration | None = None
_kubeconfig: str | None = None
_clients: dict[int, k8s.ApiClient] = {}


async def load_config(kubeconfig: str | None = None) -> k8s.Configuration:
    """Credentials as kubectl finds them: in a pod its service account, else $KUBECONFIG or
    ~/.kube/config (exec plugins, client certificates, tokens)."""
    global _config, _kubeconfig
    cfg = k8s.Configuration()
    path = kubeconfig or os.environ.get("KUBECONFIG") or None
    if path is None and os.environ.get("KUBERNETES_SERVICE_HOST"):
        try:
            k8s_config.load_incluster_config(client_configuration=cfg)
        except ConfigException:
            await k8s_config.load_kube_config(client_configuration=cfg)
    else:
        await k8s_config.load_kube_config(config_file=path.split(os.pathsep)[0] if path else None,
                                          client_configuration=cfg)
    _config, _kubeconfig = cfg, path
    _clients.clear()  # sessions with the old credentials close lazily (see close())
    return cfg


def configure(cfg: k8s.Configuration) -> None:
    """Use this configuration (tests; the operator calls load_config())."""
    global _config
    _config = cfg
    _clients.clear()


def bearer_token(cfg: k8s.Configuration) -> str | None:
    tok = (cfg.api_key or {}).get("BearerToken") or (cfg.api_key or {}).get("authorization")
    if not tok:
        return None
    return tok[len("Bearer "):] if tok.startswith("Bearer ") else tok


def path(kind: str, namespace: str, name: str | None = None, sub: str | None = None) -> str:
    api, plural = RESOURCES[kind]
    root = f"/api/{api}" if "/" not in api else f"/apis/{api}"
    p = f"{root}/namespaces/{quote(namespace)}/{plural}"
    if name:
        p += f"/{quote(name)}"
    if sub:
        p += f"/{sub}"
    return p


def _client() -> k8s.ApiClient:
    if _config is None:
        raise RuntimeError("kube.load_config() was not called: the operator has not logged in")
    loop = asyncio.get_running_loop()
    cl = _clients.get(id(loop))
    if cl is None:
        cl = k8s.ApiClient(configuration=_config)
        cl.user_agent = f"{FIELD_MANAGER}/{cl.user_agent}"
        _clients[id(loop)] = cl
    return cl


async def close() -> None:
    for cl in list(_clients.values()):
        await cl.close()
    _clients.clear()


def _message(e: k8s.ApiException) -> tuple[str, str]:
    try:
        body = json.loads(e.body or "")
        return str(body.get("message") or e.reason), str(body.get("reason") or "")
    except (ValueError, AttributeError, TypeError):
        return str(e.body or e.reason), ""


def _retry_after(e: k8s.ApiException) -> float | None:
    value = (e.headers or {}).get("Retry-After") if e.headers else None
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


async def _call(method: str, url: str, *, query: list | None = None, body: Any = None,
                content_type: str = "application/json", response: str = "object") -> Any:
    """One API call with retries; raises ApiError."""
    reauthed = False
    delay = BACKOFF_S
    for attempt in range(1, ATTEMPTS + 1):
        wait: float | None = None
        try:
            return await _client().call_api(
                url, method, query_params=list(query or []),
                header_params={"Accept": "application/json", "Content-Type": content_type},
                body=body, response_types_map={200: response, 201: response, 202: response},
                auth_settings=["BearerToken"], _return_http_data_only=True,
                _request_timeout=TIMEOUT_S)
        except k8s.ApiException as e:
            msg, reason = _message(e)
            if e.status == 401 and not reauthed and _config is not None:
                reauthed = True  # a rotated or expired token: load the credentials again
                try:
                    await load_config(_kubeconfig)
                except (ConfigException, OSError) as err:
                    logger.warning(f"reloading credentials after a 401 failed: {err}")
                    raise ApiError(401, f"{method} {url}: {msg}", reason) from e
                continue
            if e.status not in RETRY_STATUS or attempt == ATTEMPTS:
                raise ApiError(e.status or 0, f"{method} {url}: {msg}", reason) from e
            wait = _retry_after(e) if e.status == 429 else None
            why = f"HTTP {e.status}"
        except (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError) as e:
            if attempt == ATTEMPTS:
                raise ApiError(0, f"{method} {url}: {type(e).__name__}: {e}") from e
            why = type(e).__name__
        wait = min(MAX_DELAY_S, wait if wait is not None else delay * (1 + random.random() / 2))
        logger.debug(f"{method} {url}: {why}; retry {attempt}/{ATTEMPTS - 1} in {wait:.1f}s")
        await asyncio.sleep(wait)
        delay *= 2
    raise AssertionError("unreachable")


async def get(kind: str, namespace: str, name: str) -> dict | None:
    try:
        return await _call("GET", path(kind, namespace, name))
    except ApiError as e:
        if e.status == 404:
            return None
        raise


async def list_(kind: str, namespace: str, selector: dict[str, str] | None = None) -> list[dict]:
    query = []
    if selector:
        query.append(("labelSelector", ",".join(f"{k}={v}" for k, v in selector.items())))
    result = await _call("GET", path(kind, namespace), query=query)
    items = (result or {}).get("items") or []
    if selector:  # a server that ignores labelSelector must not widen what we act on
        items = [i for i in items
                 if all(((i.get("metadata") or {}).get("labels") or {}).get(k) == v
                        for k, v in selector.items())]
    return items


async def create(body: dict) -> dict:
    meta = body["metadata"]
    return await _call("POST", path(body["kind"], meta["namespace"]), body=body,
                       query=[("fieldManager", FIELD_MANAGER)])


async def apply(body: dict, *, force: bool = True) -> dict:
    """Server-side apply of a whole object we manage (creates it if missing). Fields this
    manager applied before and `body` no longer has are removed by the server."""
    meta = body["metadata"]
    query = [("fieldManager", FIELD_MANAGER)]
    if force:
        query.append(("force", "true"))
    return await _call("PATCH", path(body["kind"], meta["namespace"], meta["name"]), body=body,
                       query=query, content_type="application/apply-patch+yaml")


async def patch(kind: str, namespace: str, name: str, body: dict, sub: str | None = None) -> dict:
    """JSON merge patch. A `metadata.resourceVersion` in `body` makes it conditional: the server
    answers 409 if the object changed since."""
    return await _call("PATCH", path(kind, namespace, name, sub), body=body,
                       query=[("fieldManager", FIELD_MANAGER)],
                       content_type="application/merge-patch+json")


async def delete(kind: str, namespace: str, name: str) -> None:
    try:
        await _call("DELETE", path(kind, namespace, name),
                    body={"kind": "DeleteOptions", "apiVersion": "v1",
                          "propagationPolicy": "Background"})
    except ApiError as e:
        if e.status != 404:
            raise


async def has_api(group_version: str) -> bool:
    """Whether the cluster serves `group_version` (e.g. jobset.x-k8s.io/v1alpha2): discovery
    (`GET /apis/<group>/<version>`, readable by every authenticated client), cached a while."""
    import time

    known = _apis.get(group_version)
    if known is not None and time.monotonic() - known[1] < API_RECHECK_S:
        return known[0]
    try:
        await _call("GET", f"/apis/{group_version}")
        found = True
    except ApiError as e:
        if e.status not in (403, 404):
            raise
        found = False
    _apis[group_version] = (found, time.monotonic())
    return found


async def pod_log(namespace: str, name: str, container: str, limit_bytes: int = 65536) -> str:
    """The tail of a container's log (served by the kubelet through the API server)."""
    return await _call("GET", path("Pod", namespace, name, "log"), response="str",
                       query=[("container", container), ("limitBytes", str(limit_bytes)),
                              ("tailLines", "50")]) or ""


def managed_fields(obj: dict, manager: str = FIELD_MANAGER) -> Any:
    """What `manager` owns in `obj` through apply (fieldsV1), or None."""
    for entry in (obj.get("metadata") or {}).get("managedFields") or []:
        if entry.get("manager") == manager and entry.get("operation") == "Apply" and \
                not entry.get("subresource"):
            return entry.get("fieldsV1")
    return None
