"""Drafter hot reload: learn the desired version, stage it off the critical path, swap in place.

The contract (DESIGN.md, "Hot reload"): a serving process is told which drafter version to serve,
loads it from the shared volume, verifies it, swaps it between decode steps (never inside one),
keeps serving the old version if anything fails, and reports what it serves.

Pieces, each usable alone:

- :class:`DesiredVersionSource` reads the desired version. Highest priority first: an admin
  override file (written by ``POST /adaflash/v1/drafter``), the pod annotation
  ``adaflash.io/desired-drafter-version`` in a downward-API annotations file (canary), a plain
  version file (a ConfigMap key: the fleet version), and ``drafters/latest`` when following it.
- :func:`stage_drafter` reads and verifies a version directory (manifest hashes, names, shapes,
  dtypes, full coverage, finite values, architecture unchanged) into CPU memory, pinned when CUDA
  is there. It runs on the watcher thread, never on the decode path.
- :func:`apply_in_place` copies a staged state into the live tensors *in place*: CUDA graphs hold
  raw pointers, so a parameter is never replaced, only overwritten. It snapshots the old values
  first and restores them if anything fails, so a failed load keeps the old weights.
- :class:`HotReloader` glues them: a watcher thread stages; ``at_step_boundary()``, called by the
  worker before each decode step, makes tensor-parallel ranks agree and swaps.
- Reporters publish the loaded version: a status file (read by ``GET /adaflash/v1/drafter``), the
  ``adaflash_drafter_info`` metric, and the pod annotations ``adaflash.io/loaded-drafter-version``
  and ``adaflash.io/drafter-load-error`` (:class:`PodAnnotationReporter`, which also carries the
  live ``acceptance-tau`` and ``traffic-records`` that :mod:`.pod_status` publishes).
"""

from __future__ import annotations

import json
import logging
import os
import ssl
import threading
import time
import urllib.request
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from sglang_adaflash.drafter.checkpoint import CheckpointError, read_checkpoint
from sglang_adaflash.drafter.manifest import (
    MANIFEST_NAME,
    ManifestError,
    check_target,
    read_manifest,
)
from sglang_adaflash.drafter.store import LATEST_NAME, VERSION_RE, drafters_dir, latest_version
from sglang_adaflash.fsio import write_json_atomic, write_text_atomic

from .metrics import MetricsSink, NullSink

logger = logging.getLogger(__name__)

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

DEFAULT_HOME = "/var/lib/adaflash"
# Where the operator mounts the fleet ConfigMap key and the downward-API annotations.
FLEET_VERSION_FILE = "/etc/adaflash/fleet/drafter-version"
POD_ANNOTATIONS_FILE = "/etc/adaflash/pod/annotations"

# Pod annotations. Written by the operator (canary pods only; overrides the fleet version):
DESIRED_ANNOTATION = "adaflash.io/desired-drafter-version"
# Written by the serving pod on itself:
LOADED_ANNOTATION = "adaflash.io/loaded-drafter-version"
LOAD_ERROR_ANNOTATION = "adaflash.io/drafter-load-error"  # "<version>: <reason>"
ACCEPTANCE_TAU_ANNOTATION = "adaflash.io/acceptance-tau"  # decimal string
TRAFFIC_RECORDS_ANNOTATION = "adaflash.io/traffic-records"  # integer string
#: Longest load-error reason written to the annotation (the API limits all annotations to 256 KiB).
MAX_ERROR_CHARS = 1024


class ReloadError(RuntimeError):
    """A reload that did not happen; the old weights are still being served."""


# ---------------------------------------------------------------------------------------------
# Versions and where they come from
# ---------------------------------------------------------------------------------------------


def version_number(version: str) -> int:
    """``v000042`` -> 42. Raises ValueError with the expected format otherwise."""
    m = VERSION_RE.match(version)
    if not m:
        raise ValueError(
            f"drafter version {version!r} is not of the form v000001 (a 'v' and at least six "
            "digits, as published under drafters/ on the shared volume)"
        )
    return int(m.group(1))


def is_version(text: str) -> bool:
    return bool(VERSION_RE.match(text))


def read_latest(home: str | os.PathLike) -> str | None:
    """The version named by ``drafters/latest``, or None (absent or unreadable: logged)."""
    try:
        return latest_version(home)
    except UnicodeDecodeError as e:  # a version name is ASCII: these bytes are not one
        logger.warning("ignoring drafters/latest: it is not text (%s)", e)
        return None
    except (CheckpointError, OSError) as e:
        logger.warning("ignoring drafters/latest: %s", e)
        return None


