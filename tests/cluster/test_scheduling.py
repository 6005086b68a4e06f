"""Where the real scheduler puts what the operator makes, on kwok nodes with nvidia.com/gpu and
taints (marker `apiserver`): serving pods and Jobs on GPU nodes, a template change on a full GPU
pool, the scheduler's verdict in status, a single-node claim's Jobs on the serving pod's node,
and a configured topology spread."""

from __future__ import annotations

import pytest
from adaflash_operator import contract as c
from controlplane import Api, wait_for
from helpers import (
    afs,
    condition,
    job_pod,
    node_prefix,
    reporter,
    serving_pods,
    start_serving_pods,
)

pytestmark = pytest.mark.apiserver


def _nodes(pods: list[dict]) -> list[str]:
    return sorted(p["spec"].get("nodeName") or "" for p in pods)


def _rs_pods_ready(api: Api, ns: str, template_hash: str | None = None) -> list[dict]:
    return [p for p in serving_pods(api, ns)
            if template_hash is None or p["metadata"]["labels"].get("pod-template-hash")
            == template_hash]


def test_serving_pods_and_jobs_fill_a_gpu_pool_and_updates_need_no_spare_gpu(
        chart, api: Api, namespace: str, gpu_pool, operator_process) -> None:
    """Two 1-GPU nodes, two 1-GPU serving pods: the pool is full. A new pod template still
    rolls out (maxSurge 0: a pod goes before its replacement comes); with maxSurge 1 the surge
    pod waits, and status says why in the scheduler's words. The distillation Job waits for a
    GPU the same way, and runs once one is free."""
    ns = namespace
    where = gpu_pool(nodes=2, gpus=1)
    operator_process()
    api.create(afs(ns, serving={**where, "gpus": 1}, distillation={"gpus": 1}))
    pods = start_serving_pods(api, ns, 2)
    assert len(set(_nodes(pods))) == 2 and all(n.startswith(node_prefix(ns)) for n in _nodes(pods))
    assert all(p["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"
               for p in pods)
    old = {p["metadata"]["name"] for p in pods}
    # A new template on the full pool (the default strategy).
    api.patch(c.SERVICE_KIND, ns, "qwen", {"spec": {"serving": {"extraArgs": ["--a"]}}})
    wait_for("every pod replaced", lambda: (ps := serving_pods(api, ns)) and len(ps) == 2 and
             not old & {p["metadata"]["name"] for p in ps} and
             all(p["spec"].get("nodeName") for p in ps) and
             all(x["type"] != "Ready" or x["status"] == "True"
                 for p in ps for x in (p.get("status") or {}).get("conditions") or []),
             timeout=120)
    dep = wait_for("the Deployment done", lambda: (d := api.get("Deployment", ns, "qwen"))[
        "status"].get("updatedReplicas") == 2 and d["status"].get("readyReplicas") == 2 and d,
        timeout=60)
    assert dep["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}
    # Surge on a full pool: the extra pod cannot be placed; status says so.
    api.patch(c.SERVICE_KIND, ns, "qwen", {"spec": {"serving": {
        "extraArgs": ["--b"], "updateStrategy": {"maxSurge": 1, "maxUnavailable": 0}}}})
    cond = wait_for("the scheduler's verdict in Ready", lambda: "Insufficient nvidia.com/gpu"
                    in (x := condition(api, ns, "Ready")).get("message", "") and x, timeout=60)
    assert cond["status"] == "True"  # the old pods still serve
    assert "Unschedulable" in cond["message"]
    # The distillation Job on the full pool: pending, with the scheduler's message.
    for p in serving_pods(api, ns):
        if p["spec"].get("nodeName"):
            assert reporter(api, ns, p).update({c.LOADED_VERSION: "v000001",
                                                c.TRAFFIC_RECORDS: "6"})
    jpod = job_pod(api, ns, "qwen-distill-1-1", running=False)
    assert not jpod["spec"].get("nodeName")
    prog = wait_for("DistillationPending", lambda: (x := condition(api, ns, "Progressing")).get(
        "reason") == "DistillationPending" and "nvidia.com/gpu" in x["message"] and x,
        timeout=60)
    assert "qwen-distill-1-1" in prog["message"]
    # Scale the serving pods down: the GPUs free up, the Job's pod is placed and runs.
    api.patch(c.SERVICE_KIND, ns, "qwen", {"spec": {"replicas": 0}})
    jpod = job_pod(api, ns, "qwen-distill-1-1")
    assert jpod["spec"]["nodeName"].startswith(node_prefix(ns))
    wait_for("Distilling", lambda: condition(api, ns, "Progressing").get("reason") ==
             "Distilling", timeout=30)


def test_a_single_node_claims_jobs_run_on_the_serving_pods_node(chart, api: Api,
                                                                namespace: str, gpu_pool,
                                                                operator_process) -> None:
    """ReadWriteOnce: one node can attach the claim. The serving pod takes half of a node's
    CPU, so the scheduler on its own would put a Job on the emptier node; the Job and the
    retention CronJob's pods go to the serving pod's node (the Job's 8 CPUs leave room there
    for the retention pod while the Job runs)."""
    ns = namespace
    where = gpu_pool(nodes=2, gpus=2)
    operator_process()
    api.create(afs(ns, replicas=1, storage={"accessMode": "ReadWriteOnce"},
                   serving={**where, "gpus": 1, "resources": {"requests": {"cpu": "32"}}},
                   distillation={"gpus": 1, "resources": {"requests": {"cpu": "8"}}}))
    (pod,) = start_serving_pods(api, ns, 1)
    node = pod["spec"]["nodeName"]
    claim = api.get("PersistentVolumeClaim", ns, "qwen-home")
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]
    assert reporter(api, ns, pod).update({c.LOADED_VERSION: "v000001",
                                          c.TRAFFIC_RECORDS: "12"})
    jpod = job_pod(api, ns, "qwen-distill-1-1")
    assert jpod["spec"]["nodeName"] == node
    # The retention CronJob's pods: a Job from its template, as the CronJob controller makes.
    cron = api.get("CronJob", ns, "qwen-retention")
    api.create({"apiVersion": "batch/v1", "kind": "Job",
                "metadata": {"name": "retention-now", "namespace": ns},
                "spec": cron["spec"]["jobTemplate"]["spec"]})
    rpod = job_pod(api, ns, "retention-now")
    assert rpod["spec"]["nodeName"] == node
    assert rpod["spec"]["serviceAccountName"] == "qwen-jobs"


def test_a_configured_topology_spread_reaches_the_scheduler(chart, api: Api, namespace: str,
                                                             control_plane,
                                                             operator_process) -> None:
    """Two zones, 4 GPUs in one and 1 in the other, four pods with a hard zone spread of skew
    1: three are placed (2 + 1) and the fourth waits, though it would fit. The default spread
    is soft: all four are placed."""
    ns = namespace
    taint = {"key": "pool", "value": ns, "effect": "NoSchedule"}
    for zone, gpus in (("a", 4), ("b", 1)):
        control_plane.add_node(f"{node_prefix(ns)}-{zone}", gpus=gpus, taints=[taint], labels={
            "pool": ns, "topology.kubernetes.io/zone": f"{ns[-5:]}-{zone}"})
    where = {"nodeSelector": {"pool": ns}, "tolerations": [
        {"key": "pool", "operator": "Equal", "value": ns, "effect": "NoSchedule"}]}
    hard = [{"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone",
             "whenUnsatisfiable": "DoNotSchedule"}]
    operator_process()
    try:
        api.create(afs(ns, replicas=4, serving={**where, "gpus": 1,
                                                "topologySpreadConstraints": hard}))
        wait_for("3 placed, 1 pending", lambda: _nodes(serving_pods(api, ns)).count("") == 1
                 and len(serving_pods(api, ns)) == 4, timeout=60)

        def unschedulable() -> dict | None:
            # the scheduler writes the pending pod's condition after the pod is seen unplaced
            pods = [p for p in serving_pods(api, ns) if not p["spec"].get("nodeName")]
            conds = [x for p in pods for x in p.get("status", {}).get("conditions") or []
                     if x["type"] == "PodScheduled"]
            return conds[0] if conds else None

        cond = wait_for("the pending pod's PodScheduled condition", unschedulable, timeout=60)
        assert "topology spread" in cond["message"], cond
        placed = [n for n in _nodes(serving_pods(api, ns)) if n]
        assert sorted(placed) == sorted([f"{node_prefix(ns)}-a"] * 2 + [f"{node_prefix(ns)}-b"])
        api.patch(c.SERVICE_KIND, ns, "qwen", {"spec": {"serving": {
            "topologySpreadConstraints": None}}})
        wait_for("all 4 placed with the default (soft) spread", lambda: (
            ps := serving_pods(api, ns)) and len(ps) == 4 and all(
            p["spec"].get("nodeName") for p in ps), timeout=120)
    finally:
        for zone in ("a", "b"):
            api.request("DELETE", f"/api/v1/nodes/{node_prefix(ns)}-{zone}")
