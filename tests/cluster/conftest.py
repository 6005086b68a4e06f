"""Fixtures of the `apiserver` suite: one control plane per session (controlplane.py) with a
pool of kwok nodes (CPU nodes and tainted GPU nodes), the chart installed into it with helm,
the operator as a real process with the chart's ServiceAccount token (either with the test's
`--namespace`, or exactly as the chart's Deployment runs it), one namespace per test."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT / "operator"))
sys.path.insert(0, str(HERE))

import controlplane as cp  # noqa: E402
from controlplane import OPERATOR_SA, RELEASE, RELEASE_NS  # noqa: E402
from helpers import node_prefix  # noqa: E402

SERVICE_KIND = "AdaFlashService"

TICK = "0.5"
# The session's shared node pool. GPU nodes are tainted as GPU node pools usually are; tests
# that count GPUs make pools of their own (gpu_pool).
GPU_TAINT = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}
GPU_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
# The chart's operator in the tests: short Lease timings, and ports of its own.
LEASE = {"leaseDurationSeconds": 4, "renewDeadlineSeconds": 3, "retryPeriodSeconds": 0.5}


@pytest.fixture(scope="session")
def control_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[cp.ControlPlane]:
    why = cp.missing()
    if why:
        pytest.skip(why)
    plane = cp.ControlPlane(tmp_path_factory.mktemp("control-plane"))
    try:
        plane.start()
        _wait("the controller-manager's service accounts", lambda: plane.api.get(
            "ServiceAccount", "default", "default"), timeout=120)
        for i in range(2):
            plane.add_node(f"cpu-{i}", labels={"pool": "cpu"})
            plane.add_node(f"h100-{i}", gpus=8, labels={"pool": "shared-gpu", "gpu": "h100"},
                           taints=[GPU_TAINT])
        _wait("the nodes Ready (kwok)", lambda: all(
            any(c["type"] == "Ready" and c["status"] == "True"
                for c in (n.get("status") or {}).get("conditions") or [])
            for n in plane.api.request("GET", "/api/v1/nodes")["items"]), timeout=60)
        yield plane
    finally:
        plane.stop()


@pytest.fixture(scope="session")
def api(control_plane: cp.ControlPlane) -> cp.Api:
    return control_plane.api


def helm_bin() -> str:
    for cand in (os.environ.get("HELM"), str(cp.TOOLS / "helm")):
        if cand and os.access(cand, os.X_OK):
            return cand
    pytest.skip("helm not found: run `make tools`")


def helm(plane: cp.ControlPlane, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "KUBECONFIG": str(plane.admin_kubeconfig),
           "HELM_CACHE_HOME": str(plane.dir / "helm-cache"),
           "HELM_CONFIG_HOME": str(plane.dir / "helm-config"),
           "HELM_DATA_HOME": str(plane.dir / "helm-data")}
    return subprocess.run([helm_bin(), *args], capture_output=True, text=True, timeout=180,
                          env=env)


def install(plane: cp.ControlPlane, release: str, namespace: str,
            **values: Any) -> subprocess.CompletedProcess:
    """`helm install` of helm/adaflash, the operator's ports, tick and Lease timings set for
    tests; `values` are dotted keys (`operator__watchNamespaces` for operator.watchNamespaces)
    with their values, passed as JSON."""
    sets = {"operator.metricsPort": cp.free_port(), "operator.healthPort": cp.free_port(),
            "operator.tickSeconds": float(TICK),
            **{f"operator.leaderElection.{k}": v for k, v in LEASE.items()},
            **{k.replace("__", "."): v for k, v in values.items()}}
    r = helm(plane, "install", release, str(ROOT / "helm" / "adaflash"), "--namespace",
             namespace, "--create-namespace",
             *[x for k, v in sets.items() for x in ("--set-json", f"{k}={json.dumps(v)}")])
    assert r.returncode == 0, r.stdout + r.stderr
    return r


@pytest.fixture(scope="session")
def chart(control_plane: cp.ControlPlane) -> subprocess.CompletedProcess:
    """`helm install` of helm/adaflash (CRDs, RBAC, admission policies, operator Deployment),
    with its defaults: every namespace watched (a ClusterRole)."""
    r = install(control_plane, RELEASE, RELEASE_NS)
    api = control_plane.api
    for crd in ("adaflashservices.adaflash.io", "drafterversions.adaflash.io"):
        _wait(f"CRD {crd} established", lambda c=crd: any(
            x["type"] == "Established" and x["status"] == "True"
            for x in (api.request("GET", f"/apis/apiextensions.k8s.io/v1/"
                                  f"customresourcedefinitions/{c}").get("status") or {}).get(
                "conditions") or []), timeout=60)
    # The API group is served once discovery has it.
    _wait("the adaflash.io API", lambda: _ok(lambda: api.request(
        "GET", "/apis/adaflash.io/v1alpha1")), timeout=60)
    guard_in_force(api, RELEASE_NS, OPERATOR_SA)
    return r


def guard_in_force(api: cp.Api, namespace: str, account: str) -> None:
    """Admission policies take effect a moment after they are created: wait until the
    operatorGuard refuses the release's operator a dry-run write it does not manage."""
    op = api.as_token(api.request_token(namespace, account))

    def refused() -> bool:
        try:
            op.request("POST", "/api/v1/namespaces/default/configmaps?dryRun=All", {
                "apiVersion": "v1", "kind": "ConfigMap",
                "metadata": {"name": "probe", "namespace": "default"}})
        except cp.ApiError as e:
            return "operator-writes" in e.message
        return False

    _wait("the operatorGuard policy in force", refused, timeout=60)


