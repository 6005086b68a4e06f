"""Pure pieces of the production shape: the CRD's cross-field rules as the operator re-checks
them, placement (spread, co-location with a single-node claim, the Jobs' own account),
graceful shutdown, the PodDisruptionBudget, the NetworkPolicy, the autoscalers, quantities."""

from __future__ import annotations

import pytest
from adaflash_operator import autoscaling, job_manifests, manifests, placement, policies, quantity
from adaflash_operator import contract as c
from adaflash_operator.children import keep_claim_spec
from adaflash_operator.spec import InvalidSpec, parse
from spec_cases import ACCEPTED, REFUSED, merged

MIN = {"model": {"target": "Qwen/Qwen3-8B"}, "serving": {"image": "img:1"}}
OWNER = {"apiVersion": c.API_VERSION, "kind": c.SERVICE_KIND,
         "metadata": {"name": "qwen", "namespace": "ml", "uid": "u-1"}}
SERVING = {c.LABEL_SERVICE: "qwen", c.LABEL_COMPONENT: "serving"}


@pytest.mark.parametrize("over,needle", REFUSED)
def test_the_operator_refuses_what_the_crd_refuses(over: dict, needle: str) -> None:
    with pytest.raises(InvalidSpec) as e:
        parse(merged(MIN, over))
    assert needle in str(e.value)


@pytest.mark.parametrize("over", ACCEPTED)
def test_and_accepts_its_neighbours(over: dict) -> None:
    parse(merged(MIN, over))


def test_serving_pods_spread_softly_over_nodes_and_zones_by_default() -> None:
    pod = manifests.deployment(OWNER, parse(MIN))["spec"]["template"]["spec"]
    spread = pod["topologySpreadConstraints"]
    assert [(x["topologyKey"], x["whenUnsatisfiable"]) for x in spread] == [
        (placement.ZONE, "ScheduleAnyway"), (placement.HOSTNAME, "ScheduleAnyway")]
    assert all(x["labelSelector"] == {"matchLabels": SERVING} for x in spread)
    hard = [{"maxSkew": 1, "topologyKey": placement.HOSTNAME,
             "whenUnsatisfiable": "DoNotSchedule"}]
    s = parse(merged(MIN, {"serving": {"topologySpreadConstraints": hard}}))
    pod = manifests.deployment(OWNER, s)["spec"]["template"]["spec"]
    assert pod["topologySpreadConstraints"] == [{**hard[0], "labelSelector": {
        "matchLabels": SERVING}}]
    s = parse(merged(MIN, {"serving": {"topologySpreadConstraints": []}}))
    assert "topologySpreadConstraints" not in manifests.deployment(OWNER, s)["spec"][
        "template"]["spec"]


