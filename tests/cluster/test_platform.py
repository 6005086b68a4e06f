"""What a platform engineer looks for, through the real API (marker `apiserver`): `kubectl get
afs` with a READY column that is the Ready condition; the autoscaler on queue depth (an HPA the
controller-manager acts on, or a KEDA ScaledObject where KEDA's API is served: detected, not
assumed); the NetworkPolicy of the serving port; the documented CRD upgrade step."""

from __future__ import annotations

import re
import subprocess

import pytest
from adaflash_operator import contract as c
from conftest import ROOT
from controlplane import TOOLS, Api, wait_for
from helpers import afs, condition, served, start_serving_pods, third_party_api

pytestmark = pytest.mark.apiserver


def _kubectl(plane, *args: str) -> subprocess.CompletedProcess:
    r = subprocess.run([str(TOOLS / "kubectl"), "--kubeconfig", str(plane.admin_kubeconfig),
                        *args], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    return r


def test_kubectl_get_afs_shows_the_ready_condition(chart, api: Api, namespace: str,
                                                   control_plane, operator_process) -> None:
    ns = namespace
    operator_process()
    api.create(afs(ns, replicas=1))
    start_serving_pods(api, ns, 1)
    wait_for("Ready", lambda: condition(api, ns, "Ready").get("status") == "True", timeout=60)
    out = _kubectl(control_plane, "-n", ns, "get", "afs", "-o", "wide").stdout
    cols = _columns(out)
    assert cols["READY"] == "True" and cols["PODS"] == "1" and cols["REASON"] == "AllPodsReady"
    assert cols["SERVING"] == "v000001" and cols["CANDIDATE"] == "", out
    # Pods no node can take (kwok would start any pod that fits): Ready stays False. A second
    # service asks for them from its start: patching this one's template and replicas together
    # raced the Deployment controller, which may first scale the old ReplicaSet (whose pods fit)
    # to the new count, and then every pod is ready and Ready is rightly True.
    api.create(afs(ns, name="nofit", replicas=3,
                   serving={"resources": {"requests": {"cpu": "1000"}}}))
    wait_for("Ready False", lambda: condition(api, ns, "Ready", "nofit").get("status") == "False",
             timeout=30)
    cols = _columns(_kubectl(control_plane, "-n", ns, "get", "afs", "nofit", "-o", "wide").stdout)
    assert (cols["READY"], cols["REASON"], cols["REPLICAS"]) == ("False", "PodsNotReady", "3")


def _columns(out: str) -> dict[str, str]:
    """kubectl's table, first row, by column: each value starts where its heading does (an
    empty cell is blank, so splitting on spaces would shift the columns after it)."""
    head, row = out.splitlines()[:2]
    starts = [(m.start(), m.group()) for m in re.finditer(r"\S+", head)]
    ends = [s for s, _ in starts[1:]] + [None]
    return {name: row[s:e].strip() for (s, name), e in zip(starts, ends)}


def test_autoscaling_on_queue_depth(chart, api: Api, namespace: str, control_plane,
                                    operator_process) -> None:
    """Without KEDA: an HPA on the AdaFlashService's scale subresource, which the
    controller-manager reads (the scale and the pods' selector) and tries to fetch the queue
    metric for (no custom-metrics adapter here, so it says so). Once KEDA's API is served and
    a Prometheus address is set: a ScaledObject instead, and the HPA goes."""
    ns = namespace
    first = operator_process()
    api.create(afs(ns, replicas=1, autoscaling={"enabled": True, "minReplicas": 1,
                                                "maxReplicas": 3, "targetQueueDepth": 4}))
    start_serving_pods(api, ns, 1)
    # (The controller-manager looks every 15 s; its first look may come before the operator
    # has written status.selector, the scale's label selector: "missing a selector".)
    def hpa_conditions() -> dict | None:
        x = api.get("HorizontalPodAutoscaler", ns, "qwen") or {}
        conds = {y["type"]: y for y in (x.get("status") or {}).get("conditions") or []}
        return conds if "sglang:num_queue_reqs" in conds.get("ScalingActive", {}).get(
            "message", "") else None

    conds = wait_for("the HPA asking for the queue metric", hpa_conditions, timeout=90)
    assert conds["AbleToScale"]["status"] == "True", conds  # it read /scale
    hpa = api.get("HorizontalPodAutoscaler", ns, "qwen")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": c.API_VERSION,
                                             "kind": c.SERVICE_KIND, "name": "qwen"}
    # KEDA appears (its CRD, as its chart installs it).
    with third_party_api(api, "keda.sh", "v1alpha1", "ScaledObject", "scaledobjects"):
        first.stop()  # discovery is cached for minutes: a fresh process looks again
        operator_process()
        api.patch(c.SERVICE_KIND, ns, "qwen", {"spec": {"autoscaling": {
            "prometheusAddress": "http://prometheus.monitoring:9090"}}})
        path = f"/apis/keda.sh/v1alpha1/namespaces/{ns}/scaledobjects/qwen"
        so = wait_for("the ScaledObject", lambda: served(api, path) and api.request(
            "GET", path), timeout=60)
        (trig,) = so["spec"]["triggers"]
        assert trig["metadata"]["query"] == \
            f'sum(sglang:num_queue_reqs{{namespace="{ns}",service="qwen"}})'
        assert so["metadata"]["ownerReferences"][0]["name"] == "qwen"
        wait_for("the HPA gone", lambda: api.get("HorizontalPodAutoscaler", ns, "qwen") is None,
                 timeout=30)
        api.patch(c.SERVICE_KIND, ns, "qwen", {"spec": {"autoscaling": {"enabled": False}}})
        wait_for("the ScaledObject gone", lambda: not served(api, path), timeout=30)


def test_network_policy_of_the_serving_port(chart, api: Api, namespace: str,
                                            operator_process) -> None:
    ns = namespace
    operator_process()
    gateway = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "gw"}}}]
    api.create(afs(ns, serving={"networkPolicy": {"enabled": True, "from": gateway}}))
    pol = wait_for("the NetworkPolicy", lambda: api.get("NetworkPolicy", ns, "qwen"),
                   timeout=60)
    assert pol["spec"]["ingress"] == [{"from": gateway,
                                       "ports": [{"protocol": "TCP", "port": 30000}]}]
    assert pol["spec"]["podSelector"]["matchLabels"][c.LABEL_COMPONENT] == "serving"
    api.patch(c.SERVICE_KIND, ns, "qwen", {"spec": {"serving": {"networkPolicy": {
        "enabled": False}}}})
    wait_for("the NetworkPolicy gone", lambda: api.get("NetworkPolicy", ns, "qwen") is None,
             timeout=30)


def test_the_documented_crd_upgrade_step(chart, api: Api, namespace: str,
                                         control_plane) -> None:
    """Helm never upgrades crds/: docs/operator.md's step (a server-side apply of the chart's
    CRDs) takes over the CRDs Helm installed and keeps the objects."""
    doc = (ROOT / "docs" / "operator.md").read_text()
    step = "kubectl apply --server-side --force-conflicts -f helm/adaflash/crds/"
    assert step in doc
    api.create(afs(namespace))
    _kubectl(control_plane, "apply", "--server-side", "--force-conflicts", "-f",
             str(ROOT / "helm" / "adaflash" / "crds"))
    crd = api.request("GET", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/"
                      "adaflashservices.adaflash.io")
    managers = {m["manager"] for m in crd["metadata"]["managedFields"]}
    assert "kubectl" in managers, managers
    assert api.get(c.SERVICE_KIND, namespace, "qwen") is not None
