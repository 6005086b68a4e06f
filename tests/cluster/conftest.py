"""Fixtures of the `apiserver` suite: one control plane per session (controlplane.py), the
chart installed into it with helm, the operator as a real process with the chart's
ServiceAccount token, one namespace per test."""

from __future__ import annotations

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

TICK = "0.5"


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


@pytest.fixture(scope="session")
def chart(control_plane: cp.ControlPlane) -> subprocess.CompletedProcess:
    """`helm install` of helm/adaflash (CRDs, RBAC, admission policy, operator Deployment)."""
    env = {**os.environ, "KUBECONFIG": str(control_plane.admin_kubeconfig),
           "HELM_CACHE_HOME": str(control_plane.dir / "helm-cache"),
           "HELM_CONFIG_HOME": str(control_plane.dir / "helm-config"),
           "HELM_DATA_HOME": str(control_plane.dir / "helm-data")}
    r = subprocess.run([helm_bin(), "install", RELEASE, str(ROOT / "helm" / "adaflash"),
                        "--namespace", RELEASE_NS, "--create-namespace"],
                       capture_output=True, text=True, timeout=180, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
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
    return r


def _ok(fn: Callable[[], Any]) -> bool:
    try:
        fn()
        return True
    except cp.ApiError:
        return False


_wait = cp.wait_for


@pytest.fixture()
def namespace(api: cp.Api, request: pytest.FixtureRequest) -> str:
    name = "t-" + request.node.name.lower().replace("_", "-")[:40].strip("-[]") + "-" + \
        uuid.uuid4().hex[:5]
    name = "".join(ch if ch.isalnum() or ch == "-" else "-" for ch in name)
    api.namespace(name)
    _wait("the namespace's default ServiceAccount",
          lambda: api.get("ServiceAccount", name, "default"), timeout=60)
    return name


class OperatorProcess:
    """`python -m adaflash_operator run` as its own process, with a kubeconfig holding the
    chart ServiceAccount's token: the chart's RBAC is what it may do."""

    def __init__(self, plane: cp.ControlPlane, namespace: str, token: str, log: Path):
        self.kubeconfig = cp.kubeconfig(log.with_suffix(".kubeconfig"), plane.server,
                                        plane.ca, token, "adaflash-operator")
        self.args = [sys.executable, "-m", "adaflash_operator", "run", "--namespace", namespace,
                     "--health-port", "0", "--metrics-port", "0"]
        self.env = {**os.environ, "KUBECONFIG": str(self.kubeconfig),
                    "PYTHONPATH": str(ROOT / "operator"),
                    "ADAFLASH_OPERATOR_TICK_SECONDS": TICK, "HOME": str(log.parent)}
        self.env.pop("KUBERNETES_SERVICE_HOST", None)
        self.log = log
        self.proc: subprocess.Popen | None = None

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


@pytest.fixture()
def operator_process(control_plane: cp.ControlPlane, chart, namespace: str,
                     tmp_path: Path) -> Iterator[Callable[[], OperatorProcess]]:
    """A factory: each call starts the operator (again) for this test's namespace."""
    api = control_plane.api
    started: list[OperatorProcess] = []

    def start() -> OperatorProcess:
        token = api.request_token(RELEASE_NS, OPERATOR_SA)
        op = OperatorProcess(control_plane, namespace, token, tmp_path / "operator.log")
        started.append(op.start())
        return op

    yield start
    for op in started:
        op.stop()
    if started:
        out = started[-1].output()
        assert "Traceback" not in out, out[-6000:]
