"""Test harness: an in-memory cluster (kmock) that the operator reaches over real HTTP and
watch streams, a small synchronous client for the tests, and polling."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable
from typing import Any

import attrs
import jsonpatch
import pytest
from adaflash_operator import contract as c  # noqa: E402
from adaflash_operator import kube  # noqa: E402

kmock = pytest.importorskip("kmock", reason="pip install -e .[dev] brings kmock")
logging.getLogger("aiohttp.access").setLevel(logging.WARNING)  # one line per request otherwise


@attrs.frozen
class _Conflict(kmock.KubernetesError):
    status: int = 409
    reason: str = "Conflict"
    message: str = ("the object has been modified; please apply your changes to the latest "
                    "version")


_REJECTED = "the server rejected our request due to an error in our request"


@attrs.frozen
class _Invalid(kmock.KubernetesError):
    """What the API server answers to a JSON patch whose `test` fails: 422, which kopf reads as
    "newer changes pending" and retries on its next cycle, re-reading the object. kmock answers
    500, which kopf's client retries as is, with the same stale test, until it gives up."""

    status: int = 422
    reason: str = "Invalid"
    message: str = _REJECTED


FIELD_MANAGER = "adaflash-operator"


class _Emulator(kmock.KubernetesEmulator):
    """kmock's emulator, plus a little more of the API server: what it stamps on created objects
    (uid, creationTimestamp, generation, resourceVersion), a resourceVersion that moves on every
    write and is honoured as a precondition in merge patches, and a crude server-side apply
    (the applied sections replace the live ones; the managedFields entry records a digest of
    what was applied). Validation, defaulting and real field ownership are the real server's
    business: tests/cluster."""

    _rv = 1

    def _next_rv(self) -> str:
        _Emulator._rv += 1
        return str(_Emulator._rv)

    @staticmethod
    def _stamp(meta: dict) -> None:
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
        meta.setdefault("uid", str(uuid.uuid4()))
        meta.setdefault("creationTimestamp", time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
        meta.setdefault("generation", 1)

    async def _handle(self, request):  # type: ignore[no-untyped-def]
        ctype = request.headers.get("Content-Type", "")
        if request.action == kmock.action.UPDATE and request.name and \
                isinstance(request.data, list) and request.resource is not None:
            key = (request.resource, request.namespace, request.name)
            obj = self._objects[key] if key in self._objects else None
            if obj is not None and not obj.deleted:
                try:  # a dry run: only its `test` operations can fail here
                    jsonpatch.apply_patch(obj.raw, request.data, in_place=False)
                except jsonpatch.JsonPatchTestFailed as e:
                    raise _Invalid(message=f"{_REJECTED}: {e}") from None
                except jsonpatch.JsonPatchException:
                    pass  # kmock's own answer to a patch that does not apply
                else:  # every write moves the resourceVersion
                    request.data.append({"op": "add", "path": "/metadata/resourceVersion",
                                         "value": self._next_rv()})
        if request.action == kmock.action.UPDATE and request.name and \
                isinstance(request.data, dict) and request.resource is not None:
            key = (request.resource, request.namespace, request.name)
            obj = self._objects[key] if key in self._objects else None
            missing = obj is None or obj.deleted
            if "apply-patch" in ctype:
                applied = json.loads(json.dumps(request.data))
                meta = applied.setdefault("metadata", {})
                entry = {"manager": request.params.get("fieldManager", ""),
                         "operation": "Apply", "fieldsV1": {"digest": hashlib.sha256(
                             json.dumps(applied, sort_keys=True).encode()).hexdigest()}}
                if missing:
                    self._stamp(meta)
                    meta["resourceVersion"] = self._next_rv()
                    meta["managedFields"] = [entry]
                    async with self._lock:
                        if obj is None:
                            self._objects[key] = applied
                        else:
                            obj.create(applied)
                        raw = self._objects[key].raw
                        await self._buses[request.resource].put({"type": "ADDED", "object": raw})
                    request.data.clear()  # now an empty patch of the object just stored
                    return await super()._handle(request)
                live = obj.raw
                nulls: dict = {k: None for k in applied if k not in ("metadata", "status",
                                                                      "apiVersion", "kind")}
                nulls["metadata"] = {k: None for k in ("labels", "ownerReferences",
                                                       "managedFields") if k in meta or
                                     k == "managedFields"}
                for k in list(live):  # sections we applied before and no longer do
                    if k not in applied and k not in ("metadata", "status", "apiVersion",
                                                      "kind"):
                        nulls[k] = None
                async with self._lock:
                    obj.patch(nulls)
                others = [e for e in (live.get("metadata") or {}).get("managedFields") or []
                          if e.get("manager") != entry["manager"]]
                meta = {k: v for k, v in meta.items() if k in ("labels", "ownerReferences")}
                meta["managedFields"] = others + [entry]
                meta["resourceVersion"] = self._next_rv()
                applied["metadata"] = meta
                request.data.clear()
                request.data.update(applied)
            elif not missing:
                want = (request.data.get("metadata") or {}).get("resourceVersion")
                have = (obj.raw.get("metadata") or {}).get("resourceVersion")
                if want is not None and want != have:
                    raise _Conflict()
                request.data.setdefault("metadata", {})["resourceVersion"] = self._next_rv()
        if request.action == kmock.action.CREATE and isinstance(request.data, dict):
            meta = request.data.setdefault("metadata", {})
            self._stamp(meta)
            meta.setdefault("resourceVersion", self._next_rv())
        return await super()._handle(request)


class Cluster:
    """kmock's Kubernetes emulator on a real TCP port, in its own thread and event loop.

    kmock stores objects and streams watch events but runs no controllers, no admission and no
    garbage collector: tests play the kubelet, the Job controller and the GC through the API.
    """

    def __init__(self) -> None:
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.url = ""
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("kmock did not start")

    def _run(self) -> None:
        asyncio.run(self._serve())

    async def _serve(self) -> None:
        emulator = _Emulator()
        emulator.resources.load_bundled()
        emulator.resources[f"{c.API_VERSION}/{c.SERVICE_PLURAL}"] = kmock.ResourceInfo(
            kind=c.SERVICE_KIND, singular="adaflashservice", namespaced=True,
            shortnames={"afs"}, subresources={"status", "scale"},
            verbs={"get", "list", "watch", "create", "update", "patch", "delete"})
        emulator.resources[f"{c.API_VERSION}/{c.DRAFTER_PLURAL}"] = kmock.ResourceInfo(
            kind=c.DRAFTER_KIND, singular="drafterversion", namespaced=True,
            shortnames={"dv"}, subresources={"status"},
            verbs={"get", "list", "watch", "create", "update", "patch", "delete"})
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        async with emulator, kmock.Server(emulator) as server:
            self.emulator = emulator
            self.url = str(server.url).rstrip("/")
            self._ready.set()
            await self._stop.wait()

    def close(self) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)

    # --- a tiny synchronous client, as kubectl would be ---------------------------------------

    def request(self, method: str, url: str, body: Any = None,
                ctype: str = "application/json") -> Any:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.url + url, data=data, method=method,
                                     headers={"Content-Type": ctype})
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                text = r.read()
        except urllib.error.HTTPError as e:
            if e.code == 404 and method == "GET":
                return None
            raise AssertionError(f"{method} {url}: {e.code} {e.read()[:300]!r}") from e
        return json.loads(text) if text else None

    def get(self, kind: str, ns: str, name: str) -> dict | None:
        return self.request("GET", kube.path(kind, ns, name))

    def list(self, kind: str, ns: str, labels: dict[str, str] | None = None) -> list[dict]:
        items = (self.request("GET", kube.path(kind, ns)) or {}).get("items") or []
        return [i for i in items if all(
            (i["metadata"].get("labels") or {}).get(k) == v for k, v in (labels or {}).items())]

    def create(self, body: dict) -> dict:
        meta = body.setdefault("metadata", {})
        return self.request("POST", kube.path(body["kind"], meta["namespace"]), body)

    def patch(self, kind: str, ns: str, name: str, body: dict, sub: str | None = None) -> dict:
        return self.request("PATCH", kube.path(kind, ns, name, sub), body,
                            "application/merge-patch+json")

    def delete(self, kind: str, ns: str, name: str) -> None:
        self.request("DELETE", kube.path(kind, ns, name))