def _ok(fn: Callable[[], Any]) -> bool:
    try:
        fn()
        return True
    except cp.ApiError:
        return False


_wait = cp.wait_for


def new_namespace(api: cp.Api, label: str, prefix: str = "t-") -> str:
    name = prefix + label.lower().replace("_", "-")[:40].strip("-[]") + "-" + \
        uuid.uuid4().hex[:5]
    name = "".join(ch if ch.isalnum() or ch == "-" else "-" for ch in name)
    api.namespace(name)
    _wait("the namespace's default ServiceAccount",
          lambda: api.get("ServiceAccount", name, "default"), timeout=60)
    return name


def drop_namespace(api: cp.Api, name: str) -> None:
    """Delete a test's namespace, so that no later operator (one watching every namespace
    included) finds its objects: with the test's operator gone, nobody would remove the
    AdaFlashServices' finalizers, so the test does it."""
    try:
        for obj in api.list(SERVICE_KIND, name):
            api.patch(SERVICE_KIND, name, obj["metadata"]["name"],
                      {"metadata": {"finalizers": None}})
        api.request("DELETE", f"/api/v1/namespaces/{name}")
    except cp.ApiError:
        pass


@pytest.fixture()
def namespace(api: cp.Api, request: pytest.FixtureRequest) -> Iterator[str]:
    name = new_namespace(api, request.node.name)
    yield name
    drop_namespace(api, name)


@pytest.fixture()
def gpu_pool(control_plane: cp.ControlPlane, namespace: str) -> Iterator[Callable[..., dict]]:
    """Nodes of this test only (label and taint `pool=<namespace>`), each with `gpus` GPUs;
    returns the placement an AdaFlashService needs to land there."""
    made: list[str] = []

    def make(nodes: int, gpus: int) -> dict:
        for _ in range(nodes):
            name = f"{node_prefix(namespace)}-gpu-{len(made)}"
            control_plane.add_node(name, gpus=gpus, labels={"pool": namespace},
                                   taints=[{"key": "pool", "value": namespace,
                                            "effect": "NoSchedule"}])
            made.append(name)
        return {"nodeSelector": {"pool": namespace},
                "tolerations": [{"key": "pool", "operator": "Equal", "value": namespace,
                                 "effect": "NoSchedule"}]}

    yield make
    for node in made:
        control_plane.api.request("DELETE", f"/api/v1/nodes/{node}")


