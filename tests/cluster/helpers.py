"""What the `apiserver` tests share: an AdaFlashService to start from, a distillation report,
status lookups, and the steps a kubelet and a serving pod take (kwok runs the pods; the tests
write what their containers would)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator

from adaflash_operator import contract as c
from controlplane import Api, ApiError, wait_for

IMAGE = "registry.example/adaflash-sglang:0.1"


def afs(ns: str, name: str = "qwen", **over) -> dict:
    """Two serving pods on the CPU nodes, distillation without GPUs (the GPU tests ask for
    them), fast rollouts; `over` merges one level into the spec's objects."""
    spec = {"model": {"target": "Qwen/Qwen3-8B"}, "replicas": 2,
            "serving": {"image": IMAGE, "gpus": 0, "logTraffic": True},
            "distillation": {"minNewRecords": 10, "backoffSeconds": 1, "gpus": 0},
            "rollout": {"canaryFraction": 0.5, "bakeSeconds": 1, "loadTimeoutSeconds": 60}}
    for k, v in over.items():
        spec[k] = {**spec[k], **v} if isinstance(v, dict) and isinstance(spec.get(k), dict) \
            else v
    return {"apiVersion": c.API_VERSION, "kind": c.SERVICE_KIND,
            "metadata": {"name": name, "namespace": ns}, "spec": spec}


def report(version: str = "v000002", tau: float = 5.0, parent: str = "v000001") -> str:
    return json.dumps({
        "version": version, "parent": parent, "created": "2026-11-30T09:00:00Z",
        "target": {"name": "Qwen/Qwen3-8B", "sha256": "ab" * 32},
        "training": {"algorithm": "opd-rkl", "records": 20, "steps": 2, "finalLoss": 0.4},
        "eval": {"tau": {"chat": tau}, "parentTau": {"chat": tau - 0.5}}})


def status(api: Api, ns: str, name: str = "qwen") -> dict:
    return (api.get(c.SERVICE_KIND, ns, name) or {}).get("status") or {}


def condition(api: Api, ns: str, type_: str, name: str = "qwen") -> dict:
    return next((x for x in status(api, ns, name).get("conditions") or []
                 if x["type"] == type_), {})


def dv_phase(api: Api, ns: str, version: str) -> str | None:
    return ((api.get(c.DRAFTER_KIND, ns, f"qwen-{version}") or {}).get("status") or {}).get(
        "phase")


def fleet(api: Api, ns: str) -> str:
    return api.get("ConfigMap", ns, "qwen-drafter")["data"][c.FLEET_VERSION_KEY]


def serving_pods(api: Api, ns: str, name: str = "qwen") -> list[dict]:
    """The serving pods that exist and are not being deleted (kwok removes deleted pods at
    once, so a pod with a deletionTimestamp is seen only briefly)."""
    return [p for p in api.list("Pod", ns, {c.LABEL_SERVICE: name,
                                            c.LABEL_COMPONENT: "serving"})
            if not p["metadata"].get("deletionTimestamp")]


def served(api: Api, path: str) -> bool:
    """Whether GET `path` answers (an API group served, an object there)."""
    try:
        api.request("GET", path)
        return True
    except ApiError:
        return False


@contextlib.contextmanager
def third_party_api(api: Api, group: str, version: str, kind: str,
                    plural: str) -> Iterator[None]:
    """Someone else's API served for the block (its CRD, without a schema, as its own chart
    would install it; e.g. KEDA's ScaledObject), gone after it."""
    crds = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
    api.request("POST", crds, {
        "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.{group}"},
        "spec": {"group": group, "scope": "Namespaced",
                 "names": {"kind": kind, "plural": plural, "singular": kind.lower(),
                           "listKind": f"{kind}List"},
                 "versions": [{"name": version, "served": True, "storage": True,
                               "schema": {"openAPIV3Schema": {
                                   "type": "object",
                                   "x-kubernetes-preserve-unknown-fields": True}}}]}})
    try:
        wait_for(f"{group}/{version} served", lambda: served(api, f"/apis/{group}/{version}"),
                 timeout=60)
        yield
    finally:
        api.request("DELETE", f"{crds}/{plural}.{group}")


def node_prefix(ns: str) -> str:
    """A test's node names start with this: the namespace's unique tail, a valid DNS label
    start (not a '-')."""
    return ns[-20:].lstrip("-")


def ready(pod: dict) -> bool:
    return any(x["type"] == "Ready" and x["status"] == "True"
               for x in (pod.get("status") or {}).get("conditions") or [])


def start_serving_pods(api: Api, ns: str, n: int, name: str = "qwen") -> list[dict]:
    """The ReplicaSet controller makes the pods, the scheduler places them, kwok runs them:
    wait until `n` are Ready on a node."""
    def up() -> list[dict] | None:
        pods = serving_pods(api, ns, name)
        return pods if len(pods) == n and all(p["spec"].get("nodeName") and ready(p)
                                              for p in pods) else None

    pods = wait_for(f"{n} serving pods scheduled and Ready", up, timeout=90)
    return sorted(pods, key=lambda p: p["metadata"]["name"])


def reporter(api: Api, ns: str, pod: dict, name: str = "qwen"):
    """The project's own pod-status code, with the pod's own bound token."""
    from sglang_adaflash.serving.reload import PodAnnotationReporter

    token = api.request_token(ns, f"{name}-serving", pod=pod)
    return PodAnnotationReporter(pod["metadata"]["name"], ns, api_url=api.server, token=token,
                                 ca_file=str(api.ca))


def job_pod(api: Api, ns: str, job: str, running: bool = True) -> dict:
    """The pod the real Job controller made for `job` (scheduled and started by kwok)."""
    def made() -> dict | None:
        pods = api.list("Pod", ns, {"job-name": job})
        if not pods:
            return None
        return pods[0] if not running or (pods[0].get("status") or {}).get(
            "phase") == "Running" else None
    return wait_for(f"the pod of Job {job}{' running' if running else ''}", made, timeout=90)


def finish_job(api: Api, ns: str, job: str, message: str, exit_code: int = 0) -> None:
    """The Job's container ends with `message` as its termination message (the report)."""
    api.kubelet_terminate(ns, job_pod(api, ns, job), c.DISTILL_CONTAINER, exit_code, message)
