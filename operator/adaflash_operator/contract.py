"""Names that the operator shares with the serving pods and the distillation Job.

This module is the single place that spells them; docs/operator.md documents them as the
contract. The serving-side reload agent and the training job implement the other side.
"""

GROUP = "adaflash.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
SERVICE_KIND = "AdaFlashService"
SERVICE_PLURAL = "adaflashservices"
DRAFTER_KIND = "DrafterVersion"
DRAFTER_PLURAL = "drafterversions"

# The shared volume inside every pod (ADAFLASH_HOME), see docs/contracts.md "Shared volume".
HOME = "/var/lib/adaflash"
DRAFTERS_DIR = f"{HOME}/drafters"
# Where the fleet ConfigMap and the downward-API annotations are mounted in serving pods.
CONTROL_DIR = "/etc/adaflash"
# File (ConfigMap key) holding the fleet's drafter version, e.g. "v000003".
FLEET_VERSION_KEY = "drafter-version"
# ConfigMap key naming the serving pods' ServiceAccount (read by the chart's admission policy).
SERVING_ACCOUNT_KEY = "serving-service-account"
FLEET_VERSION_FILE = f"{CONTROL_DIR}/fleet/{FLEET_VERSION_KEY}"
# ConfigMap key (a file next to the fleet version) listing the versions the admin call refuses
# without force: one "<version> <phase>" line per Rejected or RolledBack DrafterVersion.
BLOCKED_VERSIONS_KEY = "blocked-drafter-versions"
BLOCKED_VERSIONS_FILE = f"{CONTROL_DIR}/fleet/{BLOCKED_VERSIONS_KEY}"
BLOCKED_PHASES = ("Rejected", "RolledBack")
# The per-service Secret's key holding the admin bearer token.
ADMIN_TOKEN_KEY = "token"
# Downward-API file with all pod annotations ("key=\"value\"" lines).
POD_ANNOTATIONS_FILE = f"{CONTROL_DIR}/pod/annotations"

# Pod annotations. Written by the operator:
DESIRED_VERSION = "adaflash.io/desired-drafter-version"  # canary pods only; overrides the fleet
# Written by the serving pod on itself (its ServiceAccount may patch pods):
LOADED_VERSION = "adaflash.io/loaded-drafter-version"  # what it serves now (docs/contracts.md)
LOAD_ERROR = "adaflash.io/drafter-load-error"  # "<version>: <reason>" after a failed load
ACCEPTANCE_TAU = "adaflash.io/acceptance-tau"  # live mean acceptance length, decimal string
TRAFFIC_RECORDS = "adaflash.io/traffic-records"  # records this pod logged since it started
OVERRIDE = "adaflash.io/drafter-override"  # the version an admin override asks this pod for

# Labels.
LABEL_SERVICE = "adaflash.io/service"  # the owning AdaFlashService's name
LABEL_COMPONENT = "adaflash.io/component"  # serving | distill | bootstrap | storage
LABEL_ROUND = "adaflash.io/distill-round"
LABEL_DISTILL_JOB = "adaflash.io/distill-job"  # on a training Job's pods: the Job's name
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
MANAGED_BY = "adaflash-operator"

# Environment of the serving pods.
ENV_HOME = "ADAFLASH_HOME"
ENV_POD_NAME = "ADAFLASH_POD_NAME"
ENV_POD_NAMESPACE = "ADAFLASH_POD_NAMESPACE"
ENV_FLEET_VERSION_FILE = "ADAFLASH_FLEET_VERSION_FILE"
# The fleet's version when the container started (from the ConfigMap; the launch path uses it).
ENV_FLEET_VERSION = "ADAFLASH_START_DRAFTER_VERSION"
ENV_POD_ANNOTATIONS_FILE = "ADAFLASH_POD_ANNOTATIONS_FILE"
ENV_BLOCKED_VERSIONS_FILE = "ADAFLASH_BLOCKED_VERSIONS_FILE"
# The admin endpoint's bearer token (from the Secret); without it the endpoint refuses POST.
ENV_ADMIN_TOKEN = "ADAFLASH_ADMIN_TOKEN"

# The distillation Job's container writes its report (JSON) here; Kubernetes copies it into the
# terminated container state's `message` (at most 4096 bytes).
TERMINATION_LOG = "/dev/termination-log"
DISTILL_CONTAINER = "distill"
BOOTSTRAP_CONTAINER = "bootstrap"
# The serving pods' init container that waits for the fleet's drafter on the volume.
WAIT_DRAFTER_CONTAINER = "wait-drafter"
SERVING_CONTAINER = "sglang"