def test_shutdown_waits_for_endpoints_then_drains_generations() -> None:
    s = parse(merged(MIN, {"serving": {"shutdown": {"preStopSeconds": 15,
                                                    "drainSeconds": 600}}}))
    pod = manifests.deployment(OWNER, s)["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] == 615
    assert pod["containers"][0]["lifecycle"]["preStop"]["exec"]["command"] == [
        "sh", "-c", "sleep 15"]
    s = parse(merged(MIN, {"serving": {"shutdown": {"preStopSeconds": 0}}}))
    pod = manifests.deployment(OWNER, s)["spec"]["template"]["spec"]
    assert "lifecycle" not in pod["containers"][0] and pod["terminationGracePeriodSeconds"] == 300


PLACED = {"image": "i", "nodeSelector": {"gpu": "h100"}, "imagePullSecrets": ["regcred"],
          "priorityClassName": "inference", "affinity": {"nodeAffinity": {
              "preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 1, "preference": {
                  "matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]}}]}}}


def test_jobs_and_cronjob_run_as_their_own_account_with_the_serving_placement() -> None:
    s = parse({**MIN, "serving": PLACED, "distillation": {"priorityClassName": "batch"},
               "drafter": {"bootstrap": {"source": "Train"}}})
    dep = manifests.deployment(OWNER, s)["spec"]["template"]["spec"]
    assert dep["imagePullSecrets"] == [{"name": "regcred"}]
    assert dep["priorityClassName"] == "inference" and dep["affinity"] == PLACED["affinity"]
    job = job_manifests.job(OWNER, s, 1, 1, "v000001")["spec"]["template"]["spec"]
    cron = job_manifests.retention_cronjob(OWNER, s)["spec"]["jobTemplate"]["spec"]["template"][
        "spec"]
    boot = job_manifests.bootstrap_job(OWNER, s, 1)["spec"]["template"]["spec"]
    # Every Job shape: an Indexed Job over several nodes, and each pod of a JobSet.
    multi = parse({**MIN, "serving": PLACED, "distillation": {"priorityClassName": "batch",
                                                              "nodes": 2}})
    indexed = job_manifests.job(OWNER, multi, 1, 1, "v000001")["spec"]["template"]["spec"]
    jobset = job_manifests.job(OWNER, multi, 1, 1, "v000001", jobset=True)["spec"][
        "replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    for pod in (job, cron, boot, indexed, jobset):
        assert pod["serviceAccountName"] == "qwen-jobs"
        assert pod["automountServiceAccountToken"] is False
        assert pod["imagePullSecrets"] == [{"name": "regcred"}]
        assert pod["nodeSelector"] == {"gpu": "h100"} and pod["priorityClassName"] == "batch"
        assert pod["affinity"] == PLACED["affinity"]  # ReadWriteMany: no co-location
    sa = manifests.jobs_service_account(OWNER)
    assert sa["metadata"]["name"] == "qwen-jobs" and sa["automountServiceAccountToken"] is False


@pytest.mark.parametrize("mode", ["ReadWriteOnce"])
def test_a_single_node_claim_puts_the_jobs_on_the_serving_pods_node(mode: str) -> None:
    s = parse({**MIN, "serving": PLACED, "storage": {"accessMode": mode},
               "drafter": {"bootstrap": {"source": "Import", "path": "seed"}}})
    job = job_manifests.job(OWNER, s, 1, 1, "v000001")["spec"]["template"]["spec"]
    cron = job_manifests.retention_cronjob(OWNER, s)["spec"]["jobTemplate"]["spec"]["template"][
        "spec"]
    boot = job_manifests.bootstrap_job(OWNER, s, 1)["spec"]["template"]["spec"]
    for pod in (job, cron, boot):
        (term,) = pod["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        assert term == {"labelSelector": {"matchLabels": SERVING},
                        "topologyKey": "kubernetes.io/hostname"}
        assert pod["affinity"]["nodeAffinity"] == PLACED["affinity"]["nodeAffinity"]
    # Scaled to zero, nobody holds the claim: anywhere will do.
    s0 = parse({**MIN, "replicas": 0, "storage": {"accessMode": mode}})
    assert "affinity" not in job_manifests.job(OWNER, s0, 1, 1, "v000001")["spec"]["template"][
        "spec"]
    # An existing claim: its modes come from the cluster.
    sx = parse({**MIN, "storage": {"existingClaim": "shared"}})
    pod = job_manifests.job(OWNER, sx, 1, 1, "v000001", ["ReadWriteOnce"])["spec"]["template"][
        "spec"]
    assert "podAffinity" in pod["affinity"]
    assert "affinity" not in job_manifests.job(OWNER, sx, 1, 1, "v000001", [])["spec"][
        "template"]["spec"]


def test_pod_disruption_budget_and_network_policy() -> None:
    s = parse(merged(MIN, {"serving": {"podDisruptionBudget": {"maxUnavailable": "25%"}}}))
    pdb = policies.pod_disruption_budget(OWNER, s)
    assert pdb["spec"] == {"selector": {"matchLabels": SERVING}, "maxUnavailable": "25%",
                           "unhealthyPodEvictionPolicy": "AlwaysAllow"}
    assert pdb["metadata"]["ownerReferences"] == [manifests.owner_reference(OWNER)]
    net = policies.network_policy(OWNER, parse(MIN))
    assert net["spec"]["podSelector"] == {"matchLabels": SERVING}
    (rule,) = net["spec"]["ingress"]
    assert rule["from"] == [{"podSelector": {}}]  # by default: this namespace's pods only
    assert rule["ports"] == [{"protocol": "TCP", "port": 30000}]
    gw = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "gateway"}}}]
    s = parse(merged(MIN, {"serving": {"networkPolicy": {"enabled": True, "from": gw}}}))
    assert policies.network_policy(OWNER, s)["spec"]["ingress"][0]["from"] == gw


def test_autoscalers_scale_the_adaflashservice_not_its_deployment() -> None:
    s = parse({**MIN, "autoscaling": {"enabled": True, "minReplicas": 2, "maxReplicas": 6,
                                      "targetQueueDepth": 4}})
    h = autoscaling.hpa(OWNER, s)
    target = {"apiVersion": c.API_VERSION, "kind": c.SERVICE_KIND, "name": "qwen"}
    assert h["spec"]["scaleTargetRef"] == target
    assert (h["spec"]["minReplicas"], h["spec"]["maxReplicas"]) == (2, 6)
    assert h["spec"]["metrics"][0]["pods"] == {"metric": {"name": "sglang:num_queue_reqs"},
                                               "target": {"type": "AverageValue",
                                                          "averageValue": "4"}}
    assert not autoscaling.use_keda(s, keda_served=True)  # no Prometheus address: an HPA
    s = parse({**MIN, "autoscaling": {"enabled": True, "prometheusAddress": "http://prom:9090"}})
    assert autoscaling.use_keda(s, keda_served=True)
    assert not autoscaling.use_keda(s, keda_served=False)  # detected, not assumed
    so = autoscaling.scaled_object(OWNER, s)
    assert so["spec"]["scaleTargetRef"] == target
    (trig,) = so["spec"]["triggers"]
    assert trig["metadata"]["query"] == \
        'sum(sglang:num_queue_reqs{namespace="ml",service="qwen"})'
    assert parse(MIN).autoscaling is None


@pytest.mark.parametrize("text,value", [
    ("200Gi", 200 * 2**30), ("1.5Ti", 3 * 2**39), ("500m", 0.5), ("1e3", 1000), ("2k", 2000),
    (8, 8), ("0.5", 0.5)])
def test_quantities(text, value) -> None:
    assert quantity.parse(text) == value


def test_quantities_compare_like_the_api_server() -> None:
    assert quantity.larger("1024Mi", "1Gi") == "1024Mi"  # equal: keep the first
    assert quantity.larger("1Gi", "2Gi") == "2Gi" and quantity.larger("2G", "1Gi") == "2G"
    with pytest.raises(ValueError, match="not a Kubernetes quantity"):
        quantity.parse("lots")


def test_a_claim_grows_with_the_spec_and_never_shrinks() -> None:
    live = {"spec": {"accessModes": ["ReadWriteMany"], "storageClassName": "nfs",
                     "resources": {"requests": {"storage": "100Gi"}}}}
    grow = manifests.pvc(OWNER, parse({**MIN, "storage": {"size": "150Gi",
                                                          "storageClassName": "nfs"}}))
    assert keep_claim_spec(grow, live)["spec"] == {
        "accessModes": ["ReadWriteMany"], "storageClassName": "nfs",
        "resources": {"requests": {"storage": "150Gi"}}}
    shrink = manifests.pvc(OWNER, parse({**MIN, "storage": {"size": "50Gi"}}))
    assert keep_claim_spec(shrink, live)["spec"]["resources"]["requests"]["storage"] == "100Gi"
