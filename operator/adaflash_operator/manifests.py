"""Pure builders of every object the operator owns. No I/O: tests call them directly.

Names, for an AdaFlashService `NAME`:
    NAME-home          PersistentVolumeClaim (unless spec.storage.existingClaim)
    NAME-drafter       ConfigMap with the fleet's drafter version and the blocked versions
    NAME-admin         Secret with the bearer token of the serving pods' admin endpoint
    NAME-serving       ServiceAccount, Role and RoleBinding of the serving pods
    NAME-jobs          ServiceAccount of the Jobs and the CronJob (no permissions, no token)
    NAME               PodDisruptionBudget, NetworkPolicy (policies.py), HPA or ScaledObject
                       (autoscaling.py)
    NAME               Deployment and Service
    NAME-distill-R-A   Job of distillation round R, attempt A (hash-shortened past 63 chars);
                       with distillation.nodes > 1 an Indexed Job and a headless Service of the
                       same name (torchrun's rendezvous), or a JobSet where the cluster has one
    NAME-bootstrap-A   Job that imports or trains the first drafter (spec.drafter.bootstrap)
    NAME-retention     CronJob that prunes old traffic and drafter versions
    NAME-vNNNNNN       DrafterVersion

Every builder returns the whole object as the operator applies it (server-side apply, field
manager `adaflash-operator`): a field the builder stops emitting is removed from the child.
This module holds the names and the serving side; the Jobs that train, the CronJob that prunes
and the DrafterVersion a Job's report becomes are built in job_manifests.py.
"""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Mapping
from typing import Any

from . import contract as c
from . import placement
from .spec import ServiceSpec

Manifest = dict[str, Any]


def owner_reference(owner: Manifest) -> Manifest:
    """Controller reference to `owner`: the garbage collector deletes the child with it."""
    meta = owner["metadata"]
    return {
        "apiVersion": owner.get("apiVersion", c.API_VERSION),
        "kind": owner.get("kind", c.SERVICE_KIND),
        "name": meta["name"],
        "uid": meta["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


def labels(name: str, component: str) -> dict[str, str]:
    return {
        c.LABEL_SERVICE: name,
        c.LABEL_COMPONENT: component,
        c.LABEL_MANAGED_BY: c.MANAGED_BY,
        "app.kubernetes.io/name": "adaflash",
        "app.kubernetes.io/instance": name,
    }


def selector(name: str) -> dict[str, str]:
    """Labels that select exactly the serving pods of `name` (immutable in a Deployment)."""
    return {c.LABEL_SERVICE: name, c.LABEL_COMPONENT: "serving"}


def selector_string(name: str) -> str:
    return ",".join(f"{k}={v}" for k, v in selector(name).items())


def _meta(name: str, namespace: str, component: str, owner: Manifest | None,
          owned: bool = True) -> Manifest:
    meta: Manifest = {"name": name, "namespace": namespace, "labels": labels(
        owner["metadata"]["name"] if owner else name, component)}
    if owner is not None and owned:
        meta["ownerReferences"] = [owner_reference(owner)]
    return meta


def claim_name(name: str, spec: ServiceSpec) -> str:
    return spec.existing_claim or f"{name}-home"


def configmap_name(name: str) -> str:
    return f"{name}-drafter"


def serving_account_name(name: str) -> str:
    return f"{name}-serving"


def admin_secret_name(name: str) -> str:
    return f"{name}-admin"


def short_name(base: str, suffix: str, limit: int = 63) -> str:
    """`base + suffix`, with `base` cut and given a hash when the whole exceeds `limit`
    (Job names become pod labels: 63 characters at most)."""
    if len(base) + len(suffix) <= limit:
        return base + suffix
    digest = hashlib.sha256(base.encode()).hexdigest()[:8]
    keep = max(1, limit - len(suffix) - len(digest) - 1)
    return f"{base[:keep].rstrip('-')}-{digest}{suffix}"


def job_name(name: str, round_: int, attempt: int) -> str:
    # 54: the pods of a JobSet of that name get the hostname `<name>-node-0-<index>` (63 at most)
    return short_name(name, f"-distill-{round_}-{attempt}", 54)


def bootstrap_job_name(name: str, attempt: int) -> str:
    return short_name(name, f"-bootstrap-{attempt}", 54)


def retention_name(name: str) -> str:
    return short_name(name, "-retention", 52)  # CronJob names: 52 characters at most


def drafter_name(name: str, version: str) -> str:
    return f"{name}-{version}"


# Security context shared by every container we run: non-root, read-only root, nothing extra.
CONTAINER_SECURITY = {
    "allowPrivilegeEscalation": False,
    "readOnlyRootFilesystem": True,
    "runAsNonRoot": True,
    "capabilities": {"drop": ["ALL"]},
}
POD_SECURITY = {
    "runAsNonRoot": True,
    "runAsUser": 1000,
    "runAsGroup": 1000,
    "fsGroup": 1000,
    "seccompProfile": {"type": "RuntimeDefault"},
}


def pvc(owner: Manifest, spec: ServiceSpec) -> Manifest:
    name, ns = owner["metadata"]["name"], owner["metadata"]["namespace"]
    body: Manifest = {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        # Not owned unless spec.storage.deleteWithService: the garbage collector must not take
        # the drafters and the traffic with the AdaFlashService.
        "metadata": _meta(claim_name(name, spec), ns, "storage", owner,
                          owned=spec.delete_storage_with_service),
        "spec": {
            "accessModes": [spec.access_mode],
            "resources": {"requests": {"storage": spec.storage_size}},
        },
    }
    if spec.storage_class:
        body["spec"]["storageClassName"] = spec.storage_class
    return body


def blocked_text(blocked: Mapping[str, str]) -> str:
    """The blocked-versions file: ``<version> <phase>`` lines, sorted, so that the same set
    always applies the same bytes (no needless writes)."""
    return "".join(f"{v} {blocked[v]}\n" for v in sorted(blocked))


def blocked_versions(drafter_versions: list[Manifest]) -> dict[str, str]:
    """version -> phase of the DrafterVersions the gate or a rollback took out of service."""
    out = {}
    for dv in drafter_versions:
        phase = (dv.get("status") or {}).get("phase")
        version = (dv.get("spec") or {}).get("version")
        if version and phase in c.BLOCKED_PHASES:
            out[version] = phase
    return out


def configmap(owner: Manifest, version: str, blocked: Mapping[str, str] | None = None) -> Manifest:
    """The fleet version and the versions the pods' admin call refuses without force (both read
    by the pods from the mounted files); also the parameter of the chart's serving-pod admission
    policy, which learns from `serving-service-account` which account is this service's serving
    pods'."""
    name, ns = owner["metadata"]["name"], owner["metadata"]["namespace"]
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(configmap_name(name), ns, "serving", owner),
        "data": {c.FLEET_VERSION_KEY: version,
                 c.BLOCKED_VERSIONS_KEY: blocked_text(blocked or {}),
                 c.SERVING_ACCOUNT_KEY: serving_account_name(name)},
    }


def admin_secret(owner: Manifest, token: str) -> Manifest:
    """The serving pods' admin token. The operator generates it once and keeps it (see
    handlers); it never calls the admin endpoint itself, so only the pods read it."""
    name, ns = owner["metadata"]["name"], owner["metadata"]["namespace"]
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _meta(admin_secret_name(name), ns, "serving", owner),
        "type": "Opaque",
        "data": {c.ADMIN_TOKEN_KEY: base64.b64encode(token.encode()).decode()},
    }


