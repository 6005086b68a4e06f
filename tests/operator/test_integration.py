"""The operator against kmock over real HTTP and watch streams (kopf's KopfRunner).

kmock runs no controllers: the tests play the kubelet (pods of the Deployment, the annotations a
serving pod's reload agent writes), the Job controller (a pod with a termination message, the
Job's terminal condition) and the garbage collector.
"""

from __future__ import annotations

import contextlib
import json
import socket
import time
import urllib.request
from collections.abc import Iterator

import pytest
from adaflash_operator import contract as c
from adaflash_operator.__main__ import kopf_args, parser
from kopf.testing import KopfRunner
from operator_harness import (
    Cluster,
    annotate,
    events,
    finish_job,
    garbage_collect,
    kubelet_start_pods,
    wait_for,
)

# kmock 0.8 loads its bundled resources with a deprecated importlib call.
pytestmark = pytest.mark.filterwarnings("ignore:read_binary is deprecated:DeprecationWarning")

# Owned by the AdaFlashService; the shared volume's claim is kept unless asked (CLAIM).
CHILDREN = [("ConfigMap", "qwen-drafter"), ("ServiceAccount", "qwen-serving"),
            ("Role", "qwen-serving"), ("RoleBinding", "qwen-serving"), ("Deployment", "qwen"),
            ("Service", "qwen"), ("CronJob", "qwen-retention"), ("Secret", "qwen-admin"),
            ("ServiceAccount", "qwen-jobs"), ("PodDisruptionBudget", "qwen")]
CLAIM = ("PersistentVolumeClaim", "qwen-home")


@contextlib.contextmanager
def operator(namespace: str, *extra: str) -> Iterator[KopfRunner]:
    """The operator with the kopf command line that `python -m adaflash_operator run` builds."""
    opts = parser().parse_args(["run", "-n", namespace, "--health-port", "0", *extra])
    with KopfRunner(kopf_args(opts), timeout=30) as runner:
        yield runner
    assert runner.exception is None, runner.output
    assert "Traceback" not in runner.output, runner.output


def afs(namespace: str, name: str = "qwen", **spec_over) -> dict:
    spec = {"model": {"target": "Qwen/Qwen3-8B"}, "replicas": 2,
            "serving": {"image": "ghcr.io/example/adaflash-sglang:0.1", "logTraffic": True},
            "distillation": {"minNewRecords": 100, "backoffSeconds": 1},
            "rollout": {"canaryFraction": 0.5, "bakeSeconds": 1, "loadTimeoutSeconds": 20}}
    spec.update(spec_over)
    return {"apiVersion": c.API_VERSION, "kind": c.SERVICE_KIND,
            "metadata": {"name": name, "namespace": namespace}, "spec": spec}


def report(version: str = "v000002", tau: float = 5.0, parent_tau: float = 4.5) -> str:
    return json.dumps({
        "version": version, "parent": "v000001", "created": "2026-11-30T09:00:00Z",
        "target": {"name": "Qwen/Qwen3-8B", "sha256": "ab" * 32},
        "training": {"algorithm": "opd-rkl", "records": 200, "steps": 20, "finalLoss": 0.4},
        "eval": {"tau": {"chat": tau, "code": tau + 1}, "parentTau": {"chat": parent_tau,
                                                                     "code": parent_tau + 1}},
    })


def status(cl: Cluster, ns: str, name: str = "qwen") -> dict:
    return (cl.get(c.SERVICE_KIND, ns, name) or {}).get("status") or {}


def condition(cl: Cluster, ns: str, type_: str) -> dict:
    return next((x for x in status(cl, ns).get("conditions") or [] if x["type"] == type_), {})


def dv_phase(cl: Cluster, ns: str, version: str) -> str | None:
    dv = cl.get(c.DRAFTER_KIND, ns, f"qwen-{version}")
    return ((dv or {}).get("status") or {}).get("phase")


def fleet_version(cl: Cluster, ns: str) -> str:
    return cl.get("ConfigMap", ns, "qwen-drafter")["data"][c.FLEET_VERSION_KEY]


def desired(cl: Cluster, ns: str) -> dict[str, str]:
    return {p["metadata"]["name"]: p["metadata"]["annotations"].get(c.DESIRED_VERSION)
            for p in cl.list("Pod", ns, {c.LABEL_COMPONENT: "serving"})
            if p["metadata"]["annotations"].get(c.DESIRED_VERSION)}


