"""Rollouts through the real API, with pods the scheduler places and kwok runs (marker
`apiserver`): a canary pod evicted under the PodDisruptionBudget is replaced, not rolled back;
a canary whose live acceptance drops is rolled back (and blocked); a promoted version is what a
new pod's SGLang starts with, resolved from the ConfigMap and the Secret as the kubelet would."""

from __future__ import annotations

import base64
import time

import pytest
from adaflash_operator import contract as c
from controlplane import Api, ApiError, wait_for
from helpers import (
    afs,
    condition,
    dv_phase,
    finish_job,
    fleet,
    report,
    reporter,
    serving_pods,
    start_serving_pods,
    status,
)

pytestmark = pytest.mark.apiserver


def _evict(api: Api, ns: str, pod: str) -> None:
    api.request("POST", f"/api/v1/namespaces/{ns}/pods/{pod}/eviction", {
        "apiVersion": "policy/v1", "kind": "Eviction",
        "metadata": {"name": pod, "namespace": ns}})


def _publish(api: Api, ns: str, pods: list[dict], rep: str, job: str = "qwen-distill-1-1"):
    reps = {p["metadata"]["name"]: reporter(api, ns, p) for p in pods}
    for r in reps.values():
        assert r.update({c.LOADED_VERSION: "v000001", c.ACCEPTANCE_TAU: "4.0",
                         c.TRAFFIC_RECORDS: "6"})
    wait_for(f"Job {job}", lambda: api.get("Job", ns, job), timeout=60)
    finish_job(api, ns, job, rep)
    return reps


def test_an_evicted_canary_is_replaced_under_the_pdb(chart, api: Api, namespace: str,
                                                     gpu_pool, operator_process) -> None:
    """A drain of the canary pod's node (cordon, then the eviction API, which honours the
    PodDisruptionBudget): no verdict on the version; another pod becomes the canary and the
    version is promoted. A second eviction while the replacement waits (the GPU pool is full,
    the drained node cordoned) is refused by the budget."""
    ns = namespace
    where = gpu_pool(nodes=3, gpus=1)
    operator_process()
    # One canary of three pods: ceil(0.3 * 3) = 1.
    api.create(afs(ns, replicas=3, serving={**where, "gpus": 1},
                   rollout={"canaryFraction": 0.3, "bakeSeconds": 2}))
    pods = start_serving_pods(api, ns, 3)
    pdb = wait_for("the PodDisruptionBudget's status", lambda: (
        x := api.get("PodDisruptionBudget", ns, "qwen") or {}).get("status", {}).get(
        "disruptionsAllowed") == 1 and x, timeout=60)
    assert pdb["spec"]["maxUnavailable"] == 1
    reps = _publish(api, ns, pods, report("v000002"))
    st = wait_for("the canary", lambda: (x := status(api, ns).get("rollout") or {}).get(
        "phase") == "Canary" and x, timeout=60)
    (first,) = st["canaryPods"]
    drained = api.get("Pod", ns, first)["spec"]["nodeName"]
    api.request("PATCH", f"/api/v1/nodes/{drained}", {"spec": {"unschedulable": True}},
                "application/merge-patch+json")
    _evict(api, ns, first)
    other = next(p["metadata"]["name"] for p in pods if p["metadata"]["name"] != first)
    with pytest.raises(ApiError) as refused:  # one pod down already: the budget says no
        _evict(api, ns, other)
    assert refused.value.status == 429 and "disruption budget" in refused.value.message
    api.request("PATCH", f"/api/v1/nodes/{drained}", {"spec": {"unschedulable": False}},
                "application/merge-patch+json")
    st = wait_for("the canary on another pod", lambda: (x := status(api, ns).get(
        "rollout") or {}).get("reason") == "CanaryPodReplaced" and x, timeout=60)
    assert st["phase"] == "Canary" and st["canaryPods"] != [first]
    assert st["replacedPods"] == 1 and dv_phase(api, ns, "v000002") == "Canary"
    (second,) = st["canaryPods"]
    rep = reps.get(second) or reporter(api, ns, api.get("Pod", ns, second))
    assert rep.update({c.LOADED_VERSION: "v000002", c.ACCEPTANCE_TAU: "4.1"})
    wait_for("promotion", lambda: dv_phase(api, ns, "v000002") == "Serving", timeout=60)
    history = [h["reason"] for h in api.get(c.DRAFTER_KIND, ns, "qwen-v000002")["status"][
        "history"]]
    assert "CanaryPodReplaced" in history and "RolledBack" not in history
    assert condition(api, ns, "Degraded")["status"] == "False"


