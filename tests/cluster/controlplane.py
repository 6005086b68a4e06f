"""A real Kubernetes control plane for tests: etcd, kube-apiserver, kube-controller-manager,
kube-scheduler and kwok from .cache/tools (`make cluster-tools`), on 127.0.0.1, in a temporary
directory.

What it has: the API server with RBAC, the default admission plugins plus
OwnerReferencesPermissionEnforcement, ValidatingAdmissionPolicy, an audit log, service-account
token signing; the controller-manager's garbage collector, Deployment, ReplicaSet, Job,
CronJob, ServiceAccount, namespace, PersistentVolume binder, disruption (PodDisruptionBudget),
HorizontalPodAutoscaler and ResourceQuota controllers, and the one that type-checks admission
policies (their status); the real scheduler; and kwok as the kubelet of the
nodes the tests create (`ControlPlane.add_node`: GPU capacity, labels, taints). kwok starts a
scheduled pod Running and Ready and removes a deleted one (kwok-stages.yaml); it runs no
containers, so what a container would do (exit with a report, answer a probe, resolve its
environment) the tests do (`Api.kubelet_terminate`, kubelet.py). A small provisioner
(`Provisioner`) gives every pending claim a PersistentVolume, as a storage driver would, so
that pods with claims can be scheduled.

Credentials: `admin` (system:masters) through a static token file; everything else gets real
service-account tokens from the TokenRequest API (`Api.token`).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import ssl
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
TOOLS = ROOT / ".cache" / "tools"
RELEASE, RELEASE_NS = "adaflash", "adaflash-system"  # the chart's release in the tests
OPERATOR_SA = "adaflash"  # the chart's ServiceAccount for release `adaflash`
BINARIES = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok")
ADMIN_TOKEN = "adaflash-test-admin"
# (Their names as `kube-controller-manager --help` lists them; the older short names are
# aliases.)
CONTROLLERS = ",".join(f"{c}-controller" for c in (
    "garbage-collector", "deployment", "replicaset", "job", "cronjob", "serviceaccount",
    "namespace", "root-ca-certificate-publisher", "persistentvolumeclaim-protection",
    "ttl-after-finished", "persistentvolume-binder", "disruption", "horizontal-pod-autoscaler",
    "resourcequota", "validatingadmissionpolicy-status"))
KWOK_LABEL = ("type", "kwok")  # the nodes kwok plays the kubelet of
KWOK_STAGES = Path(__file__).resolve().parent / "kwok-stages.yaml"


def wait_for(what: str, fn: Callable[[], Any], timeout: float = 60.0,
             every: float = 0.2) -> Any:
    """Poll `fn` until it returns something truthy; fail with `what` and the last value (or
    the last lookup error: an object not there yet is polled again, not returned)."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = fn()
        except (KeyError, TypeError, IndexError, StopIteration) as e:
            last = e  # an exception object is truthy: it must not end the wait
        else:
            if last:
                return last
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}; last: {last!r}")


def missing() -> str | None:
    """Why the control plane cannot start here, or None."""
    absent = [b for b in BINARIES if not os.access(TOOLS / b, os.X_OK)]
    if absent:
        return (f"{', '.join(absent)} not in {TOOLS}: run `make cluster-tools` (builds them from "
                f"Go modules, about 30-60 min cold on 2 cores)")
    if shutil.which("openssl") is None:
        return "openssl is needed for the test certificates (apt-get install openssl)"
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_certs(d: Path) -> None:
    d.mkdir(parents=True, exist_ok=True)
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out",
             "ca.crt", "-days", "2", "-subj", "/CN=adaflash-test-ca", cwd=d)
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "apiserver.key", "-out",
             "apiserver.csr", "-subj", "/CN=kube-apiserver", cwd=d)
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost,"
                               "DNS:kubernetes.default.svc\n")
    _openssl("x509", "-req", "-in", "apiserver.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
             "-CAcreateserial", "-out", "apiserver.crt", "-days", "2", "-extfile", "san.ext",
             cwd=d)
    _openssl("genrsa", "-out", "sa.key", "2048", cwd=d)
    _openssl("rsa", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=d)


