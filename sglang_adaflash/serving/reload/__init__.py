"""Drafter hot reload: learn the desired version, stage it off the critical path, swap in place.

The contract (docs/contracts.md, "Hot reload"): a serving process is told which drafter version
to serve, loads it from the shared volume, verifies it, swaps it between decode steps (never
inside one), keeps serving the old version if anything fails, and reports what it serves.

Pieces, each usable alone, one module each:

- :mod:`.source`: :class:`DesiredVersionSource` reads the desired version. Highest priority
  first: an admin override file (written by ``POST /adaflash/v1/drafter``), the pod annotation
  ``adaflash.io/desired-drafter-version`` in a downward-API annotations file (canary), a plain
  version file (a ConfigMap key: the fleet version), and ``drafters/latest`` when following it.
- :mod:`.staging`: :func:`stage_drafter` reads and verifies a version directory (manifest
  hashes, names, shapes, dtypes, full coverage, finite values, architecture unchanged) into CPU
  memory, pinned when CUDA is there. It runs on the watcher thread, never on the decode path.
- :mod:`.apply`: :func:`apply_in_place` copies a staged state into the live tensors *in place*:
  CUDA graphs hold raw pointers, so a parameter is never replaced, only overwritten. It
  snapshots the old values first and restores them if anything fails, so a failed load keeps
  the old weights. The snapshot goes into host memory the watcher allocated
  (:class:`SnapshotBuffers`, pinned on a GPU) and nothing waits for the device, so a swap only
  queues copies on the decode stream.
- :mod:`.lockstep`: tensor-parallel ranks agree on when to swap and whether to keep it.
- :mod:`.reloader`: :class:`HotReloader` glues them: a watcher thread stages;
  ``at_step_boundary()``, called by the worker before each decode step, makes tensor-parallel
  ranks agree and swaps.
- :mod:`.reporters` publish the loaded version: a status file (read by
  ``GET /adaflash/v1/drafter``), the ``adaflash_drafter_info`` metric, and the pod annotations
  ``adaflash.io/loaded-drafter-version`` and ``adaflash.io/drafter-load-error``
  (:class:`PodAnnotationReporter`, which also carries the live ``acceptance-tau`` and
  ``traffic-records`` that :mod:`..pod_status` publishes).
- :mod:`.admin`: what the admin endpoints do, for whichever HTTP app mounts them.
- :mod:`.contract`: the names (environment, mounts, annotations) shared with the operator.

Everything public is re-exported here, so callers import from ``sglang_adaflash.serving.reload``
and need not know the module layout.
"""

from __future__ import annotations

from .admin import (
    BlockedVersion,
    read_blocked_versions,
    read_status,
    set_override,
)
from .apply import (
    CompositeTarget,
    ModuleTarget,
    ReloadTarget,
    Snapshot,
    SnapshotBuffers,
    apply_in_place,
)
from .contract import (
    ACCEPTANCE_TAU_ANNOTATION,
    BLOCKED_VERSIONS_FILE,
    DEFAULT_HOME,
    DESIRED_ANNOTATION,
    ENV_ANNOTATIONS_FILE,
    ENV_BLOCKED_VERSIONS_FILE,
    ENV_FLEET_VERSION_FILE,
    ENV_FOLLOW_LATEST,
    ENV_HOME,
    ENV_OVERRIDE_FILE,
    ENV_POD_NAME,
    ENV_POD_NAME_FALLBACK,
    ENV_POD_NAMESPACE,
    ENV_POD_NAMESPACE_FALLBACK,
    ENV_POD_REPORT_S,
    ENV_POLL_S,
    ENV_REQUIRE_MANIFEST,
    ENV_STATUS_FILE,
    ENV_SYNC_STEPS,
    ENV_VERSION_FILE_ALIAS,
    FLEET_VERSION_FILE,
    LOAD_ERROR_ANNOTATION,
    LOADED_ANNOTATION,
    MAX_ERROR_CHARS,
    OVERRIDE_ANNOTATION,
    POD_ANNOTATIONS_FILE,
    TRAFFIC_RECORDS_ANNOTATION,
    ReloadError,
    is_version,
    version_number,
)
from .lockstep import (
    LockstepGroup,
    SingleRank,
    TorchDistGroup,
)
from .reloader import (
    HotReloader,
    ReloadStatus,
)
from .reporters import (
    PatchTransport,
    PodAnnotationReporter,
    Reporter,
    StatusFileReporter,
    load_error_value,
    pod_identity,
    reporters_from_env,
)
from .source import (
    DesiredVersionSource,
    parse_downward_annotations,
    read_latest,
    resolve_version_dir,
)
from .staging import (
    FROZEN_CONFIG_FIELDS,
    StagedDrafter,
    TensorSpec,
    check_against_live,
    check_config_frozen,
    dir_signature,
    stage_drafter,
)

__all__ = [
    "ACCEPTANCE_TAU_ANNOTATION",
    "BLOCKED_VERSIONS_FILE",
    "BlockedVersion",
    "ENV_BLOCKED_VERSIONS_FILE",
    "OVERRIDE_ANNOTATION",
    "read_blocked_versions",
    "CompositeTarget",
    "DEFAULT_HOME",
    "DESIRED_ANNOTATION",
    "DesiredVersionSource",
    "ENV_ANNOTATIONS_FILE",
    "ENV_FLEET_VERSION_FILE",
    "ENV_FOLLOW_LATEST",
    "ENV_HOME",
    "ENV_OVERRIDE_FILE",
    "ENV_POD_NAME",
    "ENV_POD_NAMESPACE",
    "ENV_POD_NAMESPACE_FALLBACK",
    "ENV_POD_NAME_FALLBACK",
    "ENV_POD_REPORT_S",
    "ENV_POLL_S",
    "ENV_REQUIRE_MANIFEST",
    "ENV_STATUS_FILE",
    "ENV_SYNC_STEPS",
    "ENV_VERSION_FILE_ALIAS",
    "FLEET_VERSION_FILE",
    "FROZEN_CONFIG_FIELDS",
    "HotReloader",
    "LOADED_ANNOTATION",
    "LOAD_ERROR_ANNOTATION",
    "LockstepGroup",
    "MAX_ERROR_CHARS",
    "ModuleTarget",
    "POD_ANNOTATIONS_FILE",
    "PatchTransport",
    "PodAnnotationReporter",
    "ReloadError",
    "ReloadStatus",
    "ReloadTarget",
    "Reporter",
    "SingleRank",
    "Snapshot",
    "SnapshotBuffers",
    "StagedDrafter",
    "StatusFileReporter",
    "TRAFFIC_RECORDS_ANNOTATION",
    "TensorSpec",
    "TorchDistGroup",
    "apply_in_place",
    "check_against_live",
    "check_config_frozen",
    "dir_signature",
    "is_version",
    "load_error_value",
    "parse_downward_annotations",
    "pod_identity",
    "read_latest",
    "read_status",
    "reporters_from_env",
    "resolve_version_dir",
    "set_override",
    "stage_drafter",
    "version_number",
]