def test_a_canary_whose_acceptance_drops_is_rolled_back(chart, api: Api, namespace: str,
                                                        operator_process) -> None:
    """Gate, canary, bake, then the canary's live tau is below the fleet's: RolledBack, the
    annotation removed, Degraded, the version blocked for the admin call; the fleet stays."""
    ns = namespace
    operator_process()
    api.create(afs(ns))
    pods = start_serving_pods(api, ns, 2)
    reps = _publish(api, ns, pods, report("v000002"))
    (canary,) = wait_for("the canary", lambda: (x := status(api, ns).get("rollout") or {}).get(
        "phase") == "Canary" and x["canaryPods"], timeout=60)
    assert api.get("Pod", ns, canary)["metadata"]["annotations"][c.DESIRED_VERSION] == \
        "v000002"
    assert reps[canary].update({c.LOADED_VERSION: "v000002", c.ACCEPTANCE_TAU: "2.0"})
    wait_for("RolledBack", lambda: dv_phase(api, ns, "v000002") == "RolledBack", timeout=60)
    # (The DrafterVersion is written before the pass saves the service's status.)
    st = wait_for("status RolledBack", lambda: (x := status(api, ns)).get("rollout", {}).get(
        "phase") == "RolledBack" and x, timeout=30)
    assert st["rollout"]["reason"] == "LiveTauDrop"
    degraded = condition(api, ns, "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "LiveTauDrop")
    assert fleet(api, ns) == "v000001"
    wait_for("the annotation removed", lambda: c.DESIRED_VERSION not in (api.get(
        "Pod", ns, canary)["metadata"].get("annotations") or {}), timeout=30)
    blocked = api.get("ConfigMap", ns, "qwen-drafter")["data"][c.BLOCKED_VERSIONS_KEY]
    assert blocked == "v000002 RolledBack\n"
    assert any(e.get("reason") == "RolledBack" and e.get("type") == "Warning"
               for e in api.list("Event", ns))


def test_a_new_pod_starts_on_the_promoted_version(chart, api: Api, namespace: str,
                                                  operator_process) -> None:
    """After a promotion, a pod the ReplicaSet makes resolves its environment from the fleet
    ConfigMap and the admin Secret (as the kubelet does) and starts SGLang on the new version;
    it also carries the preStop wait and the grace period the spec asks for."""
    import kubelet

    ns = namespace
    operator_process()
    api.create(afs(ns, serving={"shutdown": {"preStopSeconds": 7, "drainSeconds": 120}}))
    pods = start_serving_pods(api, ns, 2)
    reps = _publish(api, ns, pods, report("v000002"))
    (canary,) = wait_for("the canary", lambda: (x := status(api, ns).get("rollout") or {}).get(
        "phase") == "Canary" and x["canaryPods"], timeout=60)
    assert reps[canary].update({c.LOADED_VERSION: "v000002", c.ACCEPTANCE_TAU: "4.2"})
    wait_for("promotion", lambda: fleet(api, ns) == "v000002", timeout=60)
    gone = pods[0]["metadata"]["name"]
    api.delete("Pod", ns, gone)
    new = wait_for("its replacement", lambda: next(
        (p for p in start_serving_pods(api, ns, 2) if p["metadata"]["name"] not in
         {q["metadata"]["name"] for q in pods}), None), timeout=90)
    argv = kubelet.command_line(api, new, c.SERVING_CONTAINER)
    assert argv[argv.index("--speculative-draft-model-path") + 1] == \
        "/var/lib/adaflash/drafters/v000002"
    assert argv[argv.index("--log-requests-target") + 1] == \
        f"/var/lib/adaflash/traffic/{new['metadata']['name']}"
    env = kubelet.environment(api, new, c.SERVING_CONTAINER)
    secret = api.get("Secret", ns, "qwen-admin")
    assert env[c.ENV_ADMIN_TOKEN] == base64.b64decode(secret["data"][c.ADMIN_TOKEN_KEY]).decode()
    assert env[c.ENV_POD_NAMESPACE] == ns and env[c.ENV_POD_NAME] == new["metadata"]["name"]
    assert env[c.ENV_FLEET_VERSION] == "v000002"
    spec = new["spec"]
    assert spec["terminationGracePeriodSeconds"] == 127
    assert spec["containers"][0]["lifecycle"]["preStop"]["exec"]["command"] == [
        "sh", "-c", "sleep 7"]
    assert len(serving_pods(api, ns)) == 2


class _SGLangProbes:
    """A stand-in for SGLang 0.5.23's probe endpoints on one port: /ping (started and
    healthy) and /ready (not paused) answer at once, 503 until `loaded`; /health_generate
    runs a one-token generation (here: sleeps `generate_s`)."""

    def __init__(self, generate_s: float = 1.0):
        import http.server
        import threading

        outer = self
        self.loaded = False

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                if self.path == "/health_generate":
                    time.sleep(generate_s)
                ok = outer.loaded and self.path in ("/ping", "/ready", "/health_generate")
                self.send_response(200 if ok else 503)
                self.end_headers()

            def log_message(self, *_) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()


def test_readiness_comes_from_the_probes_and_gates_the_canary(chart, api: Api, control_plane,
                                                              operator_process,
                                                              tmp_path) -> None:
    """In a probe-* namespace kwok starts the containers but leaves readiness to the tests'
    prober, which runs each pod's own startup, readiness and liveness probes (the port found by
    its name, the path, the timeout) against a stand-in of SGLang's endpoints. Until they pass,
    the service is not Ready and no canary starts; then both follow."""
    import kubelet
    from conftest import OperatorProcess, drop_namespace, new_namespace
    from controlplane import OPERATOR_SA, RELEASE_NS

    ns = new_namespace(api, "probes", prefix="probe-")
    stand_in = _SGLangProbes()
    op = OperatorProcess.for_namespace(control_plane, ns, api.request_token(
        RELEASE_NS, OPERATOR_SA), tmp_path / "probe-operator.log").start()
    try:
        api.create(afs(ns))
        pods = wait_for("2 running pods", lambda: (ps := serving_pods(api, ns)) and len(ps) == 2
                        and all((p.get("status") or {}).get("phase") == "Running" for p in ps)
                        and ps, timeout=90)
        port = kubelet.probe_port(pods[0], c.SERVING_CONTAINER, "readinessProbe")
        assert port == 30000  # the port named "http", as the kubelet resolves it
        ports = {port: stand_in.port}
        for kind in ("startupProbe", "readinessProbe"):
            ok, why = kubelet.probe(pods[0], c.SERVING_CONTAINER, kind, ports=ports)
            assert not ok and "HTTP 503" in why  # the model is still loading
        cond = wait_for("Ready=False", lambda: (x := condition(api, ns, "Ready")).get(
            "reason") == "PodsNotReady" and x, timeout=30)
        assert cond["message"].startswith("0/2")
        _publish(api, ns, pods, report("v000002"))
        st = wait_for("the gate waiting for ready pods", lambda: (x := status(api, ns).get(
            "rollout") or {}).get("reason") == "NoReadyPods" and x, timeout=60)
        assert st["phase"] == "Gate"
        stand_in.loaded = True
        for p in pods:  # the kubelet's prober: startup first, then readiness, and liveness
            for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
                ok, why = kubelet.probe(p, c.SERVING_CONTAINER, kind, ports=ports)
                assert ok, why
            api.kubelet_ready(ns, p["metadata"]["name"])
        wait_for("Ready=True", lambda: condition(api, ns, "Ready").get("status") == "True",
                 timeout=30)
        wait_for("the canary", lambda: (status(api, ns).get("rollout") or {}).get(
            "phase") == "Canary", timeout=30)
    finally:
        op.stop()
        stand_in.close()
        assert "Traceback" not in op.output(), op.output()[-4000:]
        drop_namespace(api, ns)