def kubeconfig(path: Path, server: str, ca: Path, token: str, user: str = "user") -> Path:
    path.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "test",
        "clusters": [{"name": "test", "cluster": {"server": server,
                                                   "certificate-authority": str(ca)}}],
        "users": [{"name": user, "user": {"token": token}}],
        "contexts": [{"name": "test", "context": {"cluster": "test", "user": user}}],
    }))
    return path


AUDIT_POLICY = """apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: ["RequestReceived"]
rules:
  - level: None
    users: ["system:kube-controller-manager", "system:apiserver"]
  - level: Metadata
    verbs: ["create", "update", "patch", "delete"]
"""


class ControlPlane:
    def __init__(self, workdir: Path):
        self.dir = workdir
        self.procs: list[tuple[str, subprocess.Popen]] = []
        self.logs: dict[str, Path] = {}
        self.port = free_port()
        self.server = f"https://127.0.0.1:{self.port}"
        self.ca = workdir / "pki" / "ca.crt"
        self.audit_log = workdir / "audit.log"
        self.admin_kubeconfig = workdir / "admin.kubeconfig"

    def _start(self, name: str, args: list[str]) -> subprocess.Popen:
        log = self.dir / f"{name}.log"
        self.logs[name] = log
        f = open(log, "wb")  # noqa: SIM115 (kept open for the process's life)
        p = subprocess.Popen(args, stdout=f, stderr=subprocess.STDOUT, cwd=self.dir,
                             start_new_session=True)
        self.procs.append((name, p))
        return p

    def start(self, timeout: float = 180.0) -> None:
        pki = self.dir / "pki"
        make_certs(pki)
        (self.dir / "tokens.csv").write_text(
            f'{ADMIN_TOKEN},admin,admin-uid,"system:masters"\n')
        (self.dir / "audit-policy.yaml").write_text(AUDIT_POLICY)
        etcd_port, peer_port = free_port(), free_port()
        etcd_url = f"http://127.0.0.1:{etcd_port}"
        self._start("etcd", [
            str(TOOLS / "etcd"), "--name", "test", "--data-dir", str(self.dir / "etcd"),
            "--listen-client-urls", etcd_url, "--advertise-client-urls", etcd_url,
            "--listen-peer-urls", f"http://127.0.0.1:{peer_port}",
            "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer_port}",
            "--initial-cluster", f"test=http://127.0.0.1:{peer_port}",
            "--unsafe-no-fsync", "--log-level", "warn"])
        self._start("kube-apiserver", [
            str(TOOLS / "kube-apiserver"), "--etcd-servers", etcd_url,
            "--bind-address", "127.0.0.1", "--advertise-address", "127.0.0.1",
            "--secure-port", str(self.port),
            "--tls-cert-file", str(pki / "apiserver.crt"),
            "--tls-private-key-file", str(pki / "apiserver.key"),
            "--client-ca-file", str(pki / "ca.crt"),
            "--token-auth-file", str(self.dir / "tokens.csv"),
            "--authorization-mode", "RBAC",
            "--enable-admission-plugins", "OwnerReferencesPermissionEnforcement",
            # It taints a new node not-ready until the node-lifecycle controller sees it Ready;
            # that controller, which also evicts pods from nodes without heartbeats, is not
            # run here (kwok marks its nodes Ready once and sends no heartbeats).
            "--disable-admission-plugins", "TaintNodesByCondition",
            "--service-account-issuer", self.server,
            "--service-account-key-file", str(pki / "sa.pub"),
            "--service-account-signing-key-file", str(pki / "sa.key"),
            "--service-cluster-ip-range", "10.96.0.0/16",
            "--audit-policy-file", str(self.dir / "audit-policy.yaml"),
            "--audit-log-path", str(self.audit_log), "--audit-log-format", "json",
            "--cert-dir", str(self.dir / "apiserver-certs"),
            "--endpoint-reconciler-type", "none",  # 127.0.0.1 cannot be an endpoint
            "--allow-privileged", "--v", "1"])
        kubeconfig(self.admin_kubeconfig, self.server, self.ca, ADMIN_TOKEN, "admin")
        self.api = Api(self.server, self.ca, ADMIN_TOKEN)
        self._wait_ready(timeout)
        self._start("kube-controller-manager", [
            str(TOOLS / "kube-controller-manager"),
            "--kubeconfig", str(self.admin_kubeconfig),
            "--authentication-kubeconfig", str(self.admin_kubeconfig),
            "--authorization-kubeconfig", str(self.admin_kubeconfig),
            "--controllers", CONTROLLERS, "--leader-elect=false",
            "--bind-address", "127.0.0.1", "--secure-port", str(free_port()),
            "--service-account-private-key-file", str(pki / "sa.key"),
            "--root-ca-file", str(pki / "ca.crt"),
            "--concurrent-gc-syncs", "5", "--v", "1"])
        self._start("kube-scheduler", [
            str(TOOLS / "kube-scheduler"), "--kubeconfig", str(self.admin_kubeconfig),
            "--authentication-kubeconfig", str(self.admin_kubeconfig),
            "--authorization-kubeconfig", str(self.admin_kubeconfig),
            "--leader-elect=false", "--bind-address", "127.0.0.1",
            "--secure-port", str(free_port()), "--v", "1"])
        self._start("kwok", [
            str(TOOLS / "kwok"), "--kubeconfig", str(self.admin_kubeconfig),
            "--config", str(KWOK_STAGES), "--manage-all-nodes=false",
            f"--manage-nodes-with-label-selector={KWOK_LABEL[0]}={KWOK_LABEL[1]}",
            "--node-lease-duration-seconds=0", "--cidr", "10.244.0.0/16",
            "--node-ip", "10.0.0.1"])
        self.provisioner = Provisioner(self.api)
        self.provisioner.start()

    def add_node(self, name: str, *, gpus: int = 0, labels: dict[str, str] | None = None,
                 taints: list[dict] | None = None, cpu: str = "64",
                 memory: str = "512Gi", pods: int = 110) -> dict:
        """A node kwok keeps Ready, with `gpus` nvidia.com/gpu as the device plugin would
        report them."""
        capacity = {"cpu": cpu, "memory": memory, "pods": str(pods)}
        if gpus:
            capacity["nvidia.com/gpu"] = str(gpus)
        return self.api.request("POST", "/api/v1/nodes", {
            "apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "labels": {
                "kubernetes.io/hostname": name, "kubernetes.io/os": "linux",
                KWOK_LABEL[0]: KWOK_LABEL[1], **(labels or {})}},
            "spec": {"taints": list(taints or [])},
            "status": {"capacity": capacity, "allocatable": capacity}})
    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        last = ""
        while time.monotonic() < deadline:
            for name, p in self.procs:
                if p.poll() is not None:
                    raise RuntimeError(f"{name} exited ({p.returncode}):\n{self.tail(name)}")
            try:
                if self.api.raw("GET", "/readyz") == "ok":
                    return
            except (OSError, urllib.error.URLError, ApiError) as e:
                last = str(e)[-300:]
            time.sleep(0.5)
        raise RuntimeError(f"kube-apiserver not ready after {timeout}s ({last}):\n"
                           f"{self.tail('kube-apiserver')}")

    def tail(self, name: str, n: int = 40) -> str:
        try:
            return "\n".join(self.logs[name].read_text(errors="replace").splitlines()[-n:])
        except (KeyError, OSError):
            return ""

    def audit(self) -> list[dict]:
        out = []
        for line in self.audit_log.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
        return out

    def stop(self) -> None:
        if getattr(self, "provisioner", None) is not None:
            self.provisioner.stop()
        for _name, p in reversed(self.procs):
            if p.poll() is None:
                p.terminate()
        for _name, p in reversed(self.procs):
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=10)


