"""handlers.save_status against kmock (which moves the resourceVersion on every write and
refuses a merge patch with a stale one, as the API server does): a write that touched neither
the spec nor the status between the pass's read and its save (kopf's own annotations) does not
lose the pass's status; a status or spec write does (the pass redoes from a fresh read)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from adaflash_operator import contract as c
from adaflash_operator import handlers, kube
from operator_harness import Cluster

pytestmark = pytest.mark.filterwarnings("ignore:read_binary is deprecated:DeprecationWarning")

ROLLOUT = {"rollout": {"version": "v000002", "phase": "Canary"}}


def _afs(cluster: Cluster, ns: str) -> dict:
    return cluster.create({"apiVersion": c.API_VERSION, "kind": c.SERVICE_KIND,
                           "metadata": {"name": "qwen", "namespace": ns},
                           "spec": {"model": {"target": "t"}, "serving": {"image": "i"}}})


def _save(kubeconfig: Path, body: dict, status: dict) -> bool:
    async def main() -> bool:
        await kube.load_config(str(kubeconfig))
        try:
            return await handlers.save_status(body, status)
        finally:
            await kube.close()
    return asyncio.run(main())


def _status(cluster: Cluster, ns: str) -> dict:
    return cluster.get(c.SERVICE_KIND, ns, "qwen").get("status") or {}


def test_an_annotation_written_meanwhile_does_not_lose_the_status(
        cluster: Cluster, namespace: str, kubeconfig: Path) -> None:
    body = _afs(cluster, namespace)
    # kopf records a finished handler in an annotation: a new resourceVersion.
    cluster.patch(c.SERVICE_KIND, namespace, "qwen", {"metadata": {"annotations": {
        "kopf.adaflash.io/last-handled-configuration": "{}"}}})
    assert cluster.get(c.SERVICE_KIND, namespace, "qwen")["metadata"]["resourceVersion"] != \
        body["metadata"]["resourceVersion"]
    assert _save(kubeconfig, body, ROLLOUT) is True
    assert _status(cluster, namespace)["rollout"] == ROLLOUT["rollout"]


def test_a_status_written_meanwhile_is_a_conflict(cluster: Cluster, namespace: str,
                                                 kubeconfig: Path) -> None:
    body = _afs(cluster, namespace)
    cluster.patch(c.SERVICE_KIND, namespace, "qwen", {"status": {"servingVersion": "v000003"}},
                  sub="status")
    assert _save(kubeconfig, body, ROLLOUT) is False
    assert "rollout" not in _status(cluster, namespace)
    assert _status(cluster, namespace)["servingVersion"] == "v000003"


def test_a_spec_changed_meanwhile_is_a_conflict(cluster: Cluster, namespace: str,
                                                kubeconfig: Path) -> None:
    body = _afs(cluster, namespace)
    # (kmock keeps generation as it is given; the API server moves it with the spec.)
    cluster.patch(c.SERVICE_KIND, namespace, "qwen", {"metadata": {"generation": 2},
                                                      "spec": {"replicas": 3}})
    assert _save(kubeconfig, body, ROLLOUT) is False
    assert "rollout" not in _status(cluster, namespace)
