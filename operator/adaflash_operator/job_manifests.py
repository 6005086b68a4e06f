"""Pure builders of the objects the operator creates around training, from a service's spec.

The distillation Job of a round (one pod, an Indexed Job over several nodes with its headless
rendezvous Service, or a JobSet), the bootstrap Job that puts the first drafter on the volume,
the retention CronJob, and the DrafterVersion a Job's report becomes. Names, labels and the
security contexts they share with the serving side come from manifests.py. No I/O: tests call
them directly.
"""

from __future__ import annotations

from . import contract as c
from . import placement
from .manifests import (
    CONTAINER_SECURITY,
    POD_SECURITY,
    Manifest,
    _meta,
    _resources,
    bootstrap_job_name,
    claim_name,
    configmap_name,
    drafter_name,
    job_name,
    labels,
    retention_name,
    selector,
)
from .spec import ServiceSpec


def distill_args(spec: ServiceSpec, parent: str) -> list[str]:
    """Arguments of `python -m training_job.distill` (the training job's CLI contract)."""
    return [
        "--home", c.HOME,
        "--target", spec.target,
        "--parent", parent,
        "--min-records", str(spec.distillation.min_new_records),
        "--report", c.TERMINATION_LOG,
        # Too few new records is a report, not a failure: the Job completes (docs/contracts.md).
        "--idle-exit-code", "0",
        # The Job's gate asks the gain the rollout gate asks (its decision is in the report).
        "--gate-min-gain", f"{spec.rollout.min_tau_gain:g}",
    ] + list(spec.distillation.extra_args)


#: torchrun's rendezvous port on a multi-node Job's first pod.
RENDEZVOUS_PORT = 29500
#: The JobSet API the operator uses where the cluster serves it (detected, not assumed).
JOBSET_API = "jobset.x-k8s.io/v1alpha2"
JOBSET_REPLICA = "node"


def rendezvous_host(jname: str, namespace: str, jobset: bool = False) -> str:
    """DNS name of a multi-node Job's first pod: an Indexed Job's pods are `<job>-<index>`
    under the headless Service `<job>`; a JobSet's `<jobset>-<replica>-0-<index>` under the
    subdomain it creates, named after the JobSet."""
    pod = f"{jname}-{JOBSET_REPLICA}-0-0" if jobset else f"{jname}-0"
    return f"{pod}.{jname}.{namespace}.svc"


def launcher(gpus: int, nodes: int, jname: str, namespace: str, module: str, *,
             jobset: bool = False) -> list[str]:
    """The container's command: torchrun with a process per GPU of the pod (and, over several
    nodes, c10d rendezvous at the first pod), or plain python for one process."""
    if gpus <= 1 and nodes <= 1:
        return ["python", "-m", module]
    cmd = ["torchrun", f"--nproc-per-node={max(1, gpus)}"]
    if nodes > 1:
        cmd += [f"--nnodes={nodes}", "--rdzv-backend=c10d",
                f"--rdzv-endpoint={rendezvous_host(jname, namespace, jobset)}:"
                f"{RENDEZVOUS_PORT}", f"--rdzv-id={jname}"]
    return cmd + ["-m", module]


def _training_pod(name: str, spec: ServiceSpec, container: str, command: list[str],
                  args: list[str], resources: dict, gpus: int,
                  claim_modes: list[str] | None) -> Manifest:
    """Pod spec of the Jobs that train (distillation, bootstrap): the shared volume, the
    termination message as the report, no API token, the Jobs' account, pull secrets,
    affinity and priority, the serving pods' placement by default."""
    d = spec.distillation
    pod_spec: Manifest = {
        "restartPolicy": "Never",
        # The job never calls the API: no token in its pods.
        "automountServiceAccountToken": False,
        "securityContext": POD_SECURITY,
        "containers": [{
            "name": container,
            "image": d.image,
            "imagePullPolicy": spec.image_pull_policy,
            "command": command,
            "args": args,
            "env": [{"name": c.ENV_HOME, "value": c.HOME}, {"name": "HOME", "value": "/tmp"},
                    {"name": "HF_HOME", "value": f"{c.HOME}/hf-cache"}],
            "resources": _resources(resources, gpus),
            "terminationMessagePath": c.TERMINATION_LOG,
            "terminationMessagePolicy": "File",
            "securityContext": CONTAINER_SECURITY,
            "volumeMounts": [{"name": "home", "mountPath": c.HOME},
                             {"name": "tmp", "mountPath": "/tmp"},
                             {"name": "shm", "mountPath": "/dev/shm"}],
        }],
        "volumes": [
            {"name": "home", "persistentVolumeClaim": {"claimName": claim_name(name, spec)}},
            {"name": "tmp", "emptyDir": {}},
            {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "16Gi"}},
        ],
    }
    # Placement: the job's own, else the serving pods' (the GPU nodes they are allowed on); on
    # the serving pod's node when the claim is single-node.
    modes = placement.spec_claim_modes(spec) if claim_modes is None else claim_modes
    pod_spec.update(placement.job_pod(spec, selector(name), modes, name))
    return pod_spec