def service_account(owner: Manifest) -> Manifest:
    name, ns = owner["metadata"]["name"], owner["metadata"]["namespace"]
    return {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": _meta(serving_account_name(name), ns, "serving", owner),
        "automountServiceAccountToken": True,  # the reload agent annotates its own pod
    }


def jobs_service_account(owner: Manifest) -> Manifest:
    """The Jobs' and the CronJob's account: no RBAC binding and no token (they never call the
    API), so that they do not run as the namespace's `default` account, which others may have
    granted rights to."""
    name, ns = owner["metadata"]["name"], owner["metadata"]["namespace"]
    return {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": _meta(placement.jobs_account_name(name), ns, "distill", owner),
        "automountServiceAccountToken": False,
    }


def role(owner: Manifest) -> Manifest:
    """Serving pods annotate themselves (loaded version, tau, errors, traffic count).

    RBAC cannot name pods that do not exist yet (Deployment pods have generated names), so this
    grants get/patch on pods of this namespace only, and nothing else: no list, no delete, no
    other resources. The reload agent patches only its own pod (ADAFLASH_POD_NAME).
    """
    name, ns = owner["metadata"]["name"], owner["metadata"]["namespace"]
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": _meta(serving_account_name(name), ns, "serving", owner),
        "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "patch"]}],
    }


def role_binding(owner: Manifest) -> Manifest:
    name, ns = owner["metadata"]["name"], owner["metadata"]["namespace"]
    sa = serving_account_name(name)
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": _meta(sa, ns, "serving", owner),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": sa},
        "subjects": [{"kind": "ServiceAccount", "name": sa, "namespace": ns}],
    }


def _resources(base: dict, gpus: int) -> dict:
    out = {k: dict(v) for k, v in base.items() if k in ("requests", "limits")}
    for part in out.values():
        part.pop("nvidia.com/gpu", None)  # comes from `gpus` only
    if gpus:
        out.setdefault("limits", {})["nvidia.com/gpu"] = gpus
    return {k: v for k, v in out.items() if v}


