"""Where the pods of an AdaFlashService run, and as whom (pure builders of pod-spec fields).

- Serving pods: the spec's nodeSelector, tolerations, affinity, priorityClassName and
  imagePullSecrets, and a topology spread (by default a soft one over nodes and zones, so that
  one node or zone going away does not take every replica).
- The distillation Jobs and the retention CronJob: their own settings, else the serving pods'
  (the target model needs the same GPU nodes), a ServiceAccount of their own (never the
  namespace's `default`), and, when the shared claim is ReadWriteOnce, a required pod affinity
  to the serving pod's node: such a volume is attached to one node at a time, so a Job placed
  elsewhere would wait forever for the attachment (ReadWriteOncePod claims refuse Jobs outright;
  the CRD says so).
"""

from __future__ import annotations

from typing import Any

from .spec import ServiceSpec

Manifest = dict[str, Any]

HOSTNAME = "kubernetes.io/hostname"
ZONE = "topology.kubernetes.io/zone"
SHARED_ACCESS = "ReadWriteMany"


def jobs_account_name(name: str) -> str:
    return f"{name}-jobs"


def topology_spread(spec: ServiceSpec, selector: dict[str, str]) -> list[Manifest]:
    """The serving pods' spread constraints; each one selects the serving pods unless it says
    otherwise."""
    if spec.topology_spread is None:
        base = [{"maxSkew": 1, "topologyKey": key, "whenUnsatisfiable": "ScheduleAnyway"}
                for key in (ZONE, HOSTNAME)]
    else:
        base = [dict(x) for x in spec.topology_spread]
    for con in base:
        con.setdefault("labelSelector", {"matchLabels": dict(selector)})
    return base


def spec_claim_modes(spec: ServiceSpec) -> list[str]:
    """The access modes of the claim the operator creates; an existing claim's are read from
    the cluster (the handlers pass them), unknown here."""
    return [] if spec.existing_claim else [spec.access_mode]


def needs_colocation(spec: ServiceSpec, claim_modes: list[str]) -> bool:
    """Whether a Job must run on the node of the serving pod: a claim only one node can
    attach, while a serving pod holds it."""
    return bool(claim_modes) and SHARED_ACCESS not in claim_modes and spec.replicas > 0


def merge_affinity(base: Manifest, selector: dict[str, str] | None) -> Manifest:
    """`base` (an Affinity) plus a required pod affinity to the node of the pods `selector`
    picks, when given."""
    out = {k: dict(v) for k, v in (base or {}).items()}
    if selector:
        pod = out.setdefault("podAffinity", {})
        terms = list(pod.get("requiredDuringSchedulingIgnoredDuringExecution") or [])
        terms.append({"labelSelector": {"matchLabels": dict(selector)}, "topologyKey": HOSTNAME})
        pod["requiredDuringSchedulingIgnoredDuringExecution"] = terms
    return out


def _common(node_selector: dict, tolerations: list, affinity: Manifest, priority: str,
            pull_secrets: list[str]) -> Manifest:
    out: Manifest = {}
    if node_selector:
        out["nodeSelector"] = dict(node_selector)
    if tolerations:
        out["tolerations"] = list(tolerations)
    if affinity:
        out["affinity"] = affinity
    if priority:
        out["priorityClassName"] = priority
    if pull_secrets:
        out["imagePullSecrets"] = [{"name": n} for n in pull_secrets]
    return out


def serving_pod(spec: ServiceSpec, selector: dict[str, str]) -> Manifest:
    """Placement fields of the serving pod template."""
    out = _common(spec.node_selector, spec.tolerations, dict(spec.affinity), spec.priority_class,
                  spec.image_pull_secrets)
    spread = topology_spread(spec, selector)
    if spread:
        out["topologySpreadConstraints"] = spread
    return out


def job_pod(spec: ServiceSpec, serving_selector: dict[str, str], claim_modes: list[str],
            name: str) -> Manifest:
    """Placement and identity of a distillation Job's pod: its own settings, else the serving
    pods'; on the serving pod's node when the claim is single-node."""
    d = spec.distillation
    colocate = serving_selector if needs_colocation(spec, claim_modes) else None
    out = _common(d.node_selector or spec.node_selector, d.tolerations or spec.tolerations,
                  merge_affinity(d.affinity, colocate), d.priority_class,
                  d.image_pull_secrets)
    out["serviceAccountName"] = jobs_account_name(name)
    return out


def retention_pod(spec: ServiceSpec, serving_selector: dict[str, str], claim_modes: list[str],
                  name: str) -> Manifest:
    """The retention CronJob's pods: the serving pods' nodes (the claim is there), the Jobs'
    account and priority."""
    colocate = serving_selector if needs_colocation(spec, claim_modes) else None
    out = _common(spec.node_selector, spec.tolerations, merge_affinity(spec.affinity, colocate),
                  spec.distillation.priority_class, spec.image_pull_secrets)
    out["serviceAccountName"] = jobs_account_name(name)
    return out