def resolve_version_dir(home: str | os.PathLike, version: str) -> Path:
    """The directory of ``version`` on the shared volume (``latest`` is resolved first)."""
    if version == LATEST_NAME:
        resolved = read_latest(home)
        if resolved is None:
            raise ReloadError(f"{drafters_dir(home) / LATEST_NAME} names no published version yet")
        version = resolved
    version_number(version)  # rejects names that could escape drafters/
    return drafters_dir(home) / version


def parse_downward_annotations(text: str) -> dict[str, str]:
    """Parse a Kubernetes downward-API ``annotations`` file: lines of ``key="quoted value"``.

    Values are Go-quoted strings; JSON string syntax covers what annotation values contain.
    Malformed lines are skipped (the kubelet rewrites the file atomically, so they are rare).
    """
    out: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, raw = line.partition("=")
        if not sep or not key.strip():
            continue
        raw = raw.strip()
        if len(raw) >= 2 and raw[0] == raw[-1] == '"':
            try:
                value = json.loads(raw)
            except json.JSONDecodeError:
                value = raw[1:-1]
        else:
            value = raw
        out[key.strip()] = value
    return out


def _read_text(path: Path | None) -> str | None:
    """A small file's text, or None when it is absent, unreadable or not UTF-8.

    Callers poll these files from the watcher and must keep serving whatever a volume, a
    ConfigMap or a person put in them, so bad bytes are logged and treated as no value.
    """
    if path is None:
        return None
    try:
        data = path.read_bytes()
    except (FileNotFoundError, IsADirectoryError, PermissionError):
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        logger.warning("ignoring %s: it is not UTF-8 text (%s)", path, e)
        return None


@dataclass
class DesiredVersionSource:
    """Reads which drafter version this process should serve.

    Priority: ``override_file`` (admin HTTP call) > ``annotations_file`` key
    ``annotation_key`` (per-pod canary) > ``version_file`` (fleet version, from
    ``ADAFLASH_FLEET_VERSION_FILE``) > ``drafters/latest`` when ``follow_latest``. A source that is absent, empty or not a version name is skipped; the
    value ``latest`` in any of them means the version ``drafters/latest`` names.
    """

    home: Path
    version_file: Path | None = None
    annotations_file: Path | None = None
    override_file: Path | None = None
    follow_latest: bool = False
    annotation_key: str = DESIRED_ANNOTATION

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> DesiredVersionSource:
        env = os.environ if env is None else env

        def path(name: str) -> Path | None:
            return Path(env[name]) if env.get(name) else None

        return cls(
            home=Path(env.get(ENV_HOME) or DEFAULT_HOME),
            version_file=path(ENV_FLEET_VERSION_FILE) or path(ENV_VERSION_FILE_ALIAS),
            annotations_file=path(ENV_ANNOTATIONS_FILE),
            override_file=path(ENV_OVERRIDE_FILE),
            follow_latest=env.get(ENV_FOLLOW_LATEST, "0").lower() in ("1", "true", "yes"),
        )

    def _candidates(self) -> Iterable[tuple[str, str | None]]:
        override = _read_text(self.override_file)
        yield "admin override", override.strip() if override else None
        annotations = _read_text(self.annotations_file)
        if annotations is not None:
            yield "pod annotation", parse_downward_annotations(annotations).get(self.annotation_key)
        fleet = _read_text(self.version_file)
        yield "fleet version file", fleet.strip() if fleet else None
        if self.follow_latest:
            yield "drafters/latest", LATEST_NAME

    def read(self) -> tuple[str, str] | None:
        """(version, which source said so), or None when no source names a version."""
        for origin, value in self._candidates():
            if not value:
                continue
            if value == LATEST_NAME:
                latest = read_latest(self.home)
                if latest is not None:
                    return latest, f"{origin} (latest)"
                continue
            if is_version(value):
                return value, origin
            logger.warning("%s names %r, which is not a drafter version; ignored", origin, value)
        return None


# ---------------------------------------------------------------------------------------------
# Staging: read and verify off the critical path
# ---------------------------------------------------------------------------------------------

#: Config fields a hot reload must not change: they shape buffers, CUDA graphs and the target
#: features the drafter reads. Changing them needs a restart.
FROZEN_CONFIG_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "block_size",
    "mask_token_id",
    "target_layer_ids",
    "use_length_head",
    "length_head_bottleneck_dim",
)