def server_args(spec: ServiceSpec) -> list[str]:
    """Arguments of `python -m sglang.launch_server` for a serving pod."""
    args = [
        "--model-path", spec.target,
        "--speculative-algorithm", "ADAFLASH",
        # The fleet's version when the container starts (env from the ConfigMap, resolved by the
        # kubelet at start): a new pod starts on what the fleet serves, and a promotion changes
        # no pod template, so it restarts nothing.
        "--speculative-draft-model-path", f"{c.DRAFTERS_DIR}/$({c.ENV_FLEET_VERSION})",
        "--speculative-num-draft-tokens", str(spec.block_size),
        "--host", "0.0.0.0",
        "--port", str(spec.port),
        "--enable-metrics",
    ]
    if spec.gpus > 1:
        args += ["--tp-size", str(spec.gpus)]
    if spec.served_model_name:
        args += ["--served-model-name", spec.served_model_name]
    if spec.log_traffic:
        # SGLang's own request log (docs/contracts.md, "Traffic record"); the kubelet expands
        # $(VAR). SGLang has no ids-only level: below 3 it drops the token ids distillation
        # needs, so 3 (full prompt and output text) it is, and logTraffic is off by default.
        args += ["--log-requests", "--log-requests-level", "3",
                 "--log-requests-format", "json",
                 "--log-requests-target", f"{c.HOME}/traffic/$({c.ENV_POD_NAME})"]
    return args + list(spec.extra_args)