def _job_spec(pod_labels: dict, pod_spec: Manifest, deadline: int, nodes: int = 1) -> Manifest:
    body: Manifest = {
        # The operator retries with its own backoff and records every failure in status.
        "backoffLimit": 0,
        "activeDeadlineSeconds": deadline,
        "ttlSecondsAfterFinished": 7 * 24 * 3600,
        "template": {"metadata": {"labels": pod_labels}, "spec": pod_spec},
    }
    if nodes > 1:
        # One pod per node, each `<job>-<index>`; any pod's failure fails the Job.
        body.update(completionMode="Indexed", completions=nodes, parallelism=nodes)
    return body


def job(owner: Manifest, spec: ServiceSpec, round_: int, attempt: int, parent: str,
        claim_modes: list[str] | None = None, *, jobset: bool = False) -> Manifest:
    """The distillation Job of a round: one pod (torchrun over its GPUs), or with
    ``distillation.nodes > 1`` an Indexed Job of that many pods whose torchruns meet at the
    first pod (c10d), found through the headless Service :func:`rendezvous_service` of the same
    name; with ``jobset`` a JobSet instead, which makes its own headless Service. ``claim_modes``:
    the shared claim's access modes as found (None: from the spec), for the placement."""
    name, ns = owner["metadata"]["name"], owner["metadata"]["namespace"]
    jname = job_name(name, round_, attempt)
    d = spec.distillation
    pod_labels = {**labels(name, "distill"), c.LABEL_ROUND: str(round_),
                  c.LABEL_DISTILL_JOB: jname}
    pod_spec = _training_pod(name, spec, c.DISTILL_CONTAINER,
                             launcher(d.gpus, d.nodes, jname, ns, "training_job.distill",
                                      jobset=jobset),
                             distill_args(spec, parent), d.resources or spec.resources, d.gpus,
                             claim_modes)
    if d.nodes > 1:
        pod_spec["containers"][0]["ports"] = [{"name": "rendezvous",
                                               "containerPort": RENDEZVOUS_PORT}]
        if not jobset:
            pod_spec["subdomain"] = jname
    meta = _meta(jname, ns, "distill", owner)
    meta["labels"][c.LABEL_ROUND] = str(round_)
    body = _job_spec(pod_labels, pod_spec, d.active_deadline_seconds, d.nodes)
    if jobset:
        return {"apiVersion": JOBSET_API, "kind": "JobSet", "metadata": meta, "spec": {
            "network": {"enableDNSHostnames": True, "subdomain": jname,
                        "publishNotReadyAddresses": True},
            "failurePolicy": {"maxRestarts": 0},
            "replicatedJobs": [{"name": JOBSET_REPLICA, "replicas": 1,
                                "template": {"spec": body}}],
        }}
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": meta, "spec": body}


def bootstrap_args(spec: ServiceSpec) -> list[str]:
    """Arguments of `python -m training_job.bootstrap` (docs/operator.md, "Bootstrap")."""
    b = spec.bootstrap
    args = ["--home", c.HOME, "--target", spec.target, "--version", spec.initial_version,
            "--report", c.TERMINATION_LOG]
    if b.source == "Import":
        args += ["--import", f"{c.HOME}/{b.path}"]
    else:
        args += ["--train"] + (["--prompts", f"{c.HOME}/{b.path}"] if b.path else [])
    return args + (["--", *b.extra_args] if b.extra_args else [])


#: An import reads a checkpoint and the target's config: no GPU, little memory.
IMPORT_RESOURCES = {"requests": {"cpu": "1", "memory": "2Gi"}, "limits": {"memory": "8Gi"}}


def bootstrap_job(owner: Manifest, spec: ServiceSpec, attempt: int,
                  claim_modes: list[str] | None = None) -> Manifest:
    """The Job that puts the first drafter (spec.drafter.initialVersion) on the volume: an
    import (one small process), or the offline recipe (one pod, torchrun over its GPUs)."""
    name, ns = owner["metadata"]["name"], owner["metadata"]["namespace"]
    jname = bootstrap_job_name(name, attempt)
    d = spec.distillation
    train = spec.bootstrap.source == "Train"
    command = launcher(d.gpus if train else 0, 1, jname, ns, "training_job.bootstrap")
    pod_spec = _training_pod(name, spec, c.BOOTSTRAP_CONTAINER, command, bootstrap_args(spec),
                             (d.resources or spec.resources) if train else IMPORT_RESOURCES,
                             d.gpus if train else 0, claim_modes)
    pod_labels = {**labels(name, "bootstrap"), c.LABEL_DISTILL_JOB: jname}
    return {"apiVersion": "batch/v1", "kind": "Job",
            "metadata": _meta(jname, ns, "bootstrap", owner),
            "spec": _job_spec(pod_labels, pod_spec, d.active_deadline_seconds)}