def publish(cl: Cluster, ns: str, pods: list[str], rep: str, job: str = "qwen-distill-1-1") -> None:
    """Traffic reaches the trigger, the operator starts a Job, and the Job publishes `rep`."""
    for p in pods:
        annotate(cl, ns, p, records="60")
    wait_for(f"Job {job}", lambda: cl.get("Job", ns, job))
    finish_job(cl, ns, job, ok=True, message=rep)


def test_create_makes_children_and_applies_spec_changes(cluster: Cluster, namespace: str,
                                                        kubeconfig) -> None:
    ns = namespace
    with operator(ns):
        owner = cluster.create(afs(ns))
        for kind, name in CHILDREN + [CLAIM]:
            wait_for(f"{kind} {name}", lambda k=kind, n=name: cluster.get(k, ns, n))
        uid = owner["metadata"]["uid"]
        for kind, name in CHILDREN:
            refs = cluster.get(kind, ns, name)["metadata"]["ownerReferences"]
            assert refs == [{"apiVersion": c.API_VERSION, "kind": c.SERVICE_KIND, "name": "qwen",
                             "uid": uid, "controller": True, "blockOwnerDeletion": True}], kind
        assert "ownerReferences" not in cluster.get(*CLAIM[:1], ns, CLAIM[1])["metadata"]
        assert fleet_version(cluster, ns) == "v000001"
        kubelet_start_pods(cluster, ns, "qwen")
        wait_for("2 ready pods in status", lambda: status(cluster, ns).get("readyReplicas") == 2)
        st = status(cluster, ns)
        assert st["servingVersion"] == "v000001" and st["tau"] == 4.0
        assert st["selector"] == f"{c.LABEL_SERVICE}=qwen,{c.LABEL_COMPONENT}=serving"
        assert condition(cluster, ns, "Ready")["status"] == "True"
        assert [p["loadedVersion"] for p in st["pods"]] == ["v000001", "v000001"]

        # Spec changes reach the children in place.
        cluster.patch(c.SERVICE_KIND, ns, "qwen", {"spec": {
            "replicas": 3, "serving": {"extraArgs": ["--mem-fraction-static", "0.8"]}}})
        dep = wait_for("the Deployment to follow the spec", lambda: (
            d := cluster.get("Deployment", ns, "qwen"))["spec"]["replicas"] == 3 and d)
        args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
        assert args[-2:] == ["--mem-fraction-static", "0.8"]

        # A child deleted by hand comes back.
        cluster.delete("Service", ns, "qwen")
        wait_for("the Service to be recreated", lambda: cluster.get("Service", ns, "qwen"))


def test_job_success_gate_canary_promote(cluster: Cluster, namespace: str, kubeconfig) -> None:
    ns = namespace
    with operator(ns):
        cluster.create(afs(ns))
        wait_for("the Deployment", lambda: cluster.get("Deployment", ns, "qwen"))
        pods = kubelet_start_pods(cluster, ns, "qwen", tau=4.0)
        wait_for("the pods in status", lambda: status(cluster, ns).get("readyReplicas") == 2)
        assert cluster.get("Job", ns, "qwen-distill-1-1") is None  # 0 < 100 records
        publish(cluster, ns, pods, report("v000002", tau=5.0, parent_tau=4.5))

        wait_for("the candidate to go canary", lambda: dv_phase(cluster, ns, "v000002") == "Canary")
        dv = cluster.get(c.DRAFTER_KIND, ns, "qwen-v000002")
        assert dv["spec"]["parent"] == "v000001" and dv["spec"]["jobName"] == "qwen-distill-1-1"
        assert dv["metadata"]["ownerReferences"][0]["name"] == "qwen"
        assert dv["status"]["evalTau"] == 5.5 and dv["status"]["baselineTau"] == 5.0
        canary = wait_for("one canary pod", lambda: desired(cluster, ns))
        assert list(canary.values()) == ["v000002"] and len(canary) == 1
        assert fleet_version(cluster, ns) == "v000001"
        assert status(cluster, ns)["candidateVersion"] == "v000002"

        (pod,) = canary
        annotate(cluster, ns, pod, loaded="v000002", tau="4.6")
        wait_for("promotion", lambda: dv_phase(cluster, ns, "v000002") == "Serving")
        wait_for("the fleet ConfigMap", lambda: fleet_version(cluster, ns) == "v000002")
        wait_for("canary annotations removed", lambda: desired(cluster, ns) == {})
        st = wait_for("status", lambda: (s := status(cluster, ns))["servingVersion"] == "v000002"
                      and s)
        assert st["latestVersion"] == "v000002" and st["rollout"]["phase"] == "Promoted"
        assert cluster.get(c.DRAFTER_KIND, ns, "qwen-v000002")["status"]["liveTau"] == 4.6
        history = [h["phase"] for h in dv_history(cluster, ns, "v000002")]
        assert history == ["Candidate", "Canary", "Serving"]
        reasons = {e.get("reason") for e in events(cluster, ns)}
        assert {"DistillationStarted", "Published", "GatePassed", "CanaryStarted",
                "Promoted"} <= reasons

        # Roll back by editing the spec: pin the previous version.
        cluster.patch(c.SERVICE_KIND, ns, "qwen", {"spec": {"drafter": {"pinnedVersion": "v000001"}}})
        wait_for("the pin", lambda: fleet_version(cluster, ns) == "v000001")
        wait_for("v000002 retired", lambda: dv_phase(cluster, ns, "v000002") == "Retired")