def _env(spec_env: list, fleet_configmap: str, admin_secret: str) -> list[Manifest]:
    return [
        {"name": c.ENV_HOME, "value": c.HOME},
        {"name": c.ENV_FLEET_VERSION, "valueFrom": {"configMapKeyRef": {
            "name": fleet_configmap, "key": c.FLEET_VERSION_KEY}}},
        {"name": c.ENV_POD_NAME, "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": c.ENV_POD_NAMESPACE,
         "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        {"name": c.ENV_FLEET_VERSION_FILE, "value": c.FLEET_VERSION_FILE},
        {"name": c.ENV_POD_ANNOTATIONS_FILE, "value": c.POD_ANNOTATIONS_FILE},
        {"name": c.ENV_BLOCKED_VERSIONS_FILE, "value": c.BLOCKED_VERSIONS_FILE},
        {"name": c.ENV_ADMIN_TOKEN, "valueFrom": {"secretKeyRef": {
            "name": admin_secret, "key": c.ADMIN_TOKEN_KEY}}},
        {"name": "HOME", "value": "/tmp"},
        {"name": "HF_HOME", "value": f"{c.HOME}/hf-cache"},
        {"name": "SGLANG_PLUGINS", "value": "adaflash"},
    ] + list(spec_env)


# SGLang 0.5.23's endpoints for probes: /ping and /ready are flag checks that answer at once
# (startup finished and healthy; and not paused); /health and /health_generate run a one-token
# generation when idle, sleep 1 s before their first check and give up after
# SGLANG_HEALTH_CHECK_TIMEOUT (20 s), so only liveness uses one, with a timeout above that.
STARTUP_PROBE_PATH = "/ping"
READINESS_PROBE_PATH = "/ready"
LIVENESS_PROBE_PATH = "/health_generate"
LIVENESS_TIMEOUT_S = 30


# SGLang creates its request log (the traffic) with the process umask: 027 keeps it, and the
# directories it makes, away from other users (0640 files, 0750 directories; the pods of this
# service share uid and fsGroup). `exec` keeps SGLang as the container's main process.
SERVING_COMMAND = ["sh", "-c", 'umask 027 && exec python -m sglang.launch_server "$@"',
                   "sglang"]


# The serving pods' init container: wait (not crash-loop) until the fleet's drafter is on the
# volume, saying what it waits for; the operator reads its state into a condition.
WAIT_SCRIPT = (
    'v="$' + c.ENV_FLEET_VERSION + '"; m="$' + c.ENV_HOME + '/drafters/$v/manifest.json"; '
    'until [ -f "$m" ]; do echo "adaflash: waiting for drafter $v ($m is not there): '
    'spec.drafter.bootstrap makes it, or publish it (adaflash drafters import)"; sleep 10; done'
)


def wait_for_drafter(spec: ServiceSpec, fleet_configmap: str) -> Manifest:
    return {
        "name": c.WAIT_DRAFTER_CONTAINER,
        "image": spec.image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": ["sh", "-c", WAIT_SCRIPT],
        "env": [{"name": c.ENV_HOME, "value": c.HOME},
                {"name": c.ENV_FLEET_VERSION, "valueFrom": {"configMapKeyRef": {
                    "name": fleet_configmap, "key": c.FLEET_VERSION_KEY}}}],
        "resources": {"requests": {"cpu": "10m", "memory": "16Mi"},
                      "limits": {"memory": "64Mi"}},
        "securityContext": CONTAINER_SECURITY,
        "volumeMounts": [{"name": "home", "mountPath": c.HOME, "readOnly": True}],
    }


def _probe(path_: str, **kw: int) -> Manifest:
    return {"httpGet": {"path": path_, "port": "http"}, **kw}


def _pre_stop(seconds: int) -> Manifest:
    """A terminating pod keeps serving for `seconds` before SIGTERM: the endpoints controllers
    and proxies need that long to stop routing new requests to it. SGLang then drains (it
    answers 503 to its probes and finishes what it is generating)."""
    if not seconds:
        return {}
    return {"lifecycle": {"preStop": {"exec": {"command": ["sh", "-c", f"sleep {seconds}"]}}}}


def deployment(owner: Manifest, spec: ServiceSpec) -> Manifest:
    name, ns = owner["metadata"]["name"], owner["metadata"]["namespace"]
    pod_labels = {**labels(name, "serving"), **selector(name)}
    container: Manifest = {
        "name": c.SERVING_CONTAINER,
        "image": spec.image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": SERVING_COMMAND,
        "args": server_args(spec),
        "env": _env(spec.env, configmap_name(name), admin_secret_name(name)),
        "ports": [{"name": "http", "containerPort": spec.port, "protocol": "TCP"}],
        "resources": _resources(spec.resources, spec.gpus),
        "startupProbe": _probe(STARTUP_PROBE_PATH, periodSeconds=10, timeoutSeconds=5,
                               failureThreshold=max(1, spec.startup_seconds // 10)),
        "readinessProbe": _probe(READINESS_PROBE_PATH, periodSeconds=10, timeoutSeconds=5,
                                 failureThreshold=3),
        "livenessProbe": _probe(LIVENESS_PROBE_PATH, periodSeconds=30,
                                timeoutSeconds=LIVENESS_TIMEOUT_S, failureThreshold=3),
        "securityContext": CONTAINER_SECURITY,
        **_pre_stop(spec.pre_stop_seconds),
        "volumeMounts": [
            {"name": "home", "mountPath": c.HOME},
            {"name": "fleet", "mountPath": f"{c.CONTROL_DIR}/fleet", "readOnly": True},
            {"name": "podinfo", "mountPath": f"{c.CONTROL_DIR}/pod", "readOnly": True},
            {"name": "tmp", "mountPath": "/tmp"},
            {"name": "shm", "mountPath": "/dev/shm"},
        ],
    }
    pod_spec: Manifest = {
        "serviceAccountName": serving_account_name(name),
        "securityContext": POD_SECURITY,
        "initContainers": [wait_for_drafter(spec, configmap_name(name))],
        "containers": [container],
        "volumes": [
            {"name": "home", "persistentVolumeClaim": {"claimName": claim_name(name, spec)}},
            {"name": "fleet", "configMap": {"name": configmap_name(name)}},
            {"name": "podinfo", "downwardAPI": {"items": [
                {"path": "annotations", "fieldRef": {"fieldPath": "metadata.annotations"}},
            ]}},
            {"name": "tmp", "emptyDir": {}},
            {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "16Gi"}},
        ],
    }
    pod_spec.update(placement.serving_pod(spec, selector(name)))
    # Shutdown: the preStop wait, then SGLang's own SIGTERM drain of the generations in flight.
    pod_spec["terminationGracePeriodSeconds"] = spec.pre_stop_seconds + spec.drain_seconds
    if spec.strategy_type == "Recreate":
        strategy: Manifest = {"type": "Recreate"}
    else:  # no surge by default: a surge pod needs a spare GPU node
        strategy = {"type": "RollingUpdate", "rollingUpdate": {
            "maxSurge": spec.max_surge, "maxUnavailable": spec.max_unavailable}}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(name, ns, "serving", owner),
        "spec": {
            "replicas": spec.replicas,
            "strategy": strategy,
            "selector": {"matchLabels": selector(name)},
            "template": {"metadata": {"labels": pod_labels}, "spec": pod_spec},
        },
    }


def service(owner: Manifest, spec: ServiceSpec) -> Manifest:
    name, ns = owner["metadata"]["name"], owner["metadata"]["namespace"]
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(name, ns, "serving", owner),
        "spec": {
            "selector": selector(name),
            "ports": [{"name": "http", "port": spec.port, "targetPort": "http",
                       "protocol": "TCP"}],
        },
    }
