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

from . import crds


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
    dist = spec.get("distillation", {})
    if dist.get("maxBackoffSeconds", 1) < dist.get("backoffSeconds", 1):
        problems.append("spec.distillation.maxBackoffSeconds must be >= backoffSeconds")
    storage = spec.get("storage") or {}
    if isinstance(storage, dict) and not storage.get("existingClaim") and \
            storage.get("accessMode") in ("ReadWriteOnce", "ReadWriteOncePod") and \
            isinstance(spec.get("replicas"), int) and spec["replicas"] > 1:
        problems.append(f"spec: {crds.SINGLE_NODE_RULE['message']}")
    if isinstance(storage, dict) and not storage.get("existingClaim") and \
            storage.get("accessMode") != "ReadWriteMany" and isinstance(dist, dict) and \
            isinstance(dist.get("nodes"), int) and dist["nodes"] > 1:
        problems.append(f"spec: {crds.MULTI_NODE_RULE['message']}")
    boot = (spec.get("drafter") or {}).get("bootstrap")
    if isinstance(boot, dict) and boot.get("source") == "Import" and not boot.get("path"):
        problems.append("spec.drafter.bootstrap.path: Import needs the checkpoint's directory "
                        "on the claim")
    if problems:
        raise InvalidSpec("; ".join(problems) + ". Fix the AdaFlashService spec (see "
                          "docs/operator.md for every field).")
    return spec


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
    raw: dict = field(repr=False, compare=False, default_factory=dict)


def parse(raw: dict | None) -> ServiceSpec:
    s = validate(raw)
    sv, st, dr, di, ro, re_ = (s["serving"], s["storage"], s["drafter"], s["distillation"],
                               s["rollout"], s["retention"])
    us = sv["updateStrategy"]
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
        raw=s,
    )
