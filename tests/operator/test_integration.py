"""The operator against kmock over real HTTP and watch streams (kopf's KopfRunner)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from adaflash_operator import contract as c
from kopf.testing import KopfRunner
from operator_harness import Cluster, wait_for


@contextlib.contextmanager
def operator(namespace: str) -> Iterator[KopfRunner]:
    args = ["run", "--standalone", f"--namespace={namespace}", "-m", "adaflash_operator.handlers"]
    with KopfRunner(args, timeout=30) as runner:
        yield runner
    assert runner.exception is None, runner.output


def afs(namespace: str, name: str = "qwen", **spec_over) -> dict:
    spec = {"model": {"target": "Qwen/Qwen3-8B"}, "replicas": 2,
            "serving": {"image": "ghcr.io/example/adaflash-sglang:0.1"}}
    spec.update(spec_over)
    return {"apiVersion": c.API_VERSION, "kind": c.SERVICE_KIND,
            "metadata": {"name": name, "namespace": namespace}, "spec": spec}


def test_create_makes_children(cluster: Cluster, namespace: str, kubeconfig) -> None:
    with operator(namespace):
        cluster.create(afs(namespace))
        dep = wait_for("the Deployment", lambda: cluster.get("Deployment", namespace, "qwen"))
        for kind, name in [("PersistentVolumeClaim", "qwen-home"), ("ConfigMap", "qwen-drafter"),
                           ("ServiceAccount", "qwen-serving"), ("Role", "qwen-serving"),
                           ("RoleBinding", "qwen-serving"), ("Service", "qwen")]:
            wait_for(f"{kind} {name}", lambda k=kind, n=name: cluster.get(k, namespace, n))
    assert dep["spec"]["replicas"] == 2
