"""The CRDs of adaflash.io/v1alpha1, defined once here.

`python -m adaflash_operator crds` writes them; the chart's `crds/` files are that output and a
test checks they match. The schemas are structural (every field typed), carry validation and
defaults, and the API server applies them before the operator sees an object.
"""

from __future__ import annotations

from typing import Any

import yaml

from . import contract as c

Schema = dict[str, Any]

VERSION_PATTERN = r"^v[0-9]{6}$"
NAME_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
# An AdaFlashService's name becomes a Service (DNS-1035: a leading letter) and the prefix of
# every child; 40 characters leave room for `-retention` (CronJob names: 52) and for the Jobs'
# `-distill-R-A` (63, hash-shortened beyond).
SERVICE_NAME_PATTERN = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
SERVICE_NAME_MAX = 40
SERVICE_NAME_RULES = [
    {"rule": f"self.metadata.name.size() <= {SERVICE_NAME_MAX}",
     "message": f"metadata.name must be at most {SERVICE_NAME_MAX} characters: it prefixes the "
                f"names of the Jobs, the CronJob and the other children"},
    {"rule": f"self.metadata.name.matches('{SERVICE_NAME_PATTERN}')",
     "message": "metadata.name must start with a letter and hold only lower-case letters, "
                "digits and '-' (it names a Service: DNS-1035)"},
]
MULTI_NODE_RULE = {
    "rule": "has(self.storage.existingClaim) || self.storage.accessMode == 'ReadWriteMany' || "
            "self.distillation.nodes <= 1",
    "message": "distillation.nodes > 1 runs the Job's pods on several nodes, which all mount the "
               "volume: use storage.accessMode ReadWriteMany",
}
SINGLE_NODE_RULE = {
    "rule": "has(self.storage.existingClaim) || self.storage.accessMode == 'ReadWriteMany' || "
            "self.replicas <= 1",
    "message": "storage.accessMode ReadWriteOnce or ReadWriteOncePod cannot serve replicas > 1 "
               "(every serving pod and the distillation Job mount the volume): use "
               "ReadWriteMany",
}
# Cross-field rules the API server checks (CEL) and the operator re-checks (spec.py) for objects
# written past an old CRD. Each one refuses a spec that would otherwise be refused later, by the
# API server on a child or by the scheduler, where nobody sees it.
SPEC_RULES = [
    SINGLE_NODE_RULE,
    {"rule": "has(self.storage.existingClaim) || self.storage.accessMode != 'ReadWriteOncePod' "
             "|| (!self.distillation.enabled && !self.retention.enabled && "
             "!(has(self.drafter) && has(self.drafter.bootstrap)))",
     "message": "storage.accessMode ReadWriteOncePod lets one pod mount the claim, and the "
                "serving pod holds it: distillation Jobs, the bootstrap Job and the retention "
                "CronJob could never start. Use ReadWriteOnce (they are placed on the serving "
                "pod's node) or ReadWriteMany, or disable distillation and retention and drop "
                "drafter.bootstrap"},
    {"rule": "has(self.storage.existingClaim) || self.storage.accessMode == 'ReadWriteMany' || "
             "self.serving.updateStrategy.type == 'Recreate' || "
             "string(self.serving.updateStrategy.maxSurge).matches('^0+%?$')",
     "message": "serving.updateStrategy.maxSurge must be 0 with a ReadWriteOnce or "
                "ReadWriteOncePod claim: the surge pod cannot mount the claim the old pod "
                "holds, so the update would never finish"},
    {"rule": "!has(self.autoscaling) || !self.autoscaling.enabled || "
             "has(self.storage.existingClaim) || self.storage.accessMode == 'ReadWriteMany' || "
             "self.autoscaling.maxReplicas <= 1",
     "message": "autoscaling.maxReplicas must be 1 with a ReadWriteOnce or ReadWriteOncePod "
                "claim (one serving pod): use ReadWriteMany to scale out"},
    {"rule": "!has(self.autoscaling) || self.autoscaling.minReplicas <= "
             "self.autoscaling.maxReplicas",
     "message": "autoscaling.minReplicas must not exceed autoscaling.maxReplicas"},
    {"rule": "self.distillation.maxBackoffSeconds >= self.distillation.backoffSeconds",
     "message": "distillation.maxBackoffSeconds must be >= distillation.backoffSeconds"},
    MULTI_NODE_RULE,
    {"rule": "!has(self.drafter) || !has(self.drafter.bootstrap) || "
             "self.drafter.bootstrap.source != 'Import' || has(self.drafter.bootstrap.path)",
     "message": "drafter.bootstrap.path must be set with source Import: the checkpoint's "
                "directory on the claim"},
]
# Deployment rules (apps/v1 validation) on serving.updateStrategy.
# (The API server also checks them on the object's `{}` default, before nested defaults.)
ROLLING_RULES = [
    {"rule": "!has(self.maxSurge) || (type(self.maxSurge) == int ? self.maxSurge >= 0 : "
             "string(self.maxSurge).matches('^[0-9]+%$'))",
     "message": "maxSurge must be a non-negative integer or a percentage such as '25%'"},
    {"rule": "!has(self.maxUnavailable) || (type(self.maxUnavailable) == int ? "
             "self.maxUnavailable >= 0 : "
             "string(self.maxUnavailable).matches('^0*([0-9]{1,2}|100)%$'))",
     "message": "maxUnavailable must be a non-negative integer or a percentage up to '100%'"},
    {"rule": "!has(self.type) || !has(self.maxSurge) || !has(self.maxUnavailable) || "
             "self.type != 'RollingUpdate' || !(string(self.maxSurge).matches('^0+%?$') && "
             "string(self.maxUnavailable).matches('^0+%?$'))",
     "message": "maxSurge and maxUnavailable may not both be 0: no pod could ever be replaced "
                "(the Deployment API refuses it)"},
]
# A claim can grow, never shrink (the API server refuses a smaller request).
SIZE_PATTERN = r"^([0-9]*[1-9][0-9]*(\.[0-9]+)?|[0-9]*\.[0-9]*[1-9][0-9]*)(Ki|Mi|Gi|Ti|Pi|k|M|G|T|P)?$"
SIZE_RULES = [{"rule": "quantity(self).compareTo(quantity(oldSelf)) >= 0",
               "message": "storage.size cannot shrink: a claim only grows (lower it by moving "
                          "to a new claim)"}]