@dataclass
class StagedDrafter:
    """A verified drafter version held in CPU memory, ready to be copied in."""

    version: str
    path: Path
    config: Any  # DrafterConfig
    state: dict[str, torch.Tensor]  # checkpoint name -> CPU tensor in the live dtype
    manifest: dict[str, Any] | None
    signature: tuple  # the version directory's files (name, size, mtime) when it was read
    staged_at: float = field(default_factory=time.time)


def dir_signature(path: Path) -> tuple:
    """Names, sizes and mtimes of a directory's files: changes when a torn copy is completed."""
    try:
        entries = sorted(p for p in path.iterdir() if p.is_file())
    except FileNotFoundError:
        return ()
    return tuple((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in entries)


TensorSpec = tuple[tuple[int, ...], torch.dtype]


def check_against_live(
    state: Mapping[str, torch.Tensor], expected: Mapping[str, TensorSpec], where: str
) -> None:
    """Full coverage both ways and equal shapes between a checkpoint and the live weights."""
    missing = sorted(set(expected) - set(state))
    extra = sorted(set(state) - set(expected))
    if missing:
        raise ReloadError(
            f"{where} lacks {len(missing)} weights the serving drafter has, e.g. {missing[:3]}; "
            "a hot reload must replace every weight: publish a complete checkpoint"
        )
    if extra:
        raise ReloadError(
            f"{where} has {len(extra)} weights the serving drafter does not, e.g. {extra[:3]}; "
            "it was built with another architecture: restart the server to switch drafters"
        )
    for name, (shape, _dtype) in expected.items():
        found = tuple(state[name].shape)
        if found != tuple(shape):
            raise ReloadError(
                f"{where}: {name} has shape {found}, the serving drafter has {tuple(shape)}; "
                "restart the server to switch to a differently sized drafter"
            )
    for name, tensor in state.items():
        if not tensor.dtype.is_floating_point:
            raise ReloadError(f"{where}: {name} is {tensor.dtype}, expected a floating dtype")


def check_config_frozen(live_config: Any, new_config: Any, where: str) -> None:
    if live_config is None:
        return
    changed = [
        f"{name}: {getattr(live_config, name)!r} -> {getattr(new_config, name)!r}"
        for name in FROZEN_CONFIG_FIELDS
        if getattr(live_config, name, None) != getattr(new_config, name, None)
    ]
    if changed:
        raise ReloadError(
            f"{where} changes settings a hot reload cannot change ({'; '.join(changed)}); "
            "restart the server with the new drafter instead"
        )


def stage_drafter(
    path: str | os.PathLike,
    *,
    version: str,
    expected: Mapping[str, TensorSpec],
    live_config: Any = None,
    require_manifest: bool = True,
    pin_memory: bool | None = None,
    target_dir: str | os.PathLike | None = None,
) -> StagedDrafter:
    """Read and verify a published version; returns it in CPU memory in the live dtypes.

    Raises :class:`ReloadError` (never a half-checked state) when the directory is missing,
    torn, unhashed, tampered with, or does not fit the serving drafter exactly.
    """
    path = Path(path)
    signature = dir_signature(path)
    if not path.is_dir():
        raise ReloadError(f"drafter version {version} not found at {path}; is it published?")
    has_manifest = (path / MANIFEST_NAME).exists()
    if require_manifest and not has_manifest:
        raise ReloadError(
            f"{path} has no manifest.json: only published versions can be hot-reloaded "
            f"(set {ENV_REQUIRE_MANIFEST}=0 to allow unsigned directories)"
        )
    try:
        config, state = read_checkpoint(path, verify_manifest=True)
        manifest = read_manifest(path) if has_manifest else None
    except (CheckpointError, ValueError) as e:
        raise ReloadError(f"drafter version {version} rejected: {e}") from None
    if manifest is not None and manifest.get("version") not in (None, version):
        raise ReloadError(
            f"{path}/manifest.json says version {manifest.get('version')!r}, but the directory "
            f"is {version!r}: the volume is inconsistent; republish the version"
        )
    if manifest is not None and target_dir is not None:
        try:
            check_target(manifest, target_dir)  # a drafter fits only the target it learned from
        except ManifestError as e:
            raise ReloadError(f"drafter version {version} rejected: {e}") from None
    check_config_frozen(live_config, config, str(path))
    check_against_live(state, expected, str(path))
    if dir_signature(path) != signature:
        raise ReloadError(f"{path} changed while it was being read; will retry when it settles")
    if pin_memory is None:
        pin_memory = torch.cuda.is_available()
    converted = {}
    for name, tensor in state.items():
        t = tensor.to(expected[name][1]).contiguous()
        converted[name] = t.pin_memory() if pin_memory else t
    return StagedDrafter(version, path, config, converted, manifest, signature)


# ---------------------------------------------------------------------------------------------
# Applying in place, with rollback
# ---------------------------------------------------------------------------------------------


class ReloadTarget(Protocol):
    """What a hot reload writes into. Checkpoint names and live names may differ (SGLang fuses
    q/k/v and shards for tensor parallelism), so the two views are kept apart."""

    def expected(self) -> dict[str, TensorSpec]:
        """Checkpoint name -> (shape, dtype) this target accepts; full coverage required."""
        ...

    def live_tensors(self) -> dict[str, torch.Tensor]:
        """Every live tensor a reload may write (the storage that CUDA graphs point to)."""
        ...

    def write(self, state: Mapping[str, torch.Tensor]) -> None:
        """Copy a verified checkpoint state into the live tensors, in place."""
        ...

    def refresh(self) -> None:
        """Recompute state derived from the weights (stacked copies, merged embeddings)."""
        ...


class ModuleTarget:
    """A module whose state-dict names are the checkpoint names (the reference drafter, the
    length head, tests). ``prefix`` is stripped from checkpoint names to get module names."""

    def __init__(
        self, module: torch.nn.Module, prefix: str = "", refresh: Callable[[], None] | None = None
    ):
        self.module = module
        self.prefix = prefix
        self._refresh = refresh

    def live_tensors(self) -> dict[str, torch.Tensor]:
        return dict(self.module.state_dict(keep_vars=True))

    def expected(self) -> dict[str, TensorSpec]:
        return {
            self.prefix + name: (tuple(t.shape), t.dtype) for name, t in self.live_tensors().items()
        }

    def write(self, state: Mapping[str, torch.Tensor]) -> None:
        live = self.live_tensors()
        with torch.no_grad():
            for name, value in state.items():
                live[name.removeprefix(self.prefix)].copy_(value, non_blocking=True)

    def refresh(self) -> None:
        if self._refresh is not None:
            self._refresh()


class CompositeTarget:
    """Several targets behind one name space (e.g. SGLang's draft model plus our length head)."""

    def __init__(self, parts: Mapping[str, ReloadTarget]):
        self.parts = dict(parts)  # label -> target; checkpoint names must not overlap

    def expected(self) -> dict[str, TensorSpec]:
        out: dict[str, TensorSpec] = {}
        for part in self.parts.values():
            exp = part.expected()
            clash = set(out) & set(exp)
            if clash:
                raise ValueError(f"reload targets overlap on {sorted(clash)[:3]}")
            out.update(exp)
        return out

    def live_tensors(self) -> dict[str, torch.Tensor]:
        return {
            f"{label}/{name}": t
            for label, part in self.parts.items()
            for name, t in part.live_tensors().items()
        }

    def write(self, state: Mapping[str, torch.Tensor]) -> None:
        for part in self.parts.values():
            keys = part.expected().keys()
            part.write({k: state[k] for k in keys})

    def refresh(self) -> None:
        for part in self.parts.values():
            part.refresh()


@dataclass
class Snapshot:
    """Host copies of live tensors taken before a write, and the pointers they had."""

    tensors: dict[str, torch.Tensor]
    live: dict[str, torch.Tensor]
    pointers: dict[str, int]

    @classmethod
    def take(cls, live: Mapping[str, torch.Tensor]) -> Snapshot:
        with torch.no_grad():
            copies = {name: t.detach().to("cpu", copy=True) for name, t in live.items()}
        return cls(copies, dict(live), {name: t.data_ptr() for name, t in live.items()})

    def moved(self, live: Mapping[str, torch.Tensor]) -> list[str]:
        """Live tensors that are no longer the storage they were (a reload must never do that)."""
        return sorted(
            name
            for name, ptr in self.pointers.items()
            if name not in live or live[name].data_ptr() != ptr
        )

    def restore(self) -> None:
        with torch.no_grad():
            for name, t in self.live.items():
                t.copy_(self.tensors[name])
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # CPU-GPU sync: the restore must be complete before decoding


def apply_in_place(target: ReloadTarget, state: Mapping[str, torch.Tensor]) -> Snapshot:
    """Overwrite the target's weights with ``state`` in place; returns the pre-write snapshot.

    On any failure the old values are copied back and :class:`ReloadError` is raised. The caller
    may still restore the snapshot later (e.g. when another tensor-parallel rank failed).
    """
    snapshot = Snapshot.take(target.live_tensors())
    try:
        target.write(state)
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # CPU-GPU sync: surface async copy errors here, not later
        moved = snapshot.moved(target.live_tensors())
        if moved:
            raise ReloadError(
                f"the reload replaced tensors instead of copying into them ({moved[:3]}); CUDA "
                "graphs would keep reading the old storage"
            )
        target.refresh()
    except Exception as e:
        snapshot.restore()
        target.refresh()
        if isinstance(e, ReloadError):
            raise
        raise ReloadError(
            f"copying the new drafter weights failed ({e!r}); old weights restored"
        ) from e
    return snapshot


# ---------------------------------------------------------------------------------------------
# Tensor-parallel lockstep
# ---------------------------------------------------------------------------------------------


class LockstepGroup(Protocol):
    size: int

    def all_min(self, values: list[int]) -> list[int]:
        """Element-wise minimum over all ranks; every rank must call it at the same step."""
        ...


class SingleRank:
    size = 1

    def all_min(self, values: list[int]) -> list[int]:
        return list(values)


class TorchDistGroup:
    """``all_reduce(MIN)`` over a CPU (gloo) process group, e.g. SGLang's TP ``cpu_group``."""

    def __init__(self, group=None):
        import torch.distributed as dist

        self._dist = dist
        self.group = group
        self.size = dist.get_world_size(group)

    def all_min(self, values: list[int]) -> list[int]:
        t = torch.tensor(values, dtype=torch.int64)
        self._dist.all_reduce(t, op=self._dist.ReduceOp.MIN, group=self.group)
        return t.tolist()


# ---------------------------------------------------------------------------------------------
# Reporting
# ---------------------------------------------------------------------------------------------


class Reporter(Protocol):
    def report(self, status: dict[str, Any]) -> None: ...


class StatusFileReporter:
    """Writes the status JSON atomically; ``GET /adaflash/v1/drafter`` serves this file."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)

    def report(self, status: dict[str, Any]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(self.path, status)


def pod_identity(env: Mapping[str, str]) -> tuple[str | None, str | None]:
    """This pod's (name, namespace) from the environment: the operator's ``ADAFLASH_POD_NAME`` /
    ``ADAFLASH_POD_NAMESPACE``, else the generic ``POD_NAME`` / ``POD_NAMESPACE``."""
    name = env.get(ENV_POD_NAME) or env.get(ENV_POD_NAME_FALLBACK) or None
    namespace = env.get(ENV_POD_NAMESPACE) or env.get(ENV_POD_NAMESPACE_FALLBACK) or None
    return name, namespace


def load_error_value(version: str | None, reason: str) -> str:
    """The ``adaflash.io/drafter-load-error`` value: ``"<version>: <reason>"``, one line, capped."""
    reason = " ".join(str(reason).split())
    if len(reason) > MAX_ERROR_CHARS:
        reason = reason[: MAX_ERROR_CHARS - 3] + "..."
    return f"{version or '?'}: {reason}"


#: ``transport(body)`` sends one merge-patch body for this pod; raises on failure.
PatchTransport = Callable[[dict[str, Any]], None]


class PodAnnotationReporter:
    """Keeps this pod's ``adaflash.io/`` status annotations up to date through the Kubernetes API.

    Annotations (the operator's contract, docs/operator.md):

    - ``adaflash.io/loaded-drafter-version``: the version served now;
    - ``adaflash.io/drafter-load-error``: ``"<version>: <reason>"`` after a failed load, removed
      after a successful one (and when the desired version moves off the failed one);
    - ``adaflash.io/acceptance-tau`` and ``adaflash.io/traffic-records``: set through
      :meth:`update` by the periodic publisher (:mod:`sglang_adaflash.serving.pod_status`).

    Only keys whose value changed since the last successful patch are sent (a JSON merge patch;
    ``None`` removes a key), so repeated reports cost nothing. A failed patch is logged and kept
    pending; the next :meth:`flush` (the publisher calls it periodically) retries it. Needs the
    pod's name (``ADAFLASH_POD_NAME``, downward API ``metadata.name``), its namespace
    (``ADAFLASH_POD_NAMESPACE`` or the service account's namespace file) and RBAC ``patch`` on
    pods.
    """

    SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")

    def __init__(
        self,
        pod: str,
        namespace: str,
        *,
        api_url: str = "",
        token: str | None = None,
        ca_file: str | None = None,
        timeout_s: float = 5.0,
        transport: PatchTransport | None = None,
    ):
        self.pod, self.namespace = pod, namespace
        self.api_url = api_url.rstrip("/")
        self.token, self.ca_file, self.timeout_s = token, ca_file, timeout_s
        self.transport: PatchTransport = transport or self._http_patch
        self._lock = threading.Lock()
        self._want: dict[str, str | None] = {}
        self._sent: dict[str, str | None] = {}
        self.failures = 0  # consecutive failed patches

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> PodAnnotationReporter | None:
        """The reporter for the pod this process runs in, or None outside Kubernetes."""
        env = os.environ if env is None else env
        host = env.get("KUBERNETES_SERVICE_HOST")
        pod, namespace = pod_identity(env)
        if not host or not pod:
            return None
        namespace = namespace or _read_text(cls.SA_DIR / "namespace")
        if not namespace or not namespace.strip():
            logger.warning(
                "%s is set but the namespace is unknown; set %s", ENV_POD_NAME, ENV_POD_NAMESPACE
            )
            return None
        token = _read_text(cls.SA_DIR / "token")
        ca = cls.SA_DIR / "ca.crt"
        port = env.get("KUBERNETES_SERVICE_PORT", "443")
        return cls(
            pod,
            namespace.strip(),
            api_url=f"https://{host}:{port}",
            token=token.strip() if token else None,
            ca_file=str(ca) if ca.exists() else None,
        )

    @staticmethod
    def status_annotations(status: Mapping[str, Any]) -> dict[str, str | None]:
        """The annotations a reload status implies (loaded version and load error)."""
        out: dict[str, str | None] = {}
        if status.get("loaded_version"):
            out[LOADED_ANNOTATION] = str(status["loaded_version"])
        error = status.get("last_error")
        out[LOAD_ERROR_ANNOTATION] = (
            load_error_value(status.get("last_error_version"), error) if error else None
        )
        return out

    def patch_body(self, annotations: Mapping[str, str | None]) -> dict[str, Any]:
        return {"metadata": {"annotations": dict(annotations)}}

    def report(self, status: dict[str, Any]) -> None:
        """Reporter protocol: called by :class:`HotReloader` whenever its status changes."""
        self.update(self.status_annotations(status))

    def update(self, annotations: Mapping[str, str | None]) -> bool:
        """Record the wanted values and patch what changed; False when the patch failed."""
        with self._lock:
            self._want.update(annotations)
        return self.flush()

    def pending(self) -> dict[str, str | None]:
        with self._lock:
            return {
                k: v for k, v in self._want.items() if k not in self._sent or self._sent[k] != v
            }

    def flush(self) -> bool:
        """Send the pending changes (if any). Never raises: a failure is logged and retried."""
        with self._lock:  # one patch at a time, so patches reach the API in order
            diff = {
                k: v for k, v in self._want.items() if k not in self._sent or self._sent[k] != v
            }
            if not diff:
                return True
            try:
                self.transport(self.patch_body(diff))
            except Exception as e:
                self.failures += 1
                log = logger.warning if self.failures in (1, 10) or self.failures % 100 == 0 else (
                    logger.debug
                )
                log(
                    "adaflash: patching pod %s/%s annotations failed (%s, %d in a row); "
                    "will retry",
                    self.namespace,
                    self.pod,
                    e,
                    self.failures,
                )
                return False
            self.failures = 0
            self._sent.update(diff)
            return True

    def _http_patch(self, body: dict[str, Any]) -> None:
        url = f"{self.api_url}/api/v1/namespaces/{self.namespace}/pods/{self.pod}"
        req = urllib.request.Request(
            url,
            data=json.dumps(body).encode(),
            method="PATCH",
            headers={"Content-Type": "application/merge-patch+json"},
        )
        if self.token:
            req.add_header("Authorization", f"Bearer {self.token}")
        context = None
        if url.startswith("https://"):
            context = ssl.create_default_context(cafile=self.ca_file)
        with urllib.request.urlopen(req, timeout=self.timeout_s, context=context) as resp:
            if resp.status >= 300:
                raise ReloadError(f"patching pod {self.pod} returned HTTP {resp.status}")


def reporters_from_env(env: Mapping[str, str] | None = None) -> list[Reporter]:
    env = os.environ if env is None else env
    out: list[Reporter] = []
    if env.get(ENV_STATUS_FILE):
        out.append(StatusFileReporter(env[ENV_STATUS_FILE]))
    pod = PodAnnotationReporter.from_env(env)
    if pod is not None:
        out.append(pod)
    return out


# ---------------------------------------------------------------------------------------------
# The controller
# ---------------------------------------------------------------------------------------------


@dataclass
class ReloadStatus:
    loaded_version: str | None
    loaded_at: float | None = None
    desired_version: str | None = None
    desired_from: str | None = None
    staged_version: str | None = None
    last_error: str | None = None
    last_error_version: str | None = None
    reloads: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


class HotReloader:
    """Watches for a desired version, stages it in the background, swaps it at step boundaries.

    Threads: ``poll_once`` (the watcher, or a test) reads and verifies; ``at_step_boundary``
    (the decode loop) swaps. They share only ``_staged``, under ``_lock``.
    Every rank of a tensor-parallel group must call ``at_step_boundary`` on the same steps: it
    calls ``group.all_min`` every ``sync_every_steps`` steps, and ranks swap only when all of
    them have staged the same version, and keep the new weights only when all copies succeeded.
    """

    def __init__(
        self,
        *,
        source: DesiredVersionSource,
        target: ReloadTarget,
        loaded_version: str | None,
        live_config: Any = None,
        group: LockstepGroup | None = None,
        sink: MetricsSink | None = None,
        reporters: Iterable[Reporter] = (),
        poll_interval_s: float = 5.0,
        sync_every_steps: int = 1,
        require_manifest: bool = True,
        report_async: bool = True,
        target_dir: str | os.PathLike | None = None,
    ):
        self.source = source
        self.target = target
        self.live_config = live_config
        self.group = group or SingleRank()
        self.sink = sink or NullSink()
        self.reporters = list(reporters)
        self.poll_interval_s = poll_interval_s
        self.sync_every_steps = max(1, sync_every_steps)
        self.require_manifest = require_manifest
        self.report_async = report_async
        self.target_dir = target_dir
        self.status = ReloadStatus(loaded_version, time.time() if loaded_version else None)
        self._lock = threading.Lock()
        self._staged: StagedDrafter | None = None
        self._rejected: dict[str, tuple] = {}  # version -> dir signature when it was rejected
        self._rejected_why: dict[str, str] = {}  # version -> the error it was rejected with
        self._report_queue: deque[Callable[[], None]] = deque()
        self._report_thread: threading.Thread | None = None
        self._steps = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._expected = target.expected()
        if loaded_version:
            self.sink.set_drafter_version(loaded_version)
        self._report()

    # -- watcher side --------------------------------------------------------------------------

    def poll_once(self) -> StagedDrafter | None:
        """Stage the desired version if it is new; returns what is staged (or None)."""
        found = self.source.read()
        if found is None:
            return self._staged
        version, origin = found
        self.status.desired_version, self.status.desired_from = version, origin
        if self.status.last_error and self.status.last_error_version not in (None, version):
            # The desired version moved off the one that failed (a rollback, a newer version):
            # the error no longer describes what this pod is asked to serve.
            self.status.last_error = self.status.last_error_version = None
            self._report()
        with self._lock:
            staged = self._staged
        if version == self.status.loaded_version:
            if staged is not None:  # the desired version went back to what is loaded
                with self._lock:
                    self._staged = None
                self.status.staged_version = None
            return None
        if staged is not None and staged.version == version:
            return staged
        path = drafters_dir(self.source.home) / version
        if self._rejected.get(version) == dir_signature(path):
            # Same bytes as when it was rejected: do not retry until they change, but say so
            # again if the error was cleared meanwhile (the version was asked for once more).
            why = self._rejected_why.get(version)
            if why and self.status.last_error_version != version:
                self.status.last_error, self.status.last_error_version = why, version
                self._report()
            return staged
        try:
            new = stage_drafter(
                path,
                version=version,
                expected=self._expected,
                live_config=self.live_config,
                require_manifest=self.require_manifest,
                target_dir=self.target_dir,
            )
        except ReloadError as e:
            self._rejected[version] = dir_signature(path)
            self._fail("rejected", version, str(e))
            return staged
        with self._lock:
            self._staged = new
        self.status.staged_version = version
        logger.info(
            "drafter %s (%s) verified and staged; swapping at the next step", version, origin
        )
        return new

    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._watch, name="adaflash-reload", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None

    def _watch(self) -> None:
        while not self._stop.is_set():
            try:
                self.poll_once()
            except Exception:  # the watcher must survive anything the volume throws at it
                logger.exception("adaflash reload watcher failed; retrying")
            self._stop.wait(self.poll_interval_s)

    # -- decode-loop side ------------------------------------------------------------------------

    def at_step_boundary(self) -> str | None:
        """Call before each decode step. Returns the version swapped in, or None (the usual case)."""
        self._steps += 1
        if self.group.size == 1:
            if self._staged is None:  # fast path: one attribute read per step
                return None
        elif self._steps % self.sync_every_steps:
            return None
        with self._lock:
            staged = self._staged
        ready = version_number(staged.version) if staged is not None else -1
        low, neg_high = self.group.all_min([ready, -ready])
        if low < 0 or low != -neg_high:
            return None  # some rank has nothing staged, or ranks staged different versions
        try:
            snapshot = apply_in_place(self.target, staged.state)
            ok = 1
        except ReloadError as e:
            snapshot, ok = None, 0
            error = str(e)
        (all_ok,) = self.group.all_min([ok])
        with self._lock:
            if self._staged is staged:
                self._staged = None
        self.status.staged_version = None
        if not ok:
            self._rejected[staged.version] = staged.signature
            self._fail("failed", staged.version, error)
            return None
        if not all_ok:
            snapshot.restore()
            self.target.refresh()
            self._rejected[staged.version] = staged.signature
            self._fail("rolled_back", staged.version, "another tensor-parallel rank failed to copy")
            return None
        self.status.loaded_version, self.status.loaded_at = staged.version, time.time()
        self.status.last_error = self.status.last_error_version = None
        self._count("success")
        self.sink.set_drafter_version(staged.version)
        logger.info("drafter %s is now serving (swapped in place)", staged.version)
        self._report()
        return staged.version

    # -- bookkeeping ---------------------------------------------------------------------------

    def _count(self, result: str) -> None:
        self.status.reloads[result] = self.status.reloads.get(result, 0) + 1
        self.sink.count_reload(result)

    def _fail(self, result: str, version: str, error: str) -> None:
        self.status.last_error, self.status.last_error_version = error, version
        self._rejected_why[version] = error
        self._count(result)
        logger.error(
            "drafter reload to %s %s: %s; still serving %s",
            version,
            result,
            error,
            self.status.loaded_version,
        )
        self._report()

    def _report(self) -> None:
        status = self.status.to_dict()

        def run() -> None:
            for reporter in self.reporters:
                try:
                    reporter.report(status)
                except Exception as e:  # reporting must never break serving
                    logger.warning("adaflash: reporting to %r failed: %s", reporter, e)

        if self.report_async and self.reporters:
            # One reporting thread, fed in order, so an older status never lands after a newer.
            with self._lock:
                self._report_queue.append(run)
                if self._report_thread is None or not self._report_thread.is_alive():
                    self._report_thread = threading.Thread(
                        target=self._drain_reports, name="adaflash-report", daemon=True
                    )
                    self._report_thread.start()
        else:
            run()

    def _drain_reports(self) -> None:
        while True:
            with self._lock:
                if not self._report_queue:
                    self._report_thread = None
                    return
                run = self._report_queue.popleft()
            run()


# ---------------------------------------------------------------------------------------------
# Admin endpoint logic (framework-agnostic; the SGLang plugin mounts it on SGLang's HTTP app)
# ---------------------------------------------------------------------------------------------


def read_status(path: str | os.PathLike | None) -> dict[str, Any]:
    """The status a serving process last reported, or a 'not reported yet' stub."""
    if path is None:
        return {"loaded_version": None, "error": f"{ENV_STATUS_FILE} is not set"}
    try:
        return json.loads(Path(path).read_bytes())
    except FileNotFoundError:
        return {"loaded_version": None, "error": "the serving process has not reported yet"}
    except (json.JSONDecodeError, UnicodeDecodeError) as e:  # written atomically: a foreign writer
        return {"loaded_version": None, "error": f"{path} is not valid JSON: {e}"}


def set_override(
    path: str | os.PathLike, version: str | None, home: str | os.PathLike
) -> dict[str, Any]:
    """Ask the watcher for ``version`` (or clear the override with None); validates first."""
    path = Path(path)
    if version is None:
        path.unlink(missing_ok=True)
        return {"override": None}
    if version != LATEST_NAME:
        version_number(version)
        if not (drafters_dir(home) / version).is_dir():
            raise ReloadError(
                f"drafter version {version} is not published under {drafters_dir(home)}; "
                f"published: {', '.join(sorted(p.name for p in drafters_dir(home).glob('v*'))) or 'none'}"
            )
    write_text_atomic(path, version + "\n")
    return {"override": version}
