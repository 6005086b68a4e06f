"""The children of an AdaFlashService: applied, adopted, removed when the spec drops them, and
every refusal reported instead of stopping the rest.

Each child is written by server-side apply (field manager `adaflash-operator`) only when what
the operator would apply changed, or someone else took a field it applies. A child the API
server refuses (a 4xx: an invalid object, a quota, a policy, RBAC) or that another controller
owns becomes a `Problem` with the server's own message, and the other children are still
reconciled; the handlers turn problems into conditions and events. Transport errors and 5xx
(already retried by kube.py) still propagate: the next tick tries again.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from . import autoscaling, job_manifests, kube, manifests, placement, policies, quantity
from . import contract as c
from . import spec as spec_mod


class Conflict(Exception):
    """A child exists but another controller owns it."""


@dataclass(frozen=True)
class Problem:
    """A child that could not be written."""
    kind: str
    name: str
    reason: str  # ChildConflict | ChildRefused
    message: str

    def text(self) -> str:
        return f"{self.kind} {self.name}: {self.message}"


@dataclass
class Result:
    deployment: dict | None  # None: refused, or owned by someone else
    fleet_data: dict  # the ConfigMap's data (fleet version, blocked versions)
    fleet_ok: bool  # False: the ConfigMap was refused (the data is the live one, or defaults)
    claim_modes: list[str]  # access modes of the shared claim ([]: unknown)
    problems: list[Problem] = field(default_factory=list)
    admin_secret_recreated: bool = False


def refused(e: kube.ApiError) -> bool:
    """A final answer about this object (retrying the same request cannot help), as opposed
    to a server or network hiccup."""
    return 400 <= e.status < 500 and e.status not in (408, 429)


# What the operator last applied to each child: (uid, digest of the applied object, the fields
# the server says it owns). Unchanged on both sides: nothing to send. A field someone else took
# over (kubectl edit) changes what we own, so drift is repaired; the server's own rewrites
# ("1024Mi" -> "1Gi") change neither, so they cost no request.
_applied: dict[tuple[str, str, str], tuple[str, str, str]] = {}
# Optional children known to be absent (not ours to delete, or already deleted).
_absent: set[tuple[str, str, str]] = set()
# Admin Secrets: (namespace, name, owner uid) -> when their existence was last ensured.
_admin_secrets: dict[tuple[str, str, str], float] = {}


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def controller(obj: dict) -> dict | None:
    owners = (obj.get("metadata") or {}).get("ownerReferences") or []
    return next((o for o in owners if o.get("controller")), None)


async def ensure(desired: dict, owner_uid: str, adjust=None) -> dict:
    """Create or update a child by server-side apply; raise Conflict if another controller
    owns it. `adjust(desired, live)` may change what is applied to an existing child."""
    meta = desired["metadata"]
    kind, ns, name = desired["kind"], meta["namespace"], meta["name"]
    key = (kind, ns, name)
    _absent.discard(key)
    live = await kube.get(kind, ns, name)
    if live is not None:
        ctl = controller(live)
        if ctl is not None and ctl.get("uid") != owner_uid:
            raise Conflict(f"{kind} {ns}/{name} already exists and is controlled by "
                           f"{ctl.get('kind')} {ctl.get('name')}; delete it or rename the "
                           f"AdaFlashService")
        if adjust is not None:
            desired = adjust(desired, live)
    digest = _digest(desired)
    if live is not None and _applied.get(key) == (
            live["metadata"].get("uid"), digest, _digest(kube.managed_fields(live))):
        return live
    result = await kube.apply(desired)
    _applied[key] = (result["metadata"].get("uid"), digest,
                     _digest(kube.managed_fields(result)))
    return result


async def remove(kind: str, ns: str, name: str, owner_uid: str) -> None:
    """Delete an optional child the spec no longer asks for, if this AdaFlashService controls
    it (the HPA of a disabled autoscaler would go on scaling)."""
    key = (kind, ns, name)
    if key in _absent:
        return
    live = await kube.get(kind, ns, name)
    if live is not None and (controller(live) or {}).get("uid") == owner_uid:
        await kube.delete(kind, ns, name)
    _applied.pop(key, None)
    _absent.add(key)


def keep_claim_spec(desired: dict, live: dict) -> dict:
    """A bound claim's spec is immutable but for growth: apply what it has, with the larger of
    its size and the spec's (the API server refuses to shrink a claim, and refuses growth when
    the storage class does not allow expansion: that refusal becomes a condition)."""
    sp = live.get("spec") or {}
    have = ((sp.get("resources") or {}).get("requests") or {}).get("storage")
    want = desired["spec"]["resources"]["requests"]["storage"]
    keep: dict = {"accessModes": sp.get("accessModes"),
                  "resources": {"requests": {"storage": quantity.larger(have, want)
                                             if have else want}}}
    if desired["spec"].get("storageClassName") and sp.get("storageClassName"):
        keep["storageClassName"] = sp["storageClassName"]
    return {**desired, "spec": keep}


def keep_fleet_version(desired: dict, live: dict) -> dict:
    """The fleet version and the blocked versions in the ConfigMap belong to the rollout;
    reconciling keeps them."""
    data = live.get("data") or {}
    keep = {}
    if data.get(c.FLEET_VERSION_KEY):
        keep[c.FLEET_VERSION_KEY] = data[c.FLEET_VERSION_KEY]
    if c.BLOCKED_VERSIONS_KEY in data:
        keep[c.BLOCKED_VERSIONS_KEY] = data[c.BLOCKED_VERSIONS_KEY]
    return {**desired, "data": {**desired["data"], **keep}}


async def ensure_admin_secret(owner: dict, recheck_s: float) -> bool:
    """Make sure the serving pods' admin token exists; True when it had to be (re)created after
    this process had seen it. The operator may create Secrets but read none (least privilege),
    so existence is checked by creating one: a 409 means it is there, and is kept as it is (an
    administrator may bring their own token). A deleted Secret comes back within `recheck_s`
    (serving pods cannot start without it), with a new token."""
    meta = owner["metadata"]
    key = (meta["namespace"], manifests.admin_secret_name(meta["name"]), meta["uid"])
    last = _admin_secrets.get(key)
    if last is not None and time.monotonic() - last < recheck_s:
        return False
    try:
        await kube.create(manifests.admin_secret(owner, secrets.token_urlsafe(32)))
        made = last is not None
    except kube.ApiError as e:
        if e.status != 409:
            raise
        made = False
    _admin_secrets[key] = time.monotonic()
    return made


def forget(namespace: str) -> None:
    """Drop what this process remembers of the children in `namespace`."""
    for cache in (_applied, _admin_secrets):
        for key in [k for k in cache if (k[1] if cache is _applied else k[0]) == namespace]:
            cache.pop(key, None)
    for key in [k for k in _absent if k[1] == namespace]:
        _absent.discard(key)


async def reconcile(owner: dict, s: spec_mod.ServiceSpec, *, secret_recheck_s: float,
                    keda_served: bool) -> Result:
    """Ensure every child, in the order the pods need them (the claim, the fleet ConfigMap and
    the admin Secret before the Deployment whose pods read them)."""
    uid = owner["metadata"]["uid"]
    ns, name = owner["metadata"]["namespace"], owner["metadata"]["name"]
    problems: list[Problem] = []

    async def step(kind: str, child_name: str, action) -> Any:
        try:
            return await action()
        except Conflict as e:
            problems.append(Problem(kind, child_name, "ChildConflict", str(e)))
        except kube.ApiError as e:
            if not refused(e):
                raise
            problems.append(Problem(kind, child_name, "ChildRefused", e.message))
        return None

    def apply(desired: dict, adjust=None):
        return step(desired["kind"], desired["metadata"]["name"],
                    lambda: ensure(desired, uid, adjust))

    def drop(kind: str, child_name: str):
        return step(kind, child_name, lambda: remove(kind, ns, child_name, uid))

    modes = placement.spec_claim_modes(s)
    if not s.existing_claim:
        claim = await apply(manifests.pvc(owner, s), keep_claim_spec)
        if claim is not None:
            modes = list((claim.get("spec") or {}).get("accessModes") or modes)
    else:
        live = await step("PersistentVolumeClaim", s.existing_claim,
                          lambda: kube.get("PersistentVolumeClaim", ns, s.existing_claim))
        modes = list(((live or {}).get("spec") or {}).get("accessModes") or [])
    desired_cm = manifests.configmap(owner, s.pinned_version or s.initial_version)
    cm = await apply(desired_cm, keep_fleet_version)
    fleet_ok = cm is not None
    if cm is None:  # refused: what the cluster has, else what the spec starts from
        cm = await kube.get("ConfigMap", ns, desired_cm["metadata"]["name"]) or desired_cm
    data = dict(cm.get("data") or {})
    data[c.FLEET_VERSION_KEY] = data.get(c.FLEET_VERSION_KEY) or s.initial_version
    recreated = await step("Secret", manifests.admin_secret_name(name),
                           lambda: ensure_admin_secret(owner, secret_recheck_s))
    for child in (manifests.service_account(owner), manifests.jobs_service_account(owner),
                  manifests.role(owner), manifests.role_binding(owner)):
        await apply(child)
    dep = await apply(manifests.deployment(owner, s))
    await apply(manifests.service(owner, s))
    await apply(job_manifests.retention_cronjob(owner, s, modes))
    if s.pdb_enabled:
        await apply(policies.pod_disruption_budget(owner, s))
    else:
        await drop("PodDisruptionBudget", name)
    if s.network_policy:
        await apply(policies.network_policy(owner, s))
    else:
        await drop("NetworkPolicy", name)
    keda = autoscaling.use_keda(s, keda_served)
    if s.autoscaling is not None and not keda:
        await apply(autoscaling.hpa(owner, s))
    else:
        await drop("HorizontalPodAutoscaler", name)
    if keda:
        await apply(autoscaling.scaled_object(owner, s))
    elif keda_served:
        await drop("ScaledObject", name)
    return Result(deployment=dep, fleet_data=data, fleet_ok=fleet_ok, claim_modes=modes,
                  problems=problems, admin_secret_recreated=bool(recreated))


def serving_trouble(deployment: dict | None, pods: list[dict]) -> str:
    """Why serving pods are missing or not ready, in the cluster's words: the Deployment's
    ReplicaFailure (a quota or an admission policy refused the pods) and the scheduler's
    verdict on pending pods (e.g. "0/4 nodes are available: 4 Insufficient nvidia.com/gpu")."""
    out = []
    for cond in ((deployment or {}).get("status") or {}).get("conditions") or []:
        if cond.get("type") == "ReplicaFailure" and cond.get("status") == "True":
            out.append(f"pods refused: {cond.get('message') or cond.get('reason')}")
    for p in sorted(pods, key=lambda p: p["metadata"]["name"]):
        for cond in (p.get("status") or {}).get("conditions") or []:
            if cond.get("type") == "PodScheduled" and cond.get("status") == "False":
                out.append(f"pod {p['metadata']['name']} {cond.get('reason') or 'unscheduled'}: "
                           f"{cond.get('message') or ''}".rstrip(": "))
    return "; ".join(out)[:1000]
