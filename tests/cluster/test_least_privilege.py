"""Least privilege, enforced by the API server, in both of the chart's RBAC modes, and two
operator replicas on one Lease (marker `apiserver`).

- The operator's own token (the chart's ServiceAccount) cannot write outside what it manages:
  not a Deployment in kube-system, not an unlabelled object next to its AdaFlashService, not a
  pod template (a JobSet's included) running as another account or privileged, not a broader
  Role, not a pod's labels (the chart's operatorGuard policy), while it can write its own
  children.
- The chart's default (every namespace, a ClusterRole) and `watchNamespaces` (Roles in the
  named namespaces) each run the operator exactly as the chart's Deployment does: its command,
  arguments and environment, a token bound to its pod, leader election on.
- Two replicas: one holds the Lease and acts; killed, the other takes over and carries on.
"""

from __future__ import annotations

import time

import pytest
from adaflash_operator import contract as c
from adaflash_operator import job_manifests, manifests
from adaflash_operator.spec import parse
from conftest import drop_namespace, install, new_namespace
from controlplane import OPERATOR_SA, RELEASE, RELEASE_NS, Api, ApiError, wait_for
from helpers import afs, condition, start_serving_pods, status, third_party_api

pytestmark = pytest.mark.apiserver


def _deployment(ns: str, name: str, sa: str = "default", labels: dict | None = None,
                owners: list | None = None) -> dict:
    meta: dict = {"name": name, "namespace": ns, "labels": labels or {"app": name}}
    if owners:
        meta["ownerReferences"] = owners
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta, "spec": {
        "replicas": 0, "selector": {"matchLabels": {"app": name}},
        "template": {"metadata": {"labels": {"app": name}}, "spec": {
            "serviceAccountName": sa,
            "containers": [{"name": "c", "image": "registry.example/app:1"}]}}}}


def _refused(fn, *needles: str) -> str:
    with pytest.raises(ApiError) as e:
        fn()
    assert e.value.status in (403, 422), e.value
    for needle in needles:
        assert needle in e.value.message, e.value.message
    return e.value.message


def test_the_operators_token_writes_only_what_it_manages(chart, api: Api,
                                                         namespace: str) -> None:
    ns = namespace
    op = api.as_token(api.request_token(RELEASE_NS, OPERATOR_SA))
    # Someone else's Deployment in kube-system: RBAC would let the operator patch it.
    api.create(_deployment("kube-system", f"dns-{ns[-5:]}"))
    _refused(lambda: op.patch("Deployment", "kube-system", f"dns-{ns[-5:]}", {"spec": {
        "template": {"spec": {"serviceAccountName": "admin",
                              "containers": [{"name": "c", "image": "evil:1"}]}}}}),
             "operator-writes")
    _refused(lambda: op.create(_deployment("kube-system", "planted")), "operator-writes")
    # In a namespace with an AdaFlashService: its own children only.
    owner = api.create(afs(ns))
    ref = [manifests.owner_reference(owner)]
    ours = {c.LABEL_MANAGED_BY: c.MANAGED_BY, c.LABEL_SERVICE: "qwen", "app": "x"}
    api.create({"apiVersion": "v1", "kind": "ConfigMap",
                "metadata": {"name": "users-config", "namespace": ns}, "data": {"a": "1"}})
    _refused(lambda: op.patch("ConfigMap", ns, "users-config", {"data": {"a": "2"}}),
             "may only write objects it manages")
    _refused(lambda: op.create(_deployment(ns, "unowned", "qwen-serving", labels=ours)),
             "controlled by the AdaFlashService")
    _refused(lambda: op.create(_deployment(ns, "as-default", "default", labels=ours,
                                           owners=ref)), "own accounts")
    privileged = _deployment(ns, "privileged", "qwen-serving", labels=ours, owners=ref)
    privileged["spec"]["template"]["spec"]["containers"][0]["securityContext"] = {
        "privileged": True}
    _refused(lambda: op.create(privileged), "privileged")
    # (Rights the operator holds itself: RBAC's own escalation check lets it grant them.)
    broad = {**manifests.role(owner), "rules": [{"apiGroups": [""], "resources": ["pods"],
                                                 "verbs": ["get", "list", "patch"]}]}
    _refused(lambda: op.create(broad), "get and patch on pods")
    # What the operator builds passes.
    op.create(manifests.role(owner))
    op.create(manifests.jobs_service_account(owner))
    # Pods: the canary annotation, nothing else.
    api.create({"apiVersion": "v1", "kind": "Pod", "metadata": {
        "name": "serving-x", "namespace": ns, "labels": ours},
        "spec": {"containers": [{"name": "c", "image": "registry.example/app:1"}]}})
    op.patch("Pod", ns, "serving-x", {"metadata": {"annotations": {c.DESIRED_VERSION:
                                                                   "v000002"}}})
    _refused(lambda: op.patch("Pod", ns, "serving-x", {"metadata": {"labels": {"app": "y"}}}),
             "canary annotation")
    _refused(lambda: op.patch("Pod", ns, "serving-x", {"metadata": {"annotations": {
        c.LOADED_VERSION: "v000009"}}}), "canary annotation")
    # Nobody else is held to it: the admin's writes, the controllers' (the namespace's default
    # ServiceAccount came).
    api.patch("ConfigMap", ns, "users-config", {"data": {"a": "3"}})


