"""The AdaFlashService spec as a typed dataclass, validated against the CRD schema.

The API server already validates and defaults with the CRD schema; the operator checks again so
that an object written past an old or missing schema ends in a clear `Ready=False InvalidSpec`
condition instead of a half-built deployment. Defaults come from the same schema (crds.py).
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field
from typing import Any

import jsonschema

from . import crds, quantity


class InvalidSpec(ValueError):
    """The spec breaks the schema or a cross-field rule; the message says what to fix."""


def apply_defaults(schema: dict, value: Any) -> Any:
    """Fill `default`s of a structural schema the way the API server does (objects only)."""
    if schema.get("type") != "object" or not isinstance(value, dict):
        return value
    out = dict(value)
    for key, sub in schema.get("properties", {}).items():
        if key not in out and "default" in sub:
            out[key] = copy.deepcopy(sub["default"])
        if key in out:
            out[key] = apply_defaults(sub, out[key])
    return out


def _path(err: jsonschema.ValidationError) -> str:
    return "spec" + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in err.absolute_path)


def validate(raw: dict | None) -> dict:
    """Return the defaulted spec, or raise InvalidSpec listing every problem."""
    spec = apply_defaults(crds.SERVICE_SPEC, dict(raw or {}))
    validator = jsonschema.Draft4Validator(crds.SERVICE_SPEC)
    errors = sorted(validator.iter_errors(spec), key=lambda e: list(e.absolute_path))
    problems = [f"{_path(e)}: {e.message}" for e in errors]
    if not problems:  # the cross-field rules read typed fields
        problems += cross_field_problems(spec)
    if problems:
        raise InvalidSpec("; ".join(problems) + ". Fix the AdaFlashService spec (see "
                          "docs/operator.md for every field).")
    return spec


def _zero(v: Any) -> bool:
    return re.match(r"^0+%?$", str(v)) is not None


def _resource_problems(where: str, res: dict) -> list[str]:
    out = []
    parsed: dict[str, dict] = {}
    for part in ("requests", "limits"):
        for k, v in (res.get(part) or {}).items():
            try:
                parsed.setdefault(part, {})[k] = quantity.parse(v)
            except ValueError:
                out.append(f"{where}.{part}.{k}: {crds.QUANTITY_MESSAGE}")
    for k, req in (parsed.get("requests") or {}).items():
        lim = (parsed.get("limits") or {}).get(k)
        if lim is not None and req > lim:
            out.append(f"{where}: {k}: {crds.RESOURCE_RULES[0]['message']}")
    return out


def cross_field_problems(spec: dict) -> list[str]:
    """The CRD's CEL rules (crds.SPEC_RULES, ROLLING_RULES, RESOURCE_RULES), in Python, on a
    defaulted spec that passed the schema. The messages are the CRD's."""
    st, sv, di = spec["storage"], spec["serving"], spec["distillation"]
    single = not st.get("existingClaim") and st["accessMode"] != "ReadWriteMany"
    us, auto = sv["updateStrategy"], spec["autoscaling"]
    boot = spec["drafter"].get("bootstrap")
    broken = [
        single and spec["replicas"] > 1,
        single and st["accessMode"] == "ReadWriteOncePod" and
        (di["enabled"] or spec["retention"]["enabled"] or boot is not None),
        single and us["type"] != "Recreate" and not _zero(us["maxSurge"]),
        auto["enabled"] and single and auto["maxReplicas"] > 1,
        auto["minReplicas"] > auto["maxReplicas"],
        di["maxBackoffSeconds"] < di["backoffSeconds"],
        single and di["nodes"] > 1,
        boot is not None and boot["source"] == "Import" and not boot.get("path"),
    ]
    assert len(broken) == len(crds.SPEC_RULES)
    out = [f"spec: {r['message']}" for r, bad in zip(crds.SPEC_RULES, broken) if bad]
    for rule, bad in zip(crds.ROLLING_RULES, [
        not (us["maxSurge"] >= 0 if isinstance(us["maxSurge"], int)
             else re.match(r"^[0-9]+%$", us["maxSurge"])),
        not (us["maxUnavailable"] >= 0 if isinstance(us["maxUnavailable"], int)
             else re.match(r"^0*([0-9]{1,2}|100)%$", us["maxUnavailable"])),
        us["type"] == "RollingUpdate" and _zero(us["maxSurge"]) and _zero(us["maxUnavailable"]),
    ]):
        if bad:
            out.append(f"spec.serving.updateStrategy: {rule['message']}")
    out += _resource_problems("spec.serving.resources", sv.get("resources") or {})
    out += _resource_problems("spec.distillation.resources", di.get("resources") or {})
    return out