# --- the parts of Kubernetes that kmock does not run -----------------------------------------


def kubelet_start_pods(cl: Cluster, ns: str, deployment: str, *, loaded: str = "v000001",
                       tau: float | None = 4.0, records: int = 0) -> list[str]:
    """Play the ReplicaSet controller and the kubelet: ready pods from the Deployment's
    template, reporting what a serving pod's reload agent would."""
    dep = cl.get("Deployment", ns, deployment)
    assert dep is not None, f"no Deployment {deployment}"
    names = []
    for i in range(dep["spec"]["replicas"]):
        name = f"{deployment}-5d8f7-{i}"
        ann = {c.LOADED_VERSION: loaded, c.TRAFFIC_RECORDS: str(records)}
        if tau is not None:
            ann[c.ACCEPTANCE_TAU] = str(tau)
        cl.create({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": ns, "annotations": ann,
                         "labels": dep["spec"]["template"]["metadata"]["labels"]},
            "spec": dep["spec"]["template"]["spec"],
            "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]},
        })
        names.append(name)
    return names


def annotate(cl: Cluster, ns: str, pod: str, **ann: str | None) -> None:
    """Play a serving pod's reload agent: annotate its own pod (keys: loaded, tau, error,
    records)."""
    keys = {"loaded": c.LOADED_VERSION, "tau": c.ACCEPTANCE_TAU, "error": c.LOAD_ERROR,
            "records": c.TRAFFIC_RECORDS, "override": c.OVERRIDE}
    cl.patch("Pod", ns, pod, {"metadata": {"annotations": {keys[k]: v for k, v in ann.items()}}})