class Provisioner(threading.Thread):
    """What a storage driver does for a claim nobody pre-provisioned: a PersistentVolume of the
    claim's size, access modes and class (an NFS source: no node to attach it to), pre-bound
    to the claim; the controller-manager's binder then binds the two. Polls, like a sidecar
    with a short resync would."""

    def __init__(self, api: Api, every: float = 0.3):
        super().__init__(daemon=True, name="test-provisioner")
        self.api, self.every = api, every
        self._stop = threading.Event()
        self.made: set[str] = set()

    def stop(self) -> None:
        self._stop.set()

    def run(self) -> None:
        while not self._stop.wait(self.every):
            try:
                claims = self.api.request("GET", "/api/v1/persistentvolumeclaims")["items"]
                for claim in claims:
                    self._provide(claim)
            except (ApiError, OSError, urllib.error.URLError):
                continue

    def _provide(self, claim: dict) -> None:
        meta, spec = claim["metadata"], claim.get("spec") or {}
        if spec.get("volumeName") or meta.get("deletionTimestamp"):
            return
        digest = hashlib.sha256(meta["uid"].encode()).hexdigest()[:10]
        name = f"pv-{meta['namespace']}-{meta['name']}"[:200] + f"-{digest}"
        if name in self.made:
            return
        body = {"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": name},
                "spec": {"capacity": {"storage": spec["resources"]["requests"]["storage"]},
                         "accessModes": spec.get("accessModes") or ["ReadWriteOnce"],
                         "persistentVolumeReclaimPolicy": "Retain",
                         "storageClassName": spec.get("storageClassName") or "",
                         "claimRef": {"namespace": meta["namespace"], "name": meta["name"],
                                      "uid": meta["uid"]},
                         "nfs": {"server": "nfs.test.invalid", "path": f"/{name}"}}}
        try:
            self.api.request("POST", "/api/v1/persistentvolumes", body)
        except ApiError as e:
            if e.status != 409:
                raise
        self.made.add(name)