# Requests at most the limits, every value a quantity (the pod API refuses the rest).
# (Each value is checked to be a quantity where it is declared: crds._QUANTITY.)
RESOURCE_RULES = [
    {"rule": "!has(self.requests) || !has(self.limits) || self.requests.all(k, "
             "!(k in self.limits) || !isQuantity(string(self.requests[k])) || "
             "!isQuantity(string(self.limits[k])) || quantity(string(self.requests[k]))"
             ".compareTo(quantity(string(self.limits[k]))) <= 0)",
     "message": "a request may not exceed its limit (the pod API refuses it)"},
]
QUANTITY_MESSAGE = "must be a quantity, e.g. 8, 500m, 64Gi"
CRON_PATTERN = (r"^(@(yearly|annually|monthly|weekly|daily|midnight|hourly)|"
                r"[^\s]+\s+[^\s]+\s+[^\s]+\s+[^\s]+\s+[^\s]+)$")
DNS_NAME_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"


def _str(desc: str, default: str | None = None, pattern: str | None = None, **kw: Any) -> Schema:
    s: Schema = {"type": "string", "description": desc, **kw}
    if default is not None:
        s["default"] = default
    if pattern is not None:
        s["pattern"] = pattern
    return s


def _int(desc: str, default: int | None = None, minimum: int | None = None,
         maximum: int | None = None) -> Schema:
    s: Schema = {"type": "integer", "description": desc}
    if default is not None:
        s["default"] = default
    if minimum is not None:
        s["minimum"] = minimum
    if maximum is not None:
        s["maximum"] = maximum
    return s


def _num(desc: str, default: float | None = None, minimum: float | None = None,
         maximum: float | None = None, **kw: Any) -> Schema:
    s: Schema = {"type": "number", "description": desc, **kw}
    if default is not None:
        s["default"] = default
    if minimum is not None:
        s["minimum"] = minimum
    if maximum is not None:
        s["maximum"] = maximum
    return s


def _bool(desc: str, default: bool | None = None) -> Schema:
    s: Schema = {"type": "boolean", "description": desc}
    if default is not None:
        s["default"] = default
    return s