def test_a_jobset_runs_as_the_services_jobs_account(chart, api: Api, namespace: str) -> None:
    """Where the cluster serves JobSet (multi-node distillation), the operator's JobSets are
    held to the pod-template rules of its Jobs: the JobSet the operator builds passes, one on
    another account or privileged does not."""
    ns = namespace
    with third_party_api(api, "jobset.x-k8s.io", "v1alpha2", "JobSet", "jobsets"):
        op = api.as_token(api.request_token(RELEASE_NS, OPERATOR_SA))
        spec = afs(ns, replicas=1, distillation={"nodes": 2})["spec"]
        owner = api.create(afs(ns, replicas=1, distillation={"nodes": 2}))
        built = job_manifests.job(owner, parse(spec), 1, 1, "v000001", jobset=True)
        assert built["kind"] == "JobSet"

        def variant(name: str, change) -> dict:
            js = job_manifests.job(owner, parse(spec), 1, 1, "v000001", jobset=True)
            js["metadata"]["name"] = name
            change(js["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"])
            return js

        _refused(lambda: op.create(variant("as-default", lambda p: p.update(
            serviceAccountName="default"))), "own accounts")
        _refused(lambda: op.create(variant("privileged", lambda p: p["containers"][0].update(
            securityContext={"privileged": True}))), "privileged")
        op.create(built)


def _chart_pods(api: Api, ns: str, n: int) -> list[dict]:
    def up() -> list[dict] | None:
        pods = [p for p in api.list("Pod", ns, {"app.kubernetes.io/name": "adaflash-operator"})
                if (p.get("status") or {}).get("phase") == "Running"
                and not p["metadata"].get("deletionTimestamp")]
        return pods if len(pods) == n else None
    return sorted(wait_for(f"{n} operator pod(s) running", up, timeout=90),
                  key=lambda p: p["metadata"]["name"])


def _lease_holder(api: Api, ns: str, name: str) -> str | None:
    lease = api.get("Lease", ns, name) or {}
    return (lease.get("spec") or {}).get("holderIdentity")