def dv_history(cl: Cluster, ns: str, version: str) -> list[dict]:
    return cl.get(c.DRAFTER_KIND, ns, f"qwen-{version}")["status"]["history"]


def test_worse_candidate_is_rejected(cluster: Cluster, namespace: str, kubeconfig) -> None:
    ns = namespace
    with operator(ns):
        cluster.create(afs(ns, rollout={"minTauGain": 0.02, "bakeSeconds": 1}))
        wait_for("the Deployment", lambda: cluster.get("Deployment", ns, "qwen"))
        pods = kubelet_start_pods(cluster, ns, "qwen")
        publish(cluster, ns, pods, report("v000002", tau=4.55, parent_tau=4.5))  # +1%, need +2%
        wait_for("rejection", lambda: dv_phase(cluster, ns, "v000002") == "Rejected")
        dv = cluster.get(c.DRAFTER_KIND, ns, "qwen-v000002")
        assert dv["status"]["reason"] == "GateFailed"
        assert "< required" in dv["status"]["message"]
        assert desired(cluster, ns) == {} and fleet_version(cluster, ns) == "v000001"
        assert status(cluster, ns)["rollout"]["phase"] == "Rejected"
        # The pods' admin call learns it from the fleet ConfigMap (mounted next to the version).
        wait_for("v000002 in the blocked versions", lambda: cluster.get(
            "ConfigMap", ns, "qwen-drafter")["data"][c.BLOCKED_VERSIONS_KEY] == "v000002 Rejected\n")


def test_load_failure_during_canary_rolls_back(cluster: Cluster, namespace: str,
                                               kubeconfig) -> None:
    ns = namespace
    with operator(ns):
        cluster.create(afs(ns))
        wait_for("the Deployment", lambda: cluster.get("Deployment", ns, "qwen"))
        pods = kubelet_start_pods(cluster, ns, "qwen")
        publish(cluster, ns, pods, report("v000002"))
        canary = wait_for("a canary pod", lambda: desired(cluster, ns))
        (pod,) = canary
        annotate(cluster, ns, pod, error="v000002: hidden size 2048 does not match 4096")
        wait_for("rollback", lambda: dv_phase(cluster, ns, "v000002") == "RolledBack")
        dv = cluster.get(c.DRAFTER_KIND, ns, "qwen-v000002")
        assert dv["status"]["reason"] == "LoadFailed" and pod in dv["status"]["message"]
        wait_for("annotation removed", lambda: desired(cluster, ns) == {})
        assert fleet_version(cluster, ns) == "v000001"
        deg = wait_for("Degraded", lambda: (d := condition(cluster, ns, "Degraded")).get(
            "status") == "True" and d)
        assert deg["reason"] == "LoadFailed"


def test_job_failure_is_retried_with_condition(cluster: Cluster, namespace: str,
                                               kubeconfig) -> None:
    ns = namespace
    with operator(ns):
        cluster.create(afs(ns))
        wait_for("the Deployment", lambda: cluster.get("Deployment", ns, "qwen"))
        pods = kubelet_start_pods(cluster, ns, "qwen")
        for p in pods:
            annotate(cluster, ns, p, records="60")
        wait_for("the first Job", lambda: cluster.get("Job", ns, "qwen-distill-1-1"))
        finish_job(cluster, ns, "qwen-distill-1-1", ok=False, exit_code=3,
                   message="CUDA out of memory")
        cond = wait_for("DistillationFailed", lambda: (
            d := condition(cluster, ns, "DistillationFailed")).get("status") == "True" and d)
        assert cond["reason"] == "JobFailed"
        assert "qwen-distill-1-1" in cond["message"] and "CUDA out of memory" in cond["message"]
        assert status(cluster, ns)["distillation"]["consecutiveFailures"] == 1
        # After the backoff (1 s) the same round is tried again, whatever the traffic.
        wait_for("the retry", lambda: cluster.get("Job", ns, "qwen-distill-1-2"), timeout=20)
        assert cluster.get("Job", ns, "qwen-distill-2-1") is None
        # A bad report is a failure too, with a message that says what the Job must write.
        finish_job(cluster, ns, "qwen-distill-1-2", ok=True, message="done!")
        wait_for("the report error", lambda: "not JSON" in condition(
            cluster, ns, "DistillationFailed").get("message", ""))
        wait_for("the third try", lambda: cluster.get("Job", ns, "qwen-distill-1-3"), timeout=20)
        finish_job(cluster, ns, "qwen-distill-1-3", ok=True, message=report("v000002"))
        wait_for("recovery", lambda: condition(cluster, ns, "DistillationFailed").get(
            "status") == "False")
        assert status(cluster, ns)["distillation"]["consecutiveFailures"] == 0
        assert len(cluster.list("Job", ns)) == 3  # never two at a time, no extra Job