def _obj(desc: str, props: dict[str, Schema], required: list[str] | None = None,
         default: dict | None = None, rules: list[dict] | None = None) -> Schema:
    s: Schema = {"type": "object", "description": desc, "properties": props}
    if required:
        s["required"] = required
    if default is not None:
        s["default"] = default
    if rules:
        s["x-kubernetes-validations"] = rules
    return s


def _list(desc: str, items: Schema) -> Schema:
    return {"type": "array", "description": desc, "items": items}


def _int_or_str(desc: str, default: int | str) -> Schema:
    return {"anyOf": [{"type": "integer"}, {"type": "string"}],
            "x-kubernetes-int-or-string": True, "description": desc, "default": default}


def _free(desc: str) -> Schema:
    """A Kubernetes object kept as is (resources, tolerations...): validated by the pod API."""
    return {"type": "object", "description": desc, "x-kubernetes-preserve-unknown-fields": True}


def _map(desc: str, value: Schema) -> Schema:
    return {"type": "object", "description": desc, "additionalProperties": value}


def _tau_map(desc: str) -> Schema:
    return _map(desc, {"type": "number", "minimum": 0})


_CONDITIONS = _list("Standard conditions: Ready, Progressing, Degraded (and DistillationFailed, "
                    "BootstrapFailed, AdminOverride).", _obj(
    "A condition.",
    {
        "type": _str("Condition type."),
        "status": _str("True, False or Unknown.", enum=["True", "False", "Unknown"]),
        "reason": _str("CamelCase reason."),
        "message": _str("Human-readable detail."),
        "lastTransitionTime": _str("When the status last changed.", format="date-time"),
        "observedGeneration": _int("Generation this condition was computed from."),
    },
    required=["type", "status"],
))

# maxLength and maxProperties bound the estimated cost of the CEL rules that read them.
_QUANTITY = {"anyOf": [{"type": "integer"}, {"type": "string"}], "x-kubernetes-int-or-string": True,
             "maxLength": 32,
             "x-kubernetes-validations": [{"rule": "isQuantity(string(self))",
                                           "message": QUANTITY_MESSAGE}]}
_RESOURCES = _obj("CPU and memory requests and limits (a core/v1 ResourceRequirements subset).", {
    "requests": {**_map("Requests, e.g. {cpu: 8, memory: 64Gi}.", _QUANTITY), "maxProperties": 8},
    "limits": {**_map("Limits; nvidia.com/gpu comes from `gpus`.", _QUANTITY), "maxProperties": 8},
})
_RESOURCES["x-kubernetes-validations"] = RESOURCE_RULES
_NAME = {"type": "string", "pattern": DNS_NAME_PATTERN, "maxLength": 253}
_PULL_SECRETS = {**_list("Names of Secrets in the namespace to pull images with.", _NAME),
                 "maxItems": 16}

