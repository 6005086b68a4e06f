"""Names the serving process shares with the operator, the chart and the docs.

Environment variables, mount paths and pod annotations are read or written by processes that
never import each other (the operator, Kubernetes, people following docs/contracts.md), so they
live in one place, and tests/serving/test_operator_contract.py checks both sides spell them the
same. Version names, which become paths under drafters/, are checked by
sglang_adaflash.validation and re-exported here.
"""

from __future__ import annotations

# Version names (``v000042``, ASCII digits only) are checked by sglang_adaflash.validation, the
# one check the server, the plugin and the CLI share; re-exported here for the reload code.
from sglang_adaflash.validation import is_version, version_number  # noqa: F401

# Environment variables (documented in docs/sglang.md). The Kubernetes names are the operator's
# contract (operator/adaflash_operator/contract.py); tests/serving/test_operator_contract.py
# checks that both sides spell them the same.
ENV_HOME = "ADAFLASH_HOME"
ENV_FLEET_VERSION_FILE = "ADAFLASH_FLEET_VERSION_FILE"
#: Older name of ``ADAFLASH_FLEET_VERSION_FILE``, still read when the new one is unset.
ENV_VERSION_FILE_ALIAS = "ADAFLASH_DESIRED_VERSION_FILE"
ENV_ANNOTATIONS_FILE = "ADAFLASH_POD_ANNOTATIONS_FILE"
ENV_POD_NAME = "ADAFLASH_POD_NAME"
ENV_POD_NAMESPACE = "ADAFLASH_POD_NAMESPACE"
#: Generic downward-API names, read when the ``ADAFLASH_`` ones are unset.
ENV_POD_NAME_FALLBACK = "POD_NAME"
ENV_POD_NAMESPACE_FALLBACK = "POD_NAMESPACE"
ENV_OVERRIDE_FILE = "ADAFLASH_ADMIN_OVERRIDE_FILE"
ENV_FOLLOW_LATEST = "ADAFLASH_FOLLOW_LATEST"
ENV_STATUS_FILE = "ADAFLASH_LOADED_VERSION_FILE"
ENV_POLL_S = "ADAFLASH_RELOAD_POLL_S"
ENV_SYNC_STEPS = "ADAFLASH_RELOAD_SYNC_STEPS"
ENV_REQUIRE_MANIFEST = "ADAFLASH_RELOAD_REQUIRE_MANIFEST"
ENV_POD_REPORT_S = "ADAFLASH_POD_REPORT_S"
#: Versions the admin call refuses without ``force`` (the operator's ConfigMap key, mounted).
ENV_BLOCKED_VERSIONS_FILE = "ADAFLASH_BLOCKED_VERSIONS_FILE"

DEFAULT_HOME = "/var/lib/adaflash"
# Where the operator mounts the fleet ConfigMap key and the downward-API annotations.
FLEET_VERSION_FILE = "/etc/adaflash/fleet/drafter-version"
POD_ANNOTATIONS_FILE = "/etc/adaflash/pod/annotations"
BLOCKED_VERSIONS_FILE = "/etc/adaflash/fleet/blocked-drafter-versions"

# Pod annotations. Written by the operator (canary pods only; overrides the fleet version):
DESIRED_ANNOTATION = "adaflash.io/desired-drafter-version"
# Written by the serving pod on itself:
LOADED_ANNOTATION = "adaflash.io/loaded-drafter-version"
LOAD_ERROR_ANNOTATION = "adaflash.io/drafter-load-error"  # "<version>: <reason>"
#: The version an admin override asks this pod for (absent without one): the operator shows it.
OVERRIDE_ANNOTATION = "adaflash.io/drafter-override"
ACCEPTANCE_TAU_ANNOTATION = "adaflash.io/acceptance-tau"  # decimal string
TRAFFIC_RECORDS_ANNOTATION = "adaflash.io/traffic-records"  # integer string
#: Longest load-error reason written to the annotation (the API limits all annotations to 256 KiB).
MAX_ERROR_CHARS = 1024


class ReloadError(RuntimeError):
    """A reload that did not happen; the old weights are still being served."""