def test_all_namespaces_mode_two_replicas_one_leader(chart, api: Api, namespace: str,
                                                     operator_process) -> None:
    """The chart's default mode, as its Deployment runs it, twice: one replica leads, the
    other stands by; the leader is killed and the other carries on."""
    ns = namespace
    api.patch("Deployment", RELEASE_NS, RELEASE, {"spec": {"replicas": 2}})
    try:
        pods = _chart_pods(api, RELEASE_NS, 2)
        ops = {p["metadata"]["name"]: operator_process(pod=p) for p in pods}
        for op in ops.values():
            assert "--namespace" not in " ".join(op.args)  # every namespace
        api.create(afs(ns, replicas=1))
        leader = wait_for("a leader", lambda: _lease_holder(api, RELEASE_NS, RELEASE) in ops
                          and _lease_holder(api, RELEASE_NS, RELEASE), timeout=30)
        start_serving_pods(api, ns, 1)
        wait_for("Ready", lambda: condition(api, ns, "Ready").get("status") == "True",
                 timeout=60)
        standby = next(n for n in ops if n != leader)
        time.sleep(2)
        assert _lease_holder(api, RELEASE_NS, RELEASE) == leader
        assert "standing by" in ops[standby].output()
        assert ops[standby].metrics()["adaflash_operator_leader"] == 0.0
        assert ops[leader].metrics()["adaflash_operator_leader"] == 1.0
        ops[leader].stop(kill=True)
        wait_for("the standby leading", lambda: _lease_holder(api, RELEASE_NS, RELEASE)
                 == standby, timeout=30)
        api.patch(c.SERVICE_KIND, ns, "qwen", {"spec": {"replicas": 2}})
        wait_for("the new leader reconciles", lambda: api.get("Deployment", ns, "qwen")[
            "spec"]["replicas"] == 2 and status(api, ns).get("observedGeneration") == 2,
            timeout=60)
        # A clean stop hands the Lease back at once.
        ops[standby].stop()
        wait_for("the Lease released", lambda: not _lease_holder(api, RELEASE_NS, RELEASE),
                 timeout=15)
    finally:
        api.patch("Deployment", RELEASE_NS, RELEASE, {"spec": {"replicas": 1}})


def test_watch_namespaces_mode(chart, control_plane, api: Api, namespace: str,
                               operator_process) -> None:
    """A second release with `operator.watchNamespaces`: Roles in the named namespace only. Its
    operator, run as its Deployment runs it, serves that namespace; RBAC refuses it anywhere
    else."""
    ns = namespace
    release, release_ns = "adaflash-ns", new_namespace(api, "ns-mode", prefix="op-")
    other = new_namespace(api, "elsewhere")
    try:
        install(control_plane, release, release_ns, operator__watchNamespaces=[ns])
        assert api.request("GET", "/apis/rbac.authorization.k8s.io/v1/namespaces/"
                           f"{ns}/roles/{release}")
        with pytest.raises(ApiError):
            api.request("GET", f"/apis/rbac.authorization.k8s.io/v1/clusterroles/{release}")
        (pod,) = _chart_pods(api, release_ns, 1)
        op = operator_process(pod=pod)
        assert f"--namespace={ns}" in op.args
        api.create(afs(ns, replicas=1))
        start_serving_pods(api, ns, 1)
        wait_for("Ready", lambda: condition(api, ns, "Ready").get("status") == "True",
                 timeout=60)
        wait_for("its Lease", lambda: _lease_holder(api, release_ns, release) ==
                 pod["metadata"]["name"], timeout=30)
        # Not watched: nothing happens there, and its token may not write there.
        api.create(afs(other, replicas=1))
        time.sleep(3)
        assert api.get("Deployment", other, "qwen") is None
        token = api.as_token(api.request_token(release_ns, release))
        e = _refused(lambda: token.create({"apiVersion": "v1", "kind": "ConfigMap",
                                           "metadata": {"name": "x", "namespace": other}}))
        assert "forbidden" in e
    finally:
        helm_uninstall(control_plane, release, release_ns)
        drop_namespace(api, other)
        drop_namespace(api, release_ns)


def helm_uninstall(plane, release: str, ns: str) -> None:
    from conftest import helm

    helm(plane, "uninstall", release, "--namespace", ns)