SERVICE_SPEC: Schema = _obj("Desired state of an AdaFlash serving deployment.", {
    "model": _obj("The target model.", {
        "target": _str("Target model path or Hugging Face id passed to --model-path.", minLength=1),
        "servedModelName": _str("Name served by the OpenAI-compatible API (--served-model-name)."),
    }, required=["target"]),
    "replicas": _int("Number of serving pods (scale subresource).", 1, 0, 512),
    "serving": _obj("The SGLang serving pods.", {
        "image": _str("Image with SGLang 0.5.23 and sglang-adaflash installed.", minLength=1),
        "imagePullPolicy": _str("Pull policy.", "IfNotPresent",
                                enum=["Always", "IfNotPresent", "Never"]),
        "port": _int("HTTP port of SGLang; also serves /metrics.", 30000, 1, 65535),
        "blockSize": _int("Drafter block size B (--speculative-num-draft-tokens).", 16, 2, 64),
        "gpus": _int("nvidia.com/gpu per pod (also --tp-size).", 1, 0, 16),
        "extraArgs": _list("Extra arguments appended to sglang.launch_server.", {"type": "string"}),
        "env": _list("Extra environment variables (core/v1 EnvVar).", _free("An EnvVar.")),
        "resources": _RESOURCES,
        "nodeSelector": _map("Node selector.", {"type": "string"}),
        "tolerations": _list("Tolerations (core/v1 Toleration).", _free("A toleration.")),
        "startupSeconds": _int("How long model loading may take before the pod is restarted.",
                               1800, 60, 86400),
        "imagePullSecrets": _PULL_SECRETS,
        "affinity": _free("Affinity of the serving pods (core/v1 Affinity)."),
        "priorityClassName": _str("PriorityClass of the serving pods.", pattern=DNS_NAME_PATTERN),
        "topologySpreadConstraints": _list(
            "How serving pods spread (core/v1 TopologySpreadConstraint; labelSelector defaults "
            "to the serving pods). Omitted: a soft spread over nodes and zones; []: none.",
            _free("A topology spread constraint.")),
        "podDisruptionBudget": _obj("The PodDisruptionBudget of the serving pods (drains and "
                                    "evictions wait for it).", {
            "enabled": _bool("Create it.", True),
            "maxUnavailable": _int_or_str("Serving pods a voluntary disruption may take at "
                                          "once.", 1),
        }, default={}),
        "shutdown": _obj("Graceful termination of a serving pod.", {
            "preStopSeconds": _int("Wait this long after the pod is marked for deletion before "
                                   "SGLang gets SIGTERM, so that endpoints stop sending it "
                                   "requests.", 10, 0, 300),
            "drainSeconds": _int("Then how long SGLang may take to finish the generations in "
                                 "flight (its SIGTERM drain); terminationGracePeriodSeconds is "
                                 "preStopSeconds + drainSeconds.", 300, 0, 86400),
        }, default={}),
        "networkPolicy": _obj("A NetworkPolicy on the serving port, which the inference API "
                              "and the admin route share.", {
            "enabled": _bool("Create it: only the peers in `from` (default: the pods of "
                             "this namespace) may connect.", False),
            "from": _list("Who may connect (core/v1 NetworkPolicyPeer, e.g. your gateway's "
                          "namespace).", _free("A NetworkPolicyPeer.")),
        }, default={}),
        "logTraffic": _bool("Log finished requests (full prompt and output text: SGLang has no "
                            "ids-only level) to the shared volume for distillation. Off by "
                            "default; distillation has no traffic without it.", False),
        "updateStrategy": _obj("How the Deployment replaces serving pods.", {
            "type": _str("RollingUpdate or Recreate.", "RollingUpdate",
                         enum=["RollingUpdate", "Recreate"]),
            "maxSurge": _int_or_str("Extra pods during a rolling update (each needs its GPUs).",
                                    0),
            "maxUnavailable": _int_or_str("Pods that may be down during a rolling update.", 1),
        }, default={}, rules=ROLLING_RULES),
    }, required=["image"]),
    "storage": _obj("The shared volume (ADAFLASH_HOME).", {
        "existingClaim": _str("Use this PersistentVolumeClaim instead of creating one.",
                              pattern=DNS_NAME_PATTERN),
        "size": {**_str("Size of the created claim; it can grow (if its storage class allows "
                        "expansion), never shrink.", "200Gi", pattern=SIZE_PATTERN),
                 "x-kubernetes-validations": SIZE_RULES},
        "storageClassName": _str("Storage class of the created claim (must support the access mode)."),
        "accessMode": _str("Access mode: serving pods and Jobs on several nodes need ReadWriteMany.",
                           "ReadWriteMany", enum=["ReadWriteMany", "ReadWriteOnce", "ReadWriteOncePod"]),
        "deleteWithService": _bool("Delete the created claim (drafters and traffic) with the "
                                   "AdaFlashService. Off: the claim is kept.", False),
    }, default={}),
    "drafter": _obj("Which drafter version the fleet serves.", {
        "initialVersion": _str("Version on the shared volume that pods load at start.", "v000001",
                               pattern=VERSION_PATTERN),
        "pinnedVersion": _str("Pin the fleet to this version: stops rollouts; set an older one to "
                              "roll back. Empty means follow the rollout.", pattern=r"^(v[0-9]{6})?$"),
        "bootstrap": _obj("How the first drafter (initialVersion) gets onto an empty volume: a Job "
                          "that imports or trains it before the serving pods start (they wait "
                          "for it). Absent: the version must be put there by hand.", {
            "source": _str("Import (a published DFlash checkpoint on the claim) or Train (the "
                           "offline recipe on the target's own responses).",
                           enum=["Import", "Train"]),
            "path": _str("Import: the checkpoint directory; Train: a prompts file (JSON lines), "
                         "or absent for the traffic on the volume. Relative to the claim's root.",
                         pattern=r"^[^/].*$"),
            "extraArgs": _list("Extra arguments for the import (adaflash drafters import) or the "
                               "recipe (python -m training_job.dflash_offline).",
                               {"type": "string"}),
        }, required=["source"]),
    }, default={}),
    "distillation": _obj("On-policy distillation Jobs.", {
        "enabled": _bool("Start distillation Jobs.", True),
        "image": _str("Image of the training job (python -m training_job.distill). "
                      "Defaults to serving.image."),
        "gpus": _int("nvidia.com/gpu per pod of the Job; above 1 the job runs under torchrun, a "
                     "process per GPU.", 1, 0, 16),
        "nodes": _int("Pods (nodes) of the Job; above 1 an Indexed Job (or a JobSet where the "
                      "cluster has one) whose torchruns meet at the first pod. Needs a "
                      "ReadWriteMany volume.", 1, 1, 64),
        "resources": _RESOURCES,
        "minNewRecords": _int("Start a round once this many new traffic records are logged.",
                              128, 1),
        "intervalSeconds": _int("Also start a round this long after the last one (0: never).",
                                0, 0),
        "backoffSeconds": _int("Delay before retrying a failed Job; doubles each failure.", 60, 1),
        "maxBackoffSeconds": _int("Cap of the retry delay.", 3600, 1),
        "activeDeadlineSeconds": _int("Kill a Job running longer than this.", 86400, 60),
        "extraArgs": _list("Extra arguments for training_job.distill.", {"type": "string"}),
        "nodeSelector": _map("Node selector.", {"type": "string"}),
        "tolerations": _list("Tolerations (core/v1 Toleration).", _free("A toleration.")),
        "imagePullSecrets": {**_PULL_SECRETS, "description": "Image pull Secrets of the Jobs. "
                             "Default: serving.imagePullSecrets."},
        "affinity": _free("Affinity of the Jobs (core/v1 Affinity). Default: serving.affinity."),
        "priorityClassName": _str("PriorityClass of the Jobs and the retention CronJob.",
                                  pattern=DNS_NAME_PATTERN),
    }, default={}),
    "autoscaling": _obj("Scale the serving pods on queue depth (spec.replicas is then the "
                        "autoscaler's).", {
        "enabled": _bool("Create a HorizontalPodAutoscaler (or a KEDA ScaledObject, when KEDA "
                         "is installed and prometheusAddress is set).", False),
        "minReplicas": _int("Fewest serving pods.", 1, 1, 512),
        "maxReplicas": _int("Most serving pods.", 4, 1, 512),
        "targetQueueDepth": _int("Queued requests per serving pod to aim for.", 8, 1, 100000),
        "metric": _str("The per-pod queue-depth metric, as the custom metrics API (HPA) or "
                       "Prometheus (KEDA) names it.", "sglang:num_queue_reqs", minLength=1),
        "prometheusAddress": _str("Prometheus URL for KEDA's prometheus trigger, e.g. "
                                  "http://prometheus.monitoring:9090. Empty: an HPA."),
    }, default={}),
    "rollout": _obj("How a new drafter version reaches the fleet.", {
        "minTauGain": _num("Evaluation gate: candidate held-out tau must be at least the serving "
                           "version's times (1 + minTauGain).", 0.0, -1.0, 10.0),
        "canaryFraction": _num("Fraction of ready pods that load the candidate first (at least one).",
                               0.25, 0.0, 1.0, exclusiveMinimum=True),
        "bakeSeconds": _int("How long canary pods serve the candidate before the live comparison.",
                            600, 0),
        "loadTimeoutSeconds": _int("Roll back if a canary pod has not loaded the candidate by then.",
                                   300, 1),
        "maxLiveTauDrop": _num("Roll back if canary live tau < fleet live tau * (1 - this).",
                               0.05, 0.0, 1.0),
        "autoPromote": _bool("Promote automatically after a good bake.", True),
    }, default={}),
    "retention": _obj("Pruning of the shared volume by a daily CronJob.", {
        "enabled": _bool("Run the pruning CronJob.", True),
        "trafficDays": _int("Delete traffic logs older than this many days.", 30, 1),
        "keepVersions": _int("Keep this many newest drafter versions (the fleet's, the pinned "
                             "and the initial one are always kept).", 10, 2),
        "schedule": _str("Cron schedule of the pruning Job.", "17 3 * * *",
                         pattern=CRON_PATTERN),
    }, default={}),
}, required=["model", "serving"])
SERVICE_SPEC["x-kubernetes-validations"] = SPEC_RULES