def test_restart_mid_rollout_resumes(cluster: Cluster, namespace: str, kubeconfig) -> None:
    ns = namespace
    with operator(ns):
        cluster.create(afs(ns))
        wait_for("the Deployment", lambda: cluster.get("Deployment", ns, "qwen"))
        pods = kubelet_start_pods(cluster, ns, "qwen")
        publish(cluster, ns, pods, report("v000002"))
        canary = wait_for("a canary pod", lambda: desired(cluster, ns))
    # The operator is down while the canary pod loads the candidate.
    (pod,) = canary
    annotate(cluster, ns, pod, loaded="v000002", tau="4.2")
    assert status(cluster, ns)["rollout"]["phase"] == "Canary"
    with operator(ns):
        wait_for("promotion after the restart", lambda: dv_phase(cluster, ns, "v000002") ==
                 "Serving")
        wait_for("the fleet ConfigMap", lambda: fleet_version(cluster, ns) == "v000002")
        phases = [h["phase"] for h in dv_history(cluster, ns, "v000002")]
        assert phases == ["Candidate", "Canary", "Serving"]  # no second canary
    assert len(cluster.list("Job", ns)) == 1
    assert len(cluster.list(c.DRAFTER_KIND, ns)) == 1


def test_delete_removes_children_through_owner_references(cluster: Cluster, namespace: str,
                                                          kubeconfig) -> None:
    ns = namespace
    kinds = [k for k, _ in CHILDREN] + [CLAIM[0], "Job", c.DRAFTER_KIND, c.SERVICE_KIND]
    with operator(ns):
        cluster.create(afs(ns))
        for kind, name in CHILDREN + [CLAIM]:
            wait_for(f"{kind} {name}", lambda k=kind, n=name: cluster.get(k, ns, n))
        pods = kubelet_start_pods(cluster, ns, "qwen")
        publish(cluster, ns, pods, report("v000002"))
        wait_for("the DrafterVersion", lambda: cluster.get(c.DRAFTER_KIND, ns, "qwen-v000002"))
        # The control loop's finalizer: the operator stops it, then lets the object go.
        assert "adaflash.io/operator" in cluster.get(c.SERVICE_KIND, ns, "qwen")["metadata"][
            "finalizers"]
        cluster.delete(c.SERVICE_KIND, ns, "qwen")
        wait_for("the AdaFlashService gone", lambda: cluster.get(c.SERVICE_KIND, ns, "qwen")
                 is None)
        gone = garbage_collect(cluster, ns, kinds)
        assert sorted(gone) == sorted(CHILDREN + [("Job", "qwen-distill-1-1"),
                                                  (c.DRAFTER_KIND, "qwen-v000002")])
        for kind, name in CHILDREN:
            assert cluster.get(kind, ns, name) is None
        assert cluster.get(CLAIM[0], ns, CLAIM[1]) is not None  # the data stays
        # The operator does not bring anything back.
        time.sleep(1.0)
        assert all(cluster.get(k, ns, n) is None for k, n in CHILDREN)