def finish_job(cl: Cluster, ns: str, job: str, *, ok: bool, message: str = "",
               exit_code: int | None = None, container: str = c.DISTILL_CONTAINER) -> None:
    """Play the Job controller and the kubelet: a pod whose container terminated with
    `message` (the termination log), then the Job's terminal condition."""
    jb = cl.get("Job", ns, job)
    assert jb is not None, f"no Job {job}"
    tmpl = jb["spec"]["template"]
    cl.create({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": f"{job}-x7k2p", "namespace": ns,
                     "labels": {**tmpl["metadata"]["labels"], "job-name": job}},
        "spec": tmpl["spec"],
        "status": {"phase": "Succeeded" if ok else "Failed", "containerStatuses": [{
            "name": container, "ready": False, "restartCount": 0,
            "state": {"terminated": {"exitCode": 0 if ok else (exit_code or 1),
                                     "reason": "Completed" if ok else "Error",
                                     "message": message}}}]},
    })
    cond = {"type": "Complete" if ok else "Failed", "status": "True",
            "reason": "Completed" if ok else "BackoffLimitExceeded",
            "message": "" if ok else "Job has reached the specified backoff limit"}
    status = {"conditions": [cond], "succeeded" if ok else "failed": 1}
    cl.patch("Job", ns, job, {"status": status}, sub="status")


def garbage_collect(cl: Cluster, ns: str, kinds: list[str]) -> list[tuple[str, str]]:
    """Play the garbage collector: delete objects whose owners are gone. Returns what it
    deleted."""
    alive = {o["metadata"].get("uid") for kind in kinds for o in cl.list(kind, ns)}
    gone = []
    for kind in kinds:
        for o in cl.list(kind, ns):
            owners = o["metadata"].get("ownerReferences") or []
            if owners and all(ref["uid"] not in alive for ref in owners):
                cl.delete(kind, ns, o["metadata"]["name"])
                gone.append((kind, o["metadata"]["name"]))
    return gone


def events(cl: Cluster, ns: str) -> list[dict]:
    return (cl.request("GET", f"/api/v1/namespaces/{ns}/events") or {}).get("items") or []


def wait_for(what: str, fn: Callable[[], Any], timeout: float = 30.0, every: float = 0.05) -> Any:
    """Poll `fn` until it returns a truthy value; fail with `what` and the last value."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = fn()
        except (KeyError, TypeError, IndexError) as e:  # object not there yet
            last = e
        if last:
            return last
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}; last: {last!r}")