_ROLLOUT_STATUS = _obj("The rollout in progress or last finished.", {
    "version": _str("Version being rolled out."),
    "phase": _str("Gate, Canary, Baking, Promoted, Rejected, RolledBack.",
                  enum=["Gate", "Canary", "Baking", "Promoted", "Rejected", "RolledBack"]),
    "canaryPods": _list("Pods annotated with the candidate.", {"type": "string"}),
    "startedAt": _str("When the canary started.", format="date-time"),
    "loadedAt": _str("When every canary pod had loaded the candidate.", format="date-time"),
    "baselineTau": _num("Fleet live tau when the canary started.", minimum=0),
    "replacedPods": _int("Canary pods that went away (eviction, drain, rolling update) and "
                         "were replaced during this rollout."),
    "reason": _str("Reason of the last transition."),
    "message": _str("Detail of the last transition."),
})

_DISTILL_STATUS = _obj("Distillation bookkeeping (survives operator restarts).", {
    "round": _int("Rounds started so far."),
    "activeJob": _str("Name of the running Job, if any."),
    "activeJobPhase": _str("Pending (not scheduled or not started) or Running."),
    "activeJobKind": _str("Job, or JobSet (a multi-node round on a cluster that has JobSet)."),
    "lastRoundAt": _str("When the last round started.", format="date-time"),
    "lastSuccessAt": _str("When a round last published a version.", format="date-time"),
    "consecutiveFailures": _int("Failed Jobs since the last success."),
    "retryAfter": _str("No new Job before this time (backoff).", format="date-time"),
    "recordsAtLastRound": _map("Traffic records per pod when the last round started.",
                               {"type": "integer"}),
    "newRecords": _int("Traffic records logged since the last round."),
    "lastError": _str("Why the last Job failed."),
    "lastOutcome": _str("How the last Job ended: Published, NotEnoughRecords (too little new "
                        "traffic; not a failure) or Failed."),
    "lastOutcomeMessage": _str("Detail of lastOutcome."),
    "idleReason": _str("Why no round starts whatever the traffic (TrafficLoggingOff, "
                       "Bootstrapping)."),
    "message": _str("Detail of idleReason."),
})