def check_name(name: str) -> None:
    """The CRD's rules on metadata.name (for objects written past an old CRD)."""
    problems = [f"metadata.name {name!r}: {r['message']}" for r, ok in (
        (crds.SERVICE_NAME_RULES[0], len(name) <= crds.SERVICE_NAME_MAX),
        (crds.SERVICE_NAME_RULES[1], re.match(crds.SERVICE_NAME_PATTERN, name) is not None),
    ) if not ok]
    if problems:
        raise InvalidSpec("; ".join(problems) + ". Recreate the AdaFlashService under a valid "
                          "name.")


@dataclass(frozen=True)
class Retention:
    enabled: bool
    traffic_days: int
    keep_versions: int
    schedule: str


@dataclass(frozen=True)
class Rollout:
    min_tau_gain: float
    canary_fraction: float
    bake_seconds: int
    load_timeout_seconds: int
    max_live_tau_drop: float
    auto_promote: bool


@dataclass(frozen=True)
class Autoscaling:
    enabled: bool
    min_replicas: int
    max_replicas: int
    target_queue_depth: int
    metric: str
    prometheus_address: str


@dataclass(frozen=True)
class Bootstrap:
    source: str  # Import | Train
    path: str  # relative to the claim's root; "" (Train): the volume's traffic
    extra_args: list[str]


@dataclass(frozen=True)
class Distillation:
    enabled: bool
    image: str
    gpus: int
    nodes: int
    resources: dict
    min_new_records: int
    interval_seconds: int
    backoff_seconds: int
    max_backoff_seconds: int
    active_deadline_seconds: int
    extra_args: list[str]
    node_selector: dict
    tolerations: list
    # Default to the serving pods'.
    image_pull_secrets: list = field(default_factory=list)
    affinity: dict = field(default_factory=dict)
    priority_class: str = ""


@dataclass(frozen=True)
class ServiceSpec:
    target: str
    served_model_name: str
    replicas: int
    image: str
    image_pull_policy: str
    port: int
    block_size: int
    gpus: int
    extra_args: list[str]
    env: list
    resources: dict
    node_selector: dict
    tolerations: list
    startup_seconds: int
    log_traffic: bool
    strategy_type: str
    max_surge: int | str
    max_unavailable: int | str
    existing_claim: str
    storage_size: str
    storage_class: str
    access_mode: str
    delete_storage_with_service: bool
    initial_version: str
    pinned_version: str
    bootstrap: Bootstrap | None
    distillation: Distillation
    rollout: Rollout
    retention: Retention
    # Production shape (placement, disruption, shutdown, network, autoscaling).
    image_pull_secrets: list = field(default_factory=list)
    affinity: dict = field(default_factory=dict)
    priority_class: str = ""
    topology_spread: list | None = None  # None: the operator's soft default; []: none
    pdb_enabled: bool = True
    pdb_max_unavailable: int | str = 1
    pre_stop_seconds: int = 10
    drain_seconds: int = 300
    network_policy: bool = False
    network_policy_from: list = field(default_factory=list)
    autoscaling: Autoscaling | None = None
    raw: dict = field(repr=False, compare=False, default_factory=dict)


