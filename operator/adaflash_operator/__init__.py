"""The AdaFlash Kubernetes operator.

It serves a target model with SGLang and the ADAFLASH speculative algorithm, distils new drafter
versions from live traffic in Jobs, and rolls each version out (evaluation gate, canary, bake,
promote or roll back) through the shared volume and hot reload. See docs/operator.md.

Modules:
    contract   names shared with the serving pods and the training job (annotations, paths)
    crds       the CRD definitions (one source of truth for the chart's crds/)
    spec       the AdaFlashService spec as a typed, validated dataclass
    manifests  pure builders of every child object
    rollout    the drafter rollout state machine (pure)
    distill    the distillation trigger, backoff and Job report parsing (pure)
    kube       a small async Kubernetes API client on kopf's credentials
    handlers   the kopf handlers: glue only (reconcile, the control loop's tick, status writes)
    job_phases     the tick's bootstrap Job and distillation rounds
    rollout_phase  the tick's rollout step, applied (ConfigMap, pods, DrafterVersions)
    clock      the operator's clock and status timestamps
"""

__version__ = "0.1.0"