_BOOTSTRAP_STATUS = _obj("The first drafter's Job (spec.drafter.bootstrap).", {
    "phase": _str("Running, Succeeded or Failed (retried after a backoff).",
                  enum=["Running", "Succeeded", "Failed"]),
    "job": _str("The bootstrap Job (the running or the last one)."),
    "attempts": _int("Jobs started so far.", minimum=0),
    "outcome": _str("What the last Job did: Imported, Trained, or Present (the version was "
                    "there already)."),
    "version": _str("The version it produced or found.", pattern=r"^(v[0-9]{6})?$"),
    "message": _str("Detail of the last transition."),
    "retryAfter": _str("No new Job before this time (backoff).", format="date-time"),
})

_POD_STATUS = _obj("What one serving pod reports.", {
    "name": _str("Pod name."),
    "ready": _bool("Pod is Ready."),
    "desiredVersion": _str("Canary version annotated on the pod, if any."),
    "loadedVersion": _str("Version the pod reports it serves."),
    "tau": _num("Live acceptance length the pod reports.", minimum=0),
    "loadError": _str("Last load failure the pod reported."),
    "override": _str("Version an admin override (POST /adaflash/v1/drafter) asks this pod for; "
                     "the rollout does not steer the pod while it is set."),
    "waitingForDrafter": _bool("The pod's init container waits for the fleet's drafter to "
                               "appear on the shared volume."),
})