class ApiError(Exception):
    def __init__(self, status: int, body: dict):
        super().__init__(f"HTTP {status}: {body.get('message', body)}")
        self.status, self.body = status, body
        self.message = str(body.get("message", ""))


class Api:
    """A small synchronous client for the tests (as kubectl would be)."""

    PATHS = {
        "Pod": "/api/v1/namespaces/{ns}/pods", "ConfigMap": "/api/v1/namespaces/{ns}/configmaps",
        "Service": "/api/v1/namespaces/{ns}/services",
        "Secret": "/api/v1/namespaces/{ns}/secrets",
        "ServiceAccount": "/api/v1/namespaces/{ns}/serviceaccounts",
        "PersistentVolumeClaim": "/api/v1/namespaces/{ns}/persistentvolumeclaims",
        "Event": "/api/v1/namespaces/{ns}/events",
        "Deployment": "/apis/apps/v1/namespaces/{ns}/deployments",
        "ReplicaSet": "/apis/apps/v1/namespaces/{ns}/replicasets",
        "Job": "/apis/batch/v1/namespaces/{ns}/jobs",
        "CronJob": "/apis/batch/v1/namespaces/{ns}/cronjobs",
        "JobSet": "/apis/jobset.x-k8s.io/v1alpha2/namespaces/{ns}/jobsets",
        "Role": "/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/roles",
        "RoleBinding": "/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/rolebindings",
        "PodDisruptionBudget": "/apis/policy/v1/namespaces/{ns}/poddisruptionbudgets",
        "NetworkPolicy": "/apis/networking.k8s.io/v1/namespaces/{ns}/networkpolicies",
        "HorizontalPodAutoscaler":
            "/apis/autoscaling/v2/namespaces/{ns}/horizontalpodautoscalers",
        "Lease": "/apis/coordination.k8s.io/v1/namespaces/{ns}/leases",
        "Node": "/api/v1/nodes",
        "PersistentVolume": "/api/v1/persistentvolumes",
        "StorageClass": "/apis/storage.k8s.io/v1/storageclasses",
        "AdaFlashService": "/apis/adaflash.io/v1alpha1/namespaces/{ns}/adaflashservices",
        "DrafterVersion": "/apis/adaflash.io/v1alpha1/namespaces/{ns}/drafterversions",
    }

    def __init__(self, server: str, ca: Path, token: str):
        self.server, self.token = server, token
        self.ctx = ssl.create_default_context(cafile=str(ca))
        self.ca = ca

    def raw(self, method: str, path: str, body: Any = None,
            ctype: str = "application/json") -> str:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.server + path, data=data, method=method, headers={
            "Content-Type": ctype, "Authorization": f"Bearer {self.token}",
            "Accept": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=30, context=self.ctx) as r:
                return r.read().decode()
        except urllib.error.HTTPError as e:
            text = e.read().decode(errors="replace")
            try:
                payload = json.loads(text)
            except ValueError:
                payload = {"message": text}
            raise ApiError(e.code, payload) from None

    def request(self, method: str, path: str, body: Any = None,
                ctype: str = "application/json") -> Any:
        text = self.raw(method, path, body, ctype)
        return json.loads(text) if text else None

    def path(self, kind: str, ns: str, name: str | None = None, sub: str | None = None) -> str:
        p = self.PATHS[kind].format(ns=ns)
        return p + (f"/{name}" if name else "") + (f"/{sub}" if sub else "")

    def get(self, kind: str, ns: str, name: str) -> dict | None:
        try:
            return self.request("GET", self.path(kind, ns, name))
        except ApiError as e:
            if e.status == 404:
                return None
            raise

    def list(self, kind: str, ns: str, labels: dict[str, str] | None = None) -> list[dict]:
        q = ""
        if labels:
            q = "?labelSelector=" + ",".join(f"{k}%3D{v}" for k, v in labels.items())
        return self.request("GET", self.path(kind, ns) + q)["items"]

    def create(self, body: dict) -> dict:
        return self.request("POST", self.path(body["kind"], body["metadata"].get(
            "namespace", "")), body)

    def patch(self, kind: str, ns: str, name: str, body: dict, sub: str | None = None) -> dict:
        return self.request("PATCH", self.path(kind, ns, name, sub), body,
                            "application/merge-patch+json")

    def delete(self, kind: str, ns: str, name: str) -> None:
        try:
            self.request("DELETE", self.path(kind, ns, name))
        except ApiError as e:
            if e.status != 404:
                raise

    def namespace(self, name: str) -> None:
        self.request("POST", "/api/v1/namespaces",
                     {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})

    def request_token(self, ns: str, sa: str, pod: dict | None = None,
                      seconds: int = 3600) -> str:
        """A service-account token from the TokenRequest API; bound to `pod` if given (as the
        kubelet mounts it: it then carries the pod's name)."""
        spec: dict = {"expirationSeconds": seconds}
        if pod is not None:
            spec["boundObjectRef"] = {"kind": "Pod", "apiVersion": "v1",
                                      "name": pod["metadata"]["name"],
                                      "uid": pod["metadata"]["uid"]}
        out = self.request("POST", f"/api/v1/namespaces/{ns}/serviceaccounts/{sa}/token",
                           {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
                            "spec": spec})
        return out["status"]["token"]

    def as_token(self, token: str) -> Api:
        return Api(self.server, self.ca, token)

    # --- the kubelet, which this control plane does not have -----------------------------

    def kubelet_ready(self, ns: str, pod: str) -> None:
        self.patch("Pod", ns, pod, {"status": {"phase": "Running", "conditions": [
            {"type": "PodScheduled", "status": "True"},
            {"type": "Initialized", "status": "True"},
            {"type": "ContainersReady", "status": "True"},
            {"type": "Ready", "status": "True"}]}}, sub="status")

    def kubelet_terminate(self, ns: str, pod: dict, container: str, exit_code: int,
                          message: str) -> None:
        image = next(c["image"] for c in pod["spec"]["containers"] if c["name"] == container)
        self.patch("Pod", ns, pod["metadata"]["name"], {"status": {
            "phase": "Succeeded" if exit_code == 0 else "Failed",
            "containerStatuses": [{
                "name": container, "image": image, "imageID": image, "ready": False,
                "restartCount": 0,
                "state": {"terminated": {"exitCode": exit_code,
                                         "reason": "Completed" if exit_code == 0 else "Error",
                                         "message": message,
                                         "startedAt": "2026-01-01T00:00:00Z",
                                         "finishedAt": "2026-01-01T00:01:00Z"}}}]}},
            sub="status")