class OperatorProcess:
    """`python -m adaflash_operator run` as its own process, with a kubeconfig holding a
    ServiceAccount token of the chart: the chart's RBAC and admission policies are what it may
    do. Either with the test's `--namespace` (most tests), or exactly as a pod of the chart's
    Deployment runs it (`from_pod`: its command, args and environment, resolved as the kubelet
    does, with a token bound to that pod)."""

    def __init__(self, plane: cp.ControlPlane, args: list[str], token: str, log: Path,
                 env: dict[str, str] | None = None, metrics_port: int = 0):
        self.kubeconfig = cp.kubeconfig(log.with_suffix(".kubeconfig"), plane.server,
                                        plane.ca, token, "adaflash-operator")
        self.args = [sys.executable, "-m", "adaflash_operator", *args]
        self.env = {**os.environ, "ADAFLASH_OPERATOR_TICK_SECONDS": TICK, **(env or {}),
                    "KUBECONFIG": str(self.kubeconfig), "PYTHONPATH": str(ROOT / "operator")}
        self.env["HOME"] = str(log.parent)
        self.env.pop("KUBERNETES_SERVICE_HOST", None)
        self.log = log
        self.metrics_port = metrics_port
        self.proc: subprocess.Popen | None = None

    @classmethod
    def for_namespace(cls, plane: cp.ControlPlane, namespace: str, token: str,
                      log: Path) -> OperatorProcess:
        port = cp.free_port()
        return cls(plane, ["run", "--namespace", namespace, "--health-port", "0",
                           "--metrics-port", str(port)], token, log, metrics_port=port)

    @classmethod
    def from_pod(cls, plane: cp.ControlPlane, pod: dict, log: Path) -> OperatorProcess:
        import kubelet

        argv = kubelet.command_line(plane.api, pod, "operator")
        assert argv[:3] == ["python", "-m", "adaflash_operator"], argv
        env = kubelet.environment(plane.api, pod, "operator")
        token = plane.api.request_token(pod["metadata"]["namespace"],
                                        pod["spec"]["serviceAccountName"], pod=pod)
        # Each pod has its own network namespace; here every pod shares the host's, so the
        # ports are remapped (as a port mapping would), the rest is the pod spec's.
        ports = {"--metrics-port": cp.free_port(), "--health-port": cp.free_port()}
        args = [f"{a.split('=', 1)[0]}={ports[a.split('=', 1)[0]]}"
                if a.split("=", 1)[0] in ports else a for a in argv[3:]]
        return cls(plane, args, token, log, env=env, metrics_port=ports["--metrics-port"])

    def start(self) -> OperatorProcess:
        f = open(self.log, "ab")  # noqa: SIM115
        self.proc = subprocess.Popen(self.args, env=self.env, stdout=f, stderr=subprocess.STDOUT,
                                     cwd=ROOT, start_new_session=True)
        return self

    def stop(self, kill: bool = False) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        if kill:
            self.proc.kill()
        else:
            self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def metrics(self) -> dict[str, float]:
        """Its /metrics, scraped: {'name{labels}': value}."""
        import urllib.request

        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics",
                                    timeout=10) as r:
            text = r.read().decode()
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                key, _, value = line.rpartition(" ")
                out[key] = float(value)
        return out


@pytest.fixture()
def operator_process(control_plane: cp.ControlPlane, chart, namespace: str,
                     tmp_path: Path) -> Iterator[Callable[..., OperatorProcess]]:
    """A factory: each call starts the operator (again), for this test's namespace, or
    (`pod=...`) as that pod of a chart Deployment runs it."""
    api = control_plane.api
    started: list[OperatorProcess] = []

    def start(pod: dict | None = None) -> OperatorProcess:
        log = tmp_path / f"operator-{len(started)}.log"
        if pod is not None:
            op = OperatorProcess.from_pod(control_plane, pod, log)
        else:
            op = OperatorProcess.for_namespace(
                control_plane, namespace, api.request_token(RELEASE_NS, OPERATOR_SA), log)
        started.append(op.start())
        return op

    yield start
    for op in started:
        op.stop()
    for op in started:
        out = op.output()
        assert "Traceback" not in out, out[-6000:]