SERVICE_STATUS: Schema = _obj("Observed state.", {
    "observedGeneration": _int("Generation the children reflect."),
    "conditions": _CONDITIONS,
    "servingVersion": _str("Version of the fleet (the ConfigMap)."),
    "candidateVersion": _str("Version in gate, canary or bake."),
    "latestVersion": _str("Newest published version."),
    "replicas": _int("Serving pods (scale subresource)."),
    "readyReplicas": _int("Ready serving pods."),
    "selector": _str("Label selector of the serving pods (scale subresource)."),
    "tau": _num("Mean live acceptance length reported by the pods.", minimum=0),
    "pods": _list("Per-pod drafter versions.", _POD_STATUS),
    "rollout": _ROLLOUT_STATUS,
    "distillation": _DISTILL_STATUS,
    "bootstrap": _BOOTSTRAP_STATUS,
    "kopf": {"type": "object", "description": "Operator framework bookkeeping.",
             "x-kubernetes-preserve-unknown-fields": True},
})

_GATE = _obj("The Job's gate: candidate against parent on the same held-out prompts, with a "
              "paired bootstrap over prompts for the noise and a per-domain floor.", {
    "passed": _bool("Whether the candidate passed."),
    "reason": _str("Passed, NoGain (the mean gain's lower bound is below minGain), DomainDrop "
                   "(a domain dropped beyond its noise) or NoEvaluation.",
                   enum=["Passed", "NoGain", "DomainDrop", "NoEvaluation"]),
    "message": _str("The decision in words."),
    "meanTau": _num("Candidate's mean held-out tau over domains.", minimum=0),
    "parentMeanTau": _num("Parent's mean held-out tau over the same domains.", minimum=0),
    "gain": _num("meanTau / parentMeanTau - 1."),
    "gainLow": _num("Lower bound of the gain at the given confidence."),
    "minGain": _num("Gain the lower bound had to reach."),
    "confidence": _num("One-sided confidence of the bounds.", minimum=0, maximum=1),
    "resamples": _int("Bootstrap resamples.", minimum=0),
    "prompts": _int("Held-out prompts both versions decoded.", minimum=0),
    "domains": _map("Per domain: its tau minus the parent's and the noise above it.", _obj(
        "One domain.", {
            "prompts": _int("Held-out prompts of the domain.", minimum=0),
            "delta": _num("tau minus the parent's tau."),
            "noise": _num("How far above delta the upper bound reaches."),
            "floored": _bool("Enough prompts for the floor to apply."),
            "dropped": _bool("Dropped beyond its noise (fails the gate)."),
        })),
})

DRAFTER_SPEC: Schema = _obj("A published drafter version (from the manifest on the shared volume).", {
    "service": _str("The AdaFlashService this version was distilled for.", pattern=NAME_PATTERN),
    "version": _str("Version directory under drafters/.", pattern=VERSION_PATTERN),
    "parent": _str("Version it was distilled from.", pattern=r"^(v[0-9]{6})?$"),
    "created": _str("When the Job published it.", format="date-time"),
    "jobName": _str("Job that produced it."),
    "target": _obj("Target model it was trained for.", {
        "name": _str("Target name."), "sha256": _str("sha256 of the target config."),
    }),
    "training": _obj("Training summary from the manifest.", {
        "algorithm": _str("e.g. opd-rkl."),
        "records": _int("Traffic records used.", minimum=0),
        "steps": _int("Optimizer steps.", minimum=0),
        "finalLoss": _num("Final training loss."),
    }),
    "eval": _obj("Held-out evaluation by the Job.", {
        "tau": _tau_map("Acceptance length by domain for this version."),
        "parentTau": _tau_map("Acceptance length by domain for the parent, same records."),
        "gate": _GATE,
    }),
}, required=["service", "version"])

DRAFTER_STATUS: Schema = _obj("Rollout state of this version.", {
    "phase": _str("Lifecycle phase.", enum=["Candidate", "Canary", "Serving", "Retired",
                                           "Rejected", "RolledBack"]),
    "reason": _str("Reason of the last transition."),
    "message": _str("Detail of the last transition."),
    "evalTau": _num("Mean held-out tau of this version.", minimum=0),
    "baselineTau": _num("Mean held-out tau it was gated against.", minimum=0),
    "liveTau": _num("Live tau of canary pods at the end of the bake.", minimum=0),
    "gate": _GATE,
    "canaryPods": _list("Pods that served it as canary.", {"type": "string"}),
    "history": _list("Phase transitions, oldest first.", _obj("A transition.", {
        "phase": _str("Phase entered."), "reason": _str("Reason."),
        "time": _str("When.", format="date-time"),
    })),
    "kopf": {"type": "object", "description": "Operator framework bookkeeping.",
             "x-kubernetes-preserve-unknown-fields": True},
})


