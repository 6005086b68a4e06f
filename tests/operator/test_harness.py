"""The kmock harness answers as the API server does where the operator's correctness depends on
it: a JSON patch whose `test` fails is a 422 (kopf re-reads and retries on its next cycle; the
500 kmock gave instead was retried unchanged until kopf gave up, a flake in
test_delete_removes_children_through_owner_references), and every write moves the
resourceVersion."""

from __future__ import annotations

import pytest
from operator_harness import Cluster

JSON_PATCH = "application/json-patch+json"


def _pod(cluster: Cluster, name: str) -> dict:
    return cluster.create({"apiVersion": "v1", "kind": "Pod",
                           "metadata": {"name": name, "namespace": "ns", "finalizers": ["x/y"]},
                           "spec": {"containers": [{"name": "c", "image": "i"}]}})


def test_a_failed_json_patch_test_is_a_422_and_changes_nothing(cluster: Cluster) -> None:
    rv = _pod(cluster, "p")["metadata"]["resourceVersion"]
    stale = [{"op": "test", "path": "/metadata/resourceVersion", "value": rv + "0"},
             {"op": "remove", "path": "/metadata/finalizers"}]
    with pytest.raises(AssertionError, match=r"PATCH .*: 422 .*Invalid.*rejected our request"):
        cluster.request("PATCH", "/api/v1/namespaces/ns/pods/p", stale, JSON_PATCH)
    live = cluster.get("Pod", "ns", "p")
    assert live["metadata"]["finalizers"] == ["x/y"] and live["metadata"]["resourceVersion"] == rv


def test_a_json_patch_that_passes_applies_and_moves_the_resource_version(cluster: Cluster) -> None:
    rv = _pod(cluster, "q")["metadata"]["resourceVersion"]
    ops = [{"op": "test", "path": "/metadata/resourceVersion", "value": rv},
           {"op": "remove", "path": "/metadata/finalizers"}]
    cluster.request("PATCH", "/api/v1/namespaces/ns/pods/q", ops, JSON_PATCH)
    live = cluster.get("Pod", "ns", "q")
    assert "finalizers" not in live["metadata"]
    assert int(live["metadata"]["resourceVersion"]) > int(rv)
    # the same patch again holds a stale test now
    with pytest.raises(AssertionError, match=r": 422 "):
        cluster.request("PATCH", "/api/v1/namespaces/ns/pods/q", ops, JSON_PATCH)