def parse(raw: dict | None) -> ServiceSpec:
    s = validate(raw)
    sv, st, dr, di, ro, re_ = (s["serving"], s["storage"], s["drafter"], s["distillation"],
                               s["rollout"], s["retention"])
    us, au = sv["updateStrategy"], s["autoscaling"]
    return ServiceSpec(
        target=s["model"]["target"],
        served_model_name=s["model"].get("servedModelName", ""),
        replicas=s["replicas"],
        image=sv["image"],
        image_pull_policy=sv["imagePullPolicy"],
        port=sv["port"],
        block_size=sv["blockSize"],
        gpus=sv["gpus"],
        extra_args=list(sv.get("extraArgs", [])),
        env=list(sv.get("env", [])),
        resources=dict(sv.get("resources", {})),
        node_selector=dict(sv.get("nodeSelector", {})),
        tolerations=list(sv.get("tolerations", [])),
        startup_seconds=sv["startupSeconds"],
        log_traffic=sv["logTraffic"],
        strategy_type=us["type"],
        max_surge=us["maxSurge"],
        max_unavailable=us["maxUnavailable"],
        existing_claim=st.get("existingClaim", ""),
        storage_size=st["size"],
        storage_class=st.get("storageClassName", ""),
        access_mode=st["accessMode"],
        delete_storage_with_service=st["deleteWithService"],
        initial_version=dr["initialVersion"],
        pinned_version=dr.get("pinnedVersion", ""),
        bootstrap=Bootstrap(source=dr["bootstrap"]["source"],
                            path=dr["bootstrap"].get("path", ""),
                            extra_args=list(dr["bootstrap"].get("extraArgs", [])))
        if dr.get("bootstrap") else None,
        distillation=Distillation(
            enabled=di["enabled"],
            image=di.get("image") or sv["image"],
            gpus=di["gpus"],
            nodes=di["nodes"],
            resources=dict(di.get("resources", {})),
            min_new_records=di["minNewRecords"],
            interval_seconds=di["intervalSeconds"],
            backoff_seconds=di["backoffSeconds"],
            max_backoff_seconds=di["maxBackoffSeconds"],
            active_deadline_seconds=di["activeDeadlineSeconds"],
            extra_args=list(di.get("extraArgs", [])),
            node_selector=dict(di.get("nodeSelector", {})),
            tolerations=list(di.get("tolerations", [])),
            image_pull_secrets=list(di.get("imagePullSecrets", sv.get("imagePullSecrets", []))),
            affinity=dict(di.get("affinity", sv.get("affinity", {}))),
            priority_class=di.get("priorityClassName", ""),
        ),
        rollout=Rollout(
            min_tau_gain=ro["minTauGain"],
            canary_fraction=ro["canaryFraction"],
            bake_seconds=ro["bakeSeconds"],
            load_timeout_seconds=ro["loadTimeoutSeconds"],
            max_live_tau_drop=ro["maxLiveTauDrop"],
            auto_promote=ro["autoPromote"],
        ),
        retention=Retention(
            enabled=re_["enabled"],
            traffic_days=re_["trafficDays"],
            keep_versions=re_["keepVersions"],
            schedule=re_["schedule"],
        ),
        image_pull_secrets=list(sv.get("imagePullSecrets", [])),
        affinity=dict(sv.get("affinity", {})),
        priority_class=sv.get("priorityClassName", ""),
        topology_spread=(list(sv["topologySpreadConstraints"])
                         if "topologySpreadConstraints" in sv else None),
        pdb_enabled=sv["podDisruptionBudget"]["enabled"],
        pdb_max_unavailable=sv["podDisruptionBudget"]["maxUnavailable"],
        pre_stop_seconds=sv["shutdown"]["preStopSeconds"],
        drain_seconds=sv["shutdown"]["drainSeconds"],
        network_policy=sv["networkPolicy"]["enabled"],
        network_policy_from=list(sv["networkPolicy"].get("from", [])),
        autoscaling=Autoscaling(
            enabled=au["enabled"], min_replicas=au["minReplicas"],
            max_replicas=au["maxReplicas"], target_queue_depth=au["targetQueueDepth"],
            metric=au["metric"], prometheus_address=au.get("prometheusAddress", ""),
        ) if au["enabled"] else None,
        raw=s,
    )