def _crd(kind: str, plural: str, singular: str, short: list[str], spec: Schema, status: Schema,
         columns: list[dict], scale: bool, rules: list[dict] | None = None) -> dict:
    subresources: dict[str, Any] = {"status": {}}
    if scale:
        subresources["scale"] = {
            "specReplicasPath": ".spec.replicas",
            "statusReplicasPath": ".status.replicas",
            "labelSelectorPath": ".status.selector",
        }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": f"{plural}.{c.GROUP}",
            "annotations": {"helm.sh/resource-policy": "keep"},
            "labels": {"app.kubernetes.io/part-of": "adaflash"},
        },
        "spec": {
            "group": c.GROUP,
            "scope": "Namespaced",
            "names": {"kind": kind, "listKind": f"{kind}List", "plural": plural,
                      "singular": singular, "shortNames": short, "categories": ["adaflash"]},
            "versions": [{
                "name": c.VERSION,
                "served": True,
                "storage": True,
                "subresources": subresources,
                "additionalPrinterColumns": columns,
                "schema": {"openAPIV3Schema": {
                    "type": "object",
                    "description": f"{kind} ({c.API_VERSION}).",
                    "properties": {
                        "apiVersion": {"type": "string"},
                        "kind": {"type": "string"},
                        "metadata": {"type": "object"},
                        "spec": spec,
                        "status": status,
                    },
                    "required": ["spec"],
                    **({"x-kubernetes-validations": rules} if rules else {}),
                }},
            }],
        },
    }


def _col(name: str, path: str, typ: str = "string", priority: int = 0, desc: str = "") -> dict:
    col = {"name": name, "type": typ, "jsonPath": path}
    if priority:
        col["priority"] = priority
    if desc:
        col["description"] = desc
    return col


def service_crd() -> dict:
    return _crd(c.SERVICE_KIND, c.SERVICE_PLURAL, "adaflashservice", ["afs"], SERVICE_SPEC,
                SERVICE_STATUS, [
                    _col("Serving", ".status.servingVersion", desc="Fleet drafter version"),
                    _col("Candidate", ".status.candidateVersion", desc="Version in rollout"),
                    _col("Latest", ".status.latestVersion", desc="Newest published version"),
                    _col("Ready", '.status.conditions[?(@.type=="Ready")].status',
                         desc="The Ready condition"),
                    _col("Pods", ".status.readyReplicas", "integer", desc="Ready serving pods"),
                    _col("Replicas", ".spec.replicas", "integer", desc="Desired pods"),
                    _col("Tau", ".status.tau", "number", desc="Live acceptance length"),
                    _col("Reason", '.status.conditions[?(@.type=="Ready")].reason', priority=1,
                         desc="Why Ready is what it is"),
                    _col("Rollout", ".status.rollout.phase", priority=1),
                    _col("Age", ".metadata.creationTimestamp", "date"),
                ], scale=True, rules=SERVICE_NAME_RULES)


def drafter_crd() -> dict:
    return _crd(c.DRAFTER_KIND, c.DRAFTER_PLURAL, "drafterversion", ["dv"], DRAFTER_SPEC,
                DRAFTER_STATUS, [
                    _col("Service", ".spec.service"),
                    _col("Version", ".spec.version"),
                    _col("Parent", ".spec.parent"),
                    _col("Phase", ".status.phase"),
                    _col("EvalTau", ".status.evalTau", "number"),
                    _col("LiveTau", ".status.liveTau", "number"),
                    _col("Reason", ".status.reason", priority=1),
                    _col("Age", ".metadata.creationTimestamp", "date"),
                ], scale=False)


CRD_FILES = {
    "adaflashservices.yaml": service_crd,
    "drafterversions.yaml": drafter_crd,
}

HEADER = "# Generated by `python -m adaflash_operator crds`; edit operator/adaflash_operator/crds.py.\n"


def render(name: str) -> str:
    return HEADER + yaml.safe_dump(CRD_FILES[name](), sort_keys=False, width=100)


def openapi_schema(kind: str) -> Schema:
    crd = service_crd() if kind == c.SERVICE_KIND else drafter_crd()
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