def test_invalid_spec_shows_a_condition(cluster: Cluster, namespace: str, kubeconfig) -> None:
    ns = namespace
    with operator(ns):
        # kmock has no schema validation, as a cluster with a stale CRD would not.
        cluster.create(afs(ns, serving={"image": "x", "blockSize": 1},
                           rollout={"canaryFraction": 1.5}))
        cond = wait_for("Ready=False", lambda: (d := condition(cluster, ns, "Ready")).get(
            "status") == "False" and d)
        assert cond["reason"] == "InvalidSpec"
        assert "spec.serving.blockSize" in cond["message"]
        assert "spec.rollout.canaryFraction" in cond["message"]
        assert cluster.get("Deployment", ns, "qwen") is None
        # Fixing the spec heals it.
        cluster.patch(c.SERVICE_KIND, ns, "qwen", {"spec": {"serving": {"blockSize": 16},
                                                             "rollout": {"canaryFraction": 0.5}}})
        wait_for("the Deployment after the fix", lambda: cluster.get("Deployment", ns, "qwen"))
        wait_for("Ready condition updated", lambda: condition(cluster, ns, "Ready").get(
            "reason") != "InvalidSpec")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_metrics_and_health_probe(cluster: Cluster, namespace: str, kubeconfig,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    ns = namespace
    metrics_port, health_port = _free_port(), _free_port()
    monkeypatch.setenv("ADAFLASH_OPERATOR_METRICS_PORT", str(metrics_port))
    with operator(ns, "--health-port", str(health_port)):
        cluster.create(afs(ns))
        wait_for("the Deployment", lambda: cluster.get("Deployment", ns, "qwen"))
        kubelet_start_pods(cluster, ns, "qwen", tau=4.5)
        wait_for("status", lambda: status(cluster, ns).get("tau") == 4.5)

        def scrape() -> str:
            with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics") as r:
                return r.read().decode()

        text = wait_for("the live tau gauge", lambda: (
            t := scrape()) and f'adaflash_operator_live_tau{{namespace="{ns}",service="qwen"}} 4.5'
            in t and t)
        assert 'adaflash_operator_reconciles_total{result="ok"}' in text
        assert (f'adaflash_operator_serving_version_info{{namespace="{ns}",service="qwen",'
                f'version="v000001"}} 1.0') in text
        with urllib.request.urlopen(f"http://127.0.0.1:{health_port}/healthz") as r:
            assert r.status == 200


def test_interrupted_canary_is_redone(cluster: Cluster, namespace: str, kubeconfig) -> None:
    """The operator died after marking a version Canary but before saving status.rollout."""
    ns = namespace
    owner = cluster.create(afs(ns))
    with operator(ns):
        wait_for("the Deployment", lambda: cluster.get("Deployment", ns, "qwen"))
    kubelet_start_pods(cluster, ns, "qwen")
    dv = json.loads(report("v000002"))
    cluster.create({"apiVersion": c.API_VERSION, "kind": c.DRAFTER_KIND,
                    "metadata": {"name": "qwen-v000002", "namespace": ns,
                                 "labels": {c.LABEL_SERVICE: "qwen"},
                                 "ownerReferences": [{"apiVersion": c.API_VERSION,
                                                      "kind": c.SERVICE_KIND, "name": "qwen",
                                                      "uid": owner["metadata"]["uid"]}]},
                    "spec": {"service": "qwen", "version": "v000002", "parent": "v000001",
                             "eval": dv["eval"]}})
    cluster.patch(c.DRAFTER_KIND, ns, "qwen-v000002", {"status": {"phase": "Canary"}},
                  sub="status")
    assert not status(cluster, ns).get("rollout")
    with operator(ns):
        wait_for("the canary redone", lambda: status(cluster, ns).get("rollout", {}).get(
            "phase") == "Canary")
        assert list(wait_for("a canary pod", lambda: desired(cluster, ns)).values()) == [
            "v000002"]


def test_worse_live_acceptance_rolls_back_after_the_bake(cluster: Cluster, namespace: str,
                                                         kubeconfig) -> None:
    ns = namespace
    with operator(ns):
        cluster.create(afs(ns))
        wait_for("the Deployment", lambda: cluster.get("Deployment", ns, "qwen"))
        pods = kubelet_start_pods(cluster, ns, "qwen", tau=5.0)
        publish(cluster, ns, pods, report("v000002"))
        (pod,) = wait_for("a canary pod", lambda: desired(cluster, ns))
        annotate(cluster, ns, pod, loaded="v000002", tau="4.0")  # -20% against the other pod
        wait_for("baking", lambda: status(cluster, ns).get("rollout", {}).get("phase") in (
            "Baking", "RolledBack"))
        wait_for("rollback", lambda: dv_phase(cluster, ns, "v000002") == "RolledBack")
        dv = cluster.get(c.DRAFTER_KIND, ns, "qwen-v000002")
        assert dv["status"]["reason"] == "LiveTauDrop" and dv["status"]["liveTau"] == 4.0
        wait_for("annotation removed", lambda: desired(cluster, ns) == {})
        assert fleet_version(cluster, ns) == "v000001"
        assert [h["phase"] for h in dv["status"]["history"]] == ["Candidate", "Canary",
                                                                 "RolledBack"]


def test_foreign_job_of_the_same_name_is_not_taken_as_ours(cluster: Cluster, namespace: str,
                                                           kubeconfig) -> None:
    """A 409 on Job create means ours (a pass whose status was lost) only if we control it."""
    ns = namespace
    cluster.create({"apiVersion": "batch/v1", "kind": "Job",
                    "metadata": {"name": "qwen-distill-1-1", "namespace": ns},
                    "spec": {"template": {"spec": {"containers": []}}}})
    with operator(ns):
        cluster.create(afs(ns))
        wait_for("the Deployment", lambda: cluster.get("Deployment", ns, "qwen"))
        pods = kubelet_start_pods(cluster, ns, "qwen")
        for p in pods:
            annotate(cluster, ns, p, records="60")
        cond = wait_for("the conflict", lambda: (
            d := condition(cluster, ns, "DistillationFailed")).get("status") == "True" and d)
        assert cond["reason"] == "JobConflict" and "not controlled by" in cond["message"]
        assert status(cluster, ns)["distillation"].get("activeJob") is None
        # The next attempt gets its own name, and that one is ours.
        job = wait_for("the next attempt", lambda: cluster.get("Job", ns, "qwen-distill-1-2"))
        assert job["metadata"]["ownerReferences"][0]["name"] == "qwen"
        assert "ownerReferences" not in cluster.get("Job", ns, "qwen-distill-1-1")["metadata"]


def test_a_job_without_a_node_is_pending_not_running(cluster: Cluster, namespace: str,
                                                     kubeconfig) -> None:
    ns = namespace
    with operator(ns):
        cluster.create(afs(ns))
        wait_for("the Deployment", lambda: cluster.get("Deployment", ns, "qwen"))
        pods = kubelet_start_pods(cluster, ns, "qwen")
        for p in pods:
            annotate(cluster, ns, p, records="60")
        job = wait_for("the Job", lambda: cluster.get("Job", ns, "qwen-distill-1-1"))
        tmpl = job["spec"]["template"]
        cluster.create({"apiVersion": "v1", "kind": "Pod",
                        "metadata": {"name": "qwen-distill-1-1-abcde", "namespace": ns,
                                     "labels": tmpl["metadata"]["labels"]},
                        "spec": tmpl["spec"],
                        "status": {"phase": "Pending", "conditions": [{
                            "type": "PodScheduled", "status": "False",
                            "reason": "Unschedulable",
                            "message": "0/3 nodes are available: 3 Insufficient nvidia.com/gpu."}]}})
        cond = wait_for("Pending", lambda: "Insufficient nvidia.com/gpu" in (
            d := condition(cluster, ns, "Progressing")).get("message", "") and d)
        assert cond["reason"] == "DistillationPending"
        assert status(cluster, ns)["distillation"]["activeJobPhase"] == "Pending"
        cluster.patch("Pod", ns, "qwen-distill-1-1-abcde",
                      {"status": {"phase": "Running", "conditions": None}}, sub="status")
        wait_for("Running", lambda: condition(cluster, ns, "Progressing").get(
            "reason") == "Distilling")
        assert status(cluster, ns)["distillation"]["activeJobPhase"] == "Running"


def test_the_admin_token_secret_is_made_once_and_reaches_the_pods(cluster: Cluster,
                                                                  namespace: str,
                                                                  kubeconfig) -> None:
    import base64

    ns = namespace
    with operator(ns):
        cluster.create(afs(ns))
        secret = wait_for("the admin Secret", lambda: cluster.get("Secret", ns, "qwen-admin"))
        token = base64.b64decode(secret["data"][c.ADMIN_TOKEN_KEY]).decode()
        assert len(token) >= 32
        dep = wait_for("the Deployment", lambda: cluster.get("Deployment", ns, "qwen"))
        env = {e["name"]: e for e in dep["spec"]["template"]["spec"]["containers"][0]["env"]}
        assert env[c.ENV_ADMIN_TOKEN]["valueFrom"] == {"secretKeyRef": {
            "name": "qwen-admin", "key": c.ADMIN_TOKEN_KEY}}
        assert env[c.ENV_BLOCKED_VERSIONS_FILE]["value"] == c.BLOCKED_VERSIONS_FILE
    with operator(ns):  # a restarted operator keeps the token the pods and people hold
        kubelet_start_pods(cluster, ns, "qwen")
        wait_for("2 ready pods", lambda: status(cluster, ns).get("readyReplicas") == 2)
        assert cluster.get("Secret", ns, "qwen-admin")["data"] == secret["data"]


def test_a_pod_on_an_admin_override_shows_in_status_and_is_no_canary(cluster: Cluster,
                                                                     namespace: str,
                                                                     kubeconfig) -> None:
    ns = namespace
    with operator(ns):
        cluster.create(afs(ns))
        wait_for("the Deployment", lambda: cluster.get("Deployment", ns, "qwen"))
        pods = kubelet_start_pods(cluster, ns, "qwen")
        wait_for("no override", lambda: condition(cluster, ns, "AdminOverride").get(
            "status") == "False")
        annotate(cluster, ns, pods[0], override="v000001")
        cond = wait_for("the override condition", lambda: (
            c_ := condition(cluster, ns, "AdminOverride")).get("status") == "True" and c_)
        assert cond["reason"] == "PodsOverridden" and pods[0] in cond["message"]
        assert "v000001" in cond["message"]
        by_name = {p["name"]: p for p in status(cluster, ns)["pods"]}
        assert by_name[pods[0]]["override"] == "v000001" and "override" not in by_name[pods[1]]
        # A candidate's canary goes to the pod without an override.
        publish(cluster, ns, pods, report("v000002"))
        wait_for("a canary", lambda: desired(cluster, ns))
        assert desired(cluster, ns) == {pods[1]: "v000002"}
        annotate(cluster, ns, pods[0], override=None)
        wait_for("the override cleared", lambda: condition(cluster, ns, "AdminOverride").get(
            "status") == "False")
        assert "override" not in {p["name"]: p for p in status(cluster, ns)["pods"]}[pods[0]]


def test_with_traffic_logging_off_distillation_says_it_has_nothing_to_learn(
        cluster: Cluster, namespace: str, kubeconfig) -> None:
    ns = namespace
    with operator(ns):
        cluster.create(afs(ns, serving={"image": "x", "logTraffic": False},
                           distillation={"minNewRecords": 1, "intervalSeconds": 1}))
        wait_for("the Deployment", lambda: cluster.get("Deployment", ns, "qwen"))
        dep = cluster.get("Deployment", ns, "qwen")
        assert "--log-requests" not in dep["spec"]["template"]["spec"]["containers"][0]["args"]
        pods = kubelet_start_pods(cluster, ns, "qwen")
        for p in pods:
            annotate(cluster, ns, p, records="500")
        d = wait_for("the idle reason", lambda: (
            x := status(cluster, ns).get("distillation") or {}).get("idleReason") and x)
        assert d["idleReason"] == "TrafficLoggingOff" and "nothing to learn" in d["message"]
        time.sleep(2)  # several ticks past the record count and the interval
        assert not cluster.list("Job", ns, {c.LABEL_SERVICE: "qwen"})
        assert not (status(cluster, ns).get("distillation") or {}).get("activeJob")


def test_too_little_traffic_is_a_completed_round_not_a_failure(
        cluster: Cluster, namespace: str, kubeconfig) -> None:
    """A Job that found fewer new records than a round needs completes with a NotEnoughRecords
    report: no DrafterVersion, no failure count, no backoff retry; the next round waits for
    minNewRecords more records."""
    ns = namespace
    with operator(ns):
        cluster.create(afs(ns))
        wait_for("the Deployment", lambda: cluster.get("Deployment", ns, "qwen"))
        pods = kubelet_start_pods(cluster, ns, "qwen")
        for p in pods:
            annotate(cluster, ns, p, records="60")
        wait_for("the first Job", lambda: cluster.get("Job", ns, "qwen-distill-1-1"))
        idle = json.dumps({"outcome": "NotEnoughRecords", "parent": "v000001",
                           "created": "2026-11-30T09:00:00Z",
                           "records": {"usable": 90, "required": 100},
                           "message": "only 90 new usable traffic records"})
        finish_job(cluster, ns, "qwen-distill-1-1", ok=True, message=idle)
        d = wait_for("the outcome", lambda: (
            x := status(cluster, ns).get("distillation") or {}).get("lastOutcome") and x)
        assert d["lastOutcome"] == "NotEnoughRecords" and "90 new usable" in \
            d["lastOutcomeMessage"]
        assert not d.get("consecutiveFailures") and not d.get("retryAfter")
        cond = condition(cluster, ns, "DistillationFailed")
        assert cond["status"] == "False" and cond["reason"] == "NotEnoughRecords"
        assert "NotEnoughRecords" in {e.get("reason") for e in events(cluster, ns)}
        time.sleep(2.5)  # past the 1 s backoff a failure would have waited
        assert [j["metadata"]["name"] for j in cluster.list("Job", ns)] == ["qwen-distill-1-1"]
        assert not cluster.list(c.DRAFTER_KIND, ns)
        for p in pods:  # 100 more records: the next round
            annotate(cluster, ns, p, records="110")
        wait_for("the next round", lambda: cluster.get("Job", ns, "qwen-distill-2-1"))


def _waiting_pods(cluster: Cluster, ns: str) -> list[str]:
    """Play the kubelet of serving pods whose init container waits for the drafter."""
    dep = cluster.get("Deployment", ns, "qwen")
    names = []
    for i in range(dep["spec"]["replicas"]):
        name = f"qwen-5d8f7-{i}"
        cluster.create({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": ns, "annotations": {
                c.TRAFFIC_RECORDS: "0"}, "labels": dep["spec"]["template"]["metadata"]["labels"]},
            "spec": dep["spec"]["template"]["spec"],
            "status": {"phase": "Pending", "conditions": [{"type": "Ready", "status": "False"}],
                       "initContainerStatuses": [{
                           "name": c.WAIT_DRAFTER_CONTAINER, "ready": False, "restartCount": 0,
                           "state": {"running": {"startedAt": "2026-11-30T09:00:00Z"}}}]}})
        names.append(name)
    return names