def rendezvous_service(job_: Manifest) -> Manifest:
    """The headless Service of a multi-node Job: DNS names for its pods (`<job>-<index>.<job>`),
    so every node's torchrun finds the first one. Owned by the Job: it goes when the Job does."""
    meta = job_["metadata"]
    jname, ns = meta["name"], meta["namespace"]
    # No blockOwnerDeletion: where OwnerReferencesPermissionEnforcement is on, setting it needs
    # update on jobs/finalizers, which the operator does not hold (and a Service left a moment
    # after its Job in a foreground deletion costs nothing). The garbage collector still
    # deletes the Service with the Job.
    owner = {"apiVersion": "batch/v1", "kind": "Job", "name": jname, "uid": meta["uid"],
             "controller": True}
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": jname, "namespace": ns, "labels": dict(meta.get("labels") or {}),
                     "ownerReferences": [owner]},
        "spec": {
            "clusterIP": "None",
            # The pods need their names before they are ready: torchrun starts the rendezvous.
            "publishNotReadyAddresses": True,
            "selector": {c.LABEL_DISTILL_JOB: jname},
            "ports": [{"name": "rendezvous", "port": RENDEZVOUS_PORT,
                       "targetPort": RENDEZVOUS_PORT, "protocol": "TCP"}],
        },
    }


def drafter_version(owner: Manifest, report: Manifest, job_name_: str) -> Manifest:
    """A DrafterVersion from a Job report (see distill.parse_report)."""
    name, ns = owner["metadata"]["name"], owner["metadata"]["namespace"]
    spec: Manifest = {"service": name, "version": report["version"], "jobName": job_name_}
    for key in ("parent", "created", "target", "training", "eval"):
        if report.get(key) not in (None, "", {}):
            spec[key] = report[key]
    return {
        "apiVersion": c.API_VERSION,
        "kind": c.DRAFTER_KIND,
        "metadata": _meta(drafter_name(name, report["version"]), ns, "drafter", owner),
        "spec": spec,
    }


def retention_cronjob(owner: Manifest, spec: ServiceSpec,
                      claim_modes: list[str] | None = None) -> Manifest:
    """A daily Job that prunes the shared volume (python -m adaflash_operator.retention):
    traffic older than retention.trafficDays, and drafter versions beyond the newest
    retention.keepVersions, never the fleet's, the pinned or the initial one, nor `latest`."""
    name, ns = owner["metadata"]["name"], owner["metadata"]["namespace"]
    r = spec.retention
    protect = sorted({v for v in (spec.initial_version, spec.pinned_version) if v})
    args = ["--home", c.HOME, "--traffic-days", str(r.traffic_days),
            "--keep-versions", str(r.keep_versions),
            "--fleet-version-file", f"{c.CONTROL_DIR}/fleet/{c.FLEET_VERSION_KEY}"]
    for v in protect:
        args += ["--protect", v]
    pod_spec: Manifest = {
        "restartPolicy": "Never",
        "automountServiceAccountToken": False,
        "securityContext": POD_SECURITY,
        "containers": [{
            "name": "retention",
            "image": spec.image,
            "imagePullPolicy": spec.image_pull_policy,
            "command": ["python", "-m", "adaflash_operator.retention"],
            "args": args,
            "resources": {"requests": {"cpu": "50m", "memory": "64Mi"},
                          "limits": {"memory": "256Mi"}},
            "securityContext": CONTAINER_SECURITY,
            "volumeMounts": [{"name": "home", "mountPath": c.HOME},
                             {"name": "fleet", "mountPath": f"{c.CONTROL_DIR}/fleet",
                              "readOnly": True}],
        }],
        "volumes": [
            {"name": "home", "persistentVolumeClaim": {"claimName": claim_name(name, spec)}},
            {"name": "fleet", "configMap": {"name": configmap_name(name)}},
        ],
    }
    # On the serving pods' nodes: a ReadWriteOnce volume is only there.
    modes = placement.spec_claim_modes(spec) if claim_modes is None else claim_modes
    pod_spec.update(placement.retention_pod(spec, selector(name), modes, name))
    return {
        "apiVersion": "batch/v1",
        "kind": "CronJob",
        "metadata": _meta(retention_name(name), ns, "retention", owner),
        "spec": {
            "schedule": r.schedule,
            "suspend": not r.enabled,
            "concurrencyPolicy": "Forbid",
            "successfulJobsHistoryLimit": 1,
            "failedJobsHistoryLimit": 3,
            "jobTemplate": {"spec": {
                "backoffLimit": 2,
                "ttlSecondsAfterFinished": 7 * 24 * 3600,
                "template": {"metadata": {"labels": labels(name, "retention")},
                             "spec": pod_spec},
            }},
        },
    }
