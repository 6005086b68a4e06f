"""Scaling the serving pods on queue depth (pure builders; the handlers pick one).

Both target the AdaFlashService's scale subresource, never the Deployment: the operator owns the
Deployment's replicas, and the autoscaler writes `spec.replicas` of the AdaFlashService, which
the operator then applies (the same path as `kubectl scale afs/NAME`).

- KEDA, when the cluster serves `keda.sh/v1alpha1` (detected through discovery, looked up again
  every few minutes) and `autoscaling.prometheusAddress` is set: a ScaledObject with a
  Prometheus trigger on the sum of the pods' queue depth.
- Otherwise a HorizontalPodAutoscaler (autoscaling/v2) on the per-pod custom metric
  `autoscaling.metric`, which a custom-metrics adapter (e.g. prometheus-adapter) must serve.

Scaling down is slow on purpose (a serving pod takes minutes to load a model on a GPU).
"""

from __future__ import annotations

from typing import Any

from . import contract as c
from . import manifests
from .spec import ServiceSpec

Manifest = dict[str, Any]

KEDA_API = "keda.sh/v1alpha1"
SCALE_DOWN_WINDOW_S = 600


def _target(name: str) -> Manifest:
    return {"apiVersion": c.API_VERSION, "kind": c.SERVICE_KIND, "name": name}


def use_keda(spec: ServiceSpec, keda_served: bool) -> bool:
    return bool(spec.autoscaling and spec.autoscaling.prometheus_address and keda_served)


def hpa(owner: Manifest, spec: ServiceSpec) -> Manifest:
    name, ns = owner["metadata"]["name"], owner["metadata"]["namespace"]
    a = spec.autoscaling
    assert a is not None
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": manifests._meta(name, ns, "serving", owner),
        "spec": {
            "scaleTargetRef": _target(name),
            "minReplicas": a.min_replicas,
            "maxReplicas": a.max_replicas,
            "metrics": [{"type": "Pods", "pods": {
                "metric": {"name": a.metric},
                "target": {"type": "AverageValue", "averageValue": str(a.target_queue_depth)}}}],
            "behavior": {"scaleDown": {"stabilizationWindowSeconds": SCALE_DOWN_WINDOW_S}},
        },
    }


def queue_query(metric: str, namespace: str, service: str) -> str:
    """PromQL: the queued requests of every serving pod of the service, summed (the
    ServiceMonitor's `namespace` and `service` target labels select them)."""
    return f'sum({metric}{{namespace="{namespace}",service="{service}"}})'


def scaled_object(owner: Manifest, spec: ServiceSpec) -> Manifest:
    name, ns = owner["metadata"]["name"], owner["metadata"]["namespace"]
    a = spec.autoscaling
    assert a is not None
    return {
        "apiVersion": KEDA_API,
        "kind": "ScaledObject",
        "metadata": manifests._meta(name, ns, "serving", owner),
        "spec": {
            "scaleTargetRef": _target(name),
            "minReplicaCount": a.min_replicas,
            "maxReplicaCount": a.max_replicas,
            "cooldownPeriod": SCALE_DOWN_WINDOW_S,
            "triggers": [{"type": "prometheus", "metadata": {
                "serverAddress": a.prometheus_address,
                "query": queue_query(a.metric, ns, name),
                "threshold": str(a.target_queue_depth)}}],
        },
    }