def test_without_a_drafter_or_a_bootstrap_pods_wait_and_the_condition_says_why(
        cluster: Cluster, namespace: str, kubeconfig) -> None:
    ns = namespace
    with operator(ns):
        cluster.create(afs(ns))
        wait_for("the Deployment", lambda: cluster.get("Deployment", ns, "qwen"))
        _waiting_pods(cluster, ns)
        cond = wait_for("Ready=False DrafterMissing", lambda: (
            x := condition(cluster, ns, "Ready")).get("reason") == "DrafterMissing" and x)
        assert "drafters/v000001/manifest.json" in cond["message"]
        assert "spec.drafter.bootstrap" in cond["message"]
        assert all(p["waitingForDrafter"] for p in status(cluster, ns)["pods"])
        assert "DrafterMissing" in {e.get("reason") for e in events(cluster, ns)}


def test_a_bootstrap_job_makes_the_first_drafter_before_any_round(
        cluster: Cluster, namespace: str, kubeconfig) -> None:
    """spec.drafter.bootstrap: the Job starts at once, a failed one is retried after the
    backoff, pods wait (Ready=False Bootstrapping), no round starts before it succeeded."""
    ns = namespace
    with operator(ns):
        cluster.create(afs(ns, drafter={"bootstrap": {"source": "Import",
                                                      "path": "seed/dflash"}},
                           distillation={"minNewRecords": 1, "backoffSeconds": 1}))
        wait_for("the bootstrap Job", lambda: cluster.get("Job", ns, "qwen-bootstrap-1"))
        job = cluster.get("Job", ns, "qwen-bootstrap-1")
        assert job["spec"]["template"]["spec"]["containers"][0]["command"] == [
            "python", "-m", "training_job.bootstrap"]
        pods = _waiting_pods(cluster, ns)
        for p in pods:
            annotate(cluster, ns, p, records="50")
        wait_for("Ready=False Bootstrapping", lambda: condition(cluster, ns, "Ready").get(
            "reason") == "Bootstrapping")
        finish_job(cluster, ns, "qwen-bootstrap-1", ok=False, message="bootstrap: no such "
                   "directory", container=c.BOOTSTRAP_CONTAINER)
        b = wait_for("the failure", lambda: (x := status(cluster, ns).get("bootstrap") or {})
                     .get("phase") == "Failed" and x)
        assert "no such directory" in b["message"]
        assert condition(cluster, ns, "BootstrapFailed")["status"] == "True"
        wait_for("the retry", lambda: cluster.get("Job", ns, "qwen-bootstrap-2"))
        assert not cluster.list("Job", ns, {c.LABEL_COMPONENT: "distill"})
        assert (status(cluster, ns).get("distillation") or {}).get("idleReason") == \
            "Bootstrapping"
        finish_job(cluster, ns, "qwen-bootstrap-2", ok=True, container=c.BOOTSTRAP_CONTAINER,
                   message=json.dumps({"outcome": "Imported", "version": "v000001",
                                       "message": "imported v000001"}))
        b = wait_for("bootstrap Succeeded", lambda: (
            x := status(cluster, ns).get("bootstrap") or {}).get("phase") == "Succeeded" and x)
        assert (b["outcome"], b["version"], b["attempts"]) == ("Imported", "v000001", 2)
        assert {"BootstrapStarted", "BootstrapFailed", "BootstrapSucceeded"} <= {
            e.get("reason") for e in events(cluster, ns)}
        wait_for("the first round", lambda: cluster.get("Job", ns, "qwen-distill-1-1"))
