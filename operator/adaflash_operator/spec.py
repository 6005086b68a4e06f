"""The AdaFlashService spec as a typed dataclass, validated against the CRD schema.

The API server already validates and defaults with the CRD schema; the operator checks again so
that an object written past an old or missing schema ends in a clear `Ready=False InvalidSpec`
condition instead of a half-built deployment. Defaults come from the same schema (crds.py).
"""

from __future__ import annotations

import copy
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
    if problems:
        raise InvalidSpec("; ".join(problems) + ". Fix the AdaFlashService spec (see "
                          "docs/operator.md for every field).")
    return spec


@dataclass(frozen=True)
class Rollout:
    min_tau_gain: float
    canary_fraction: float
    bake_seconds: int
    load_timeout_seconds: int
    max_live_tau_drop: float
    auto_promote: bool


@dataclass(frozen=True)
class Distillation:
    enabled: bool
    image: str
    gpus: int
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
    existing_claim: str
    storage_size: str
    storage_class: str
    access_mode: str
    initial_version: str
    pinned_version: str
    distillation: Distillation
    rollout: Rollout
    raw: dict = field(repr=False, compare=False, default_factory=dict)


def parse(raw: dict | None) -> ServiceSpec:
    s = validate(raw)
    sv, st, dr, di, ro = (s["serving"], s["storage"], s["drafter"], s["distillation"],
                          s["rollout"])
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
        existing_claim=st.get("existingClaim", ""),
        storage_size=st["size"],
        storage_class=st.get("storageClassName", ""),
        access_mode=st["accessMode"],
        initial_version=dr["initialVersion"],
        pinned_version=dr.get("pinnedVersion", ""),
        distillation=Distillation(
            enabled=di["enabled"],
            image=di.get("image") or sv["image"],
            gpus=di["gpus"],
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
        raw=s,
    )
