"""Reporters: publish what a serving process loaded, for the admin API and the operator.

A report is a side effect that may fail (a full disk, an API server that is down); reporters
are called off the decode path and their failures are logged and retried, never raised into
serving.
"""

from __future__ import annotations

import json
import logging
import os
import ssl
import threading
import urllib.request
from collections import deque
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

from sglang_adaflash.fsio import write_json_atomic

from .contract import (
    ENV_POD_NAME,
    ENV_POD_NAME_FALLBACK,
    ENV_POD_NAMESPACE,
    ENV_POD_NAMESPACE_FALLBACK,
    ENV_STATUS_FILE,
    LOAD_ERROR_ANNOTATION,
    LOADED_ANNOTATION,
    MAX_ERROR_CHARS,
    OVERRIDE_ANNOTATION,
    ReloadError,
)
from .source import read_optional_text

logger = logging.getLogger(__name__)


class Reporter(Protocol):
    def report(self, status: dict[str, Any]) -> None: ...


class ReportQueue:
    """Runs reports in order on one long-lived thread; the caller only enqueues.

    Reports are made on the decode thread, at a hot swap, between two decode steps. A thread
    started there per burst of reports made that thread wait for the new one to start (the
    ``Thread.start`` handshake) and then for the interpreter lock it took: up to 3 ms of a 5 ms
    step. The thread here starts with the queue and waits on a condition, so ``put`` is an
    append and a notify.
    """

    def __init__(self, name: str = "adaflash-report"):
        self._cv = threading.Condition()
        self._queue: deque[Callable[[], None]] = deque()
        self._busy = self._closed = False
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def put(self, job: Callable[[], None]) -> None:
        """Queue a report; after ``close`` it runs here and now (late, not lost)."""
        with self._cv:
            if not self._closed:
                self._queue.append(job)
                self._cv.notify()
                return
        job()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every report queued so far has run; False on timeout."""
        with self._cv:
            return self._cv.wait_for(lambda: not self._queue and not self._busy, timeout)

    def close(self, timeout: float | None = 10) -> None:
        """Run what is queued, then end the thread."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self.thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._queue or self._closed)
                if not self._queue:
                    return  # closed and drained
                job = self._queue.popleft()
                self._busy = True
            try:
                job()
            except Exception as e:  # a job is a report, and reporting never breaks serving
                logger.warning("adaflash: a report failed: %s", e)
            finally:
                with self._cv:
                    self._busy = False
                    self._cv.notify_all()


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
    - ``adaflash.io/drafter-override``: the version an admin override asks for, removed when
      the override is cleared;
    - ``adaflash.io/acceptance-tau`` and ``adaflash.io/traffic-records``: set through
      :meth:`update` by the periodic publisher (:mod:`sglang_adaflash.serving.pod_status`).

    Only keys whose value changed since the last successful patch are sent (a JSON merge patch;
    ``None`` removes a key), so repeated reports cost nothing. A failed patch is logged and kept
    pending; the next :meth:`flush` (the publisher calls it periodically) retries it. Needs the
    pod's name (``ADAFLASH_POD_NAME``, downward API ``metadata.name``), its namespace
    (``ADAFLASH_POD_NAMESPACE`` or the service account's namespace file) and RBAC ``patch`` on
    pods.

    The transport stays a plain urllib PATCH (the operator uses kubernetes_asyncio; see
    docs/operator.md, "API client"): it is one request, with the pod's own mounted credentials,
    from a background thread of the SGLang scheduler process, retried by :meth:`flush`. The
    token file is read at every request, because the kubelet rotates bound tokens.
    """

    SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")

    def __init__(
        self,
        pod: str,
        namespace: str,
        *,
        api_url: str = "",
        token: str | None = None,
        token_file: str | None = None,
        ca_file: str | None = None,
        timeout_s: float = 5.0,
        transport: PatchTransport | None = None,
    ):
        self.pod, self.namespace = pod, namespace
        self.api_url = api_url.rstrip("/")
        self.token, self.ca_file, self.timeout_s = token, ca_file, timeout_s
        self.token_file = token_file  # read per request: bound tokens rotate
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
        namespace = namespace or read_optional_text(cls.SA_DIR / "namespace")
        if not namespace or not namespace.strip():
            logger.warning(
                "%s is set but the namespace is unknown; set %s", ENV_POD_NAME, ENV_POD_NAMESPACE
            )
            return None
        ca = cls.SA_DIR / "ca.crt"
        port = env.get("KUBERNETES_SERVICE_PORT", "443")
        return cls(
            pod,
            namespace.strip(),
            api_url=f"https://{host}:{port}",
            token_file=str(cls.SA_DIR / "token"),
            ca_file=str(ca) if ca.exists() else None,
        )

    def current_token(self) -> str | None:
        """The token to send: the token file's content now (it rotates), else the fixed one."""
        if self.token_file:
            token = read_optional_text(Path(self.token_file))
            if token and token.strip():
                return token.strip()
        return self.token

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
        # An admin override outranks the operator's decisions: say so where the operator looks.
        if "desired_from" in status:
            origin = str(status.get("desired_from") or "")
            out[OVERRIDE_ANNOTATION] = (
                str(status.get("desired_version")) if origin.startswith("admin override") else None
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
        token = self.current_token()
        if token:
            req.add_header("Authorization", f"Bearer {token}")
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
