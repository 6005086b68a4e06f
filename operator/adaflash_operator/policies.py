"""The serving pods' PodDisruptionBudget and NetworkPolicy (pure builders).

- PodDisruptionBudget `NAME`: drains, evictions and cluster upgrades take at most
  `serving.podDisruptionBudget.maxUnavailable` serving pods at a time (each one reloads a model
  on a GPU when it comes back). Pods that are not ready can always be evicted
  (`unhealthyPodEvictionPolicy: AlwaysAllow`), so a crash-looping pod never blocks a drain.
- NetworkPolicy `NAME`: the admin route (POST /adaflash/v1/drafter) shares the inference port,
  and a NetworkPolicy works on ports, not paths; so the policy names who may reach that port
  at all (`serving.networkPolicy.from`, by default the pods of the same namespace). The admin
  route is further closed by its bearer token; a path-level rule needs an L7 gateway.
"""

from __future__ import annotations

from typing import Any

from . import manifests
from .spec import ServiceSpec

Manifest = dict[str, Any]


def pod_disruption_budget(owner: Manifest, spec: ServiceSpec) -> Manifest:
    name, ns = owner["metadata"]["name"], owner["metadata"]["namespace"]
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": manifests._meta(name, ns, "serving", owner),
        "spec": {
            "selector": {"matchLabels": manifests.selector(name)},
            "maxUnavailable": spec.pdb_max_unavailable,
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    }


def network_policy(owner: Manifest, spec: ServiceSpec) -> Manifest:
    name, ns = owner["metadata"]["name"], owner["metadata"]["namespace"]
    peers = [dict(p) for p in spec.network_policy_from] or [{"podSelector": {}}]
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": manifests._meta(name, ns, "serving", owner),
        "spec": {
            "podSelector": {"matchLabels": manifests.selector(name)},
            "policyTypes": ["Ingress"],
            "ingress": [{"from": peers,
                         "ports": [{"protocol": "TCP", "port": spec.port}]}],
        },
    }
