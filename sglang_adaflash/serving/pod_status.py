"""Live pod status for the operator: acceptance tau and the traffic record count.

The operator (docs/operator.md) reads two live annotations off every serving pod:

- ``adaflash.io/acceptance-tau``: the mean acceptance length over a recent window, a decimal
  string; it compares canary pods with the rest of the fleet after a bake;
- ``adaflash.io/traffic-records``: the traffic records this pod logged since it started, an
  integer string; the sum of what pods logged since the last round triggers distillation.

:class:`PodStatsPublisher` writes both through a :class:`~.reload.PodAnnotationReporter` every
``interval_s`` (``ADAFLASH_POD_REPORT_S``, default 15 s), and only when a value changed, so a
pod patches itself at most once per interval for them. Tau comes from
:class:`~.metrics.AcceptanceWindow`, a sink fed with the step stats the worker already records.

SGLang pods log traffic with SGLang's own request log (``--log-requests --log-requests-format
json --log-requests-target $ADAFLASH_HOME/traffic/<pod>``), written by the HTTP process, not by
the scheduler process this plugin runs in. So the count is taken where the records are: a
:class:`RequestLogCounter` reads the log directories incrementally (each file from where it
stopped, followed by inode across SGLang's hourly renames) and counts ``request.finished``
lines. The directory is per pod, so the count includes what an earlier container of the same
pod logged. Without ``--log-requests`` to a directory the pod logs no records and reports 0.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from pathlib import Path

from .background import BackgroundLoop
from .metrics import AcceptanceWindow
from .reload import ACCEPTANCE_TAU_ANNOTATION, TRAFFIC_RECORDS_ANNOTATION, PodAnnotationReporter

logger = logging.getLogger(__name__)

DEFAULT_REPORT_S = 15.0
#: A finished request in SGLang's JSON request log (``json.dumps`` separators; inside a string
#: value the quotes would be escaped, so this cannot come from request content).
JSON_FINISHED = b'"event": "request.finished"'
#: A finished request in SGLang's text request log (``[time] Finish: obj=...``).
TEXT_FINISHED = b"] Finish: "
_HEAD = 160  # the markers sit near the start of a line: "[time] {"timestamp": ..., "event": ...
_CHUNK = 1 << 20


def _is_finished(line: bytes) -> bool:
    head = line[:_HEAD]
    return JSON_FINISHED in head or TEXT_FINISHED in head


class RequestLogCounter:
    """Counts finished-request lines SGLang's request log wrote into ``directories``.

    Incremental: each file is read from the offset where the last :meth:`poll` stopped, up to
    its last complete line. Files are keyed by (device, inode), so SGLang's hourly rotation (a
    rename) is not counted twice; a file that shrank is read again from the start. The total
    never goes down, even when files are removed (e.g. after the training job consumed them).
    """

    def __init__(self, directories: Iterable[str | os.PathLike]):
        self.directories = [Path(d) for d in directories]
        self._offsets: dict[tuple[int, int], int] = {}
        self.total = 0

    def poll(self) -> int:
        for directory in self.directories:
            try:
                entries = sorted(p for p in directory.iterdir() if p.is_file())
            except (FileNotFoundError, NotADirectoryError, PermissionError):
                continue  # not created yet (SGLang makes it at start-up)
            for path in entries:
                try:
                    self._read(path)
                except OSError as e:  # vanished or unreadable: the next poll tries again
                    logger.debug("adaflash: request log %s skipped: %s", path, e)
        return self.total

    def _read(self, path: Path) -> None:
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            key = (st.st_dev, st.st_ino)
            offset = self._offsets.get(key, 0)
            if st.st_size < offset:
                offset = 0  # truncated and rewritten
            if st.st_size == offset:
                self._offsets[key] = offset
                return
            f.seek(offset)
            carry = b""
            while True:
                chunk = f.read(_CHUNK)
                if not chunk:
                    break
                lines = (carry + chunk).split(b"\n")
                carry = lines.pop()  # an incomplete last line waits for the next poll
                for line in lines:
                    if _is_finished(line):
                        self.total += 1
                    offset += len(line) + 1
        self._offsets[key] = offset


def request_log_dirs(server_args) -> list[str]:
    """The directories SGLang writes its request log into (none when it does not log to files)."""
    if not getattr(server_args, "log_requests", False):
        return []
    targets = getattr(server_args, "log_requests_target", None) or []
    if isinstance(targets, str):
        targets = [targets]
    return [t for t in targets if t and t.lower() != "stdout"]


class PodStatsPublisher:
    """Publishes acceptance tau and the traffic record count as pod annotations, periodically.

    Each :meth:`tick` reads tau from ``window`` (absent until the served version has a window of
    its own: the annotation is then removed) and the count from ``traffic`` (``"0"`` without a
    counter: this pod logs no records), hands both to the reporter, which patches only changed
    values, and retries any patch that failed before. A failure never stops the thread.
    """

    def __init__(
        self,
        reporter: PodAnnotationReporter,
        *,
        window: AcceptanceWindow | None = None,
        traffic: RequestLogCounter | None = None,
        interval_s: float = DEFAULT_REPORT_S,
    ):
        self.reporter = reporter
        self.window = window
        self.traffic = traffic
        self.interval_s = max(1.0, float(interval_s))
        self._loop = BackgroundLoop(self.tick, self.interval_s, name="adaflash-pod-status")

    def annotations(self) -> dict[str, str | None]:
        out: dict[str, str | None] = {}
        if self.window is not None:
            tau = self.window.take()
            out[ACCEPTANCE_TAU_ANNOTATION] = f"{tau:.3f}" if tau is not None else None
        out[TRAFFIC_RECORDS_ANNOTATION] = str(self.traffic.poll() if self.traffic else 0)
        return out

    def tick(self) -> bool:
        try:
            return self.reporter.update(self.annotations())
        except Exception:  # reporting must never break serving
            logger.exception("adaflash: publishing pod status failed; retrying")
            return False

    def start(self) -> None:
        self._loop.interval_s = self.interval_s
        self._loop.start()

    def stop(self) -> None:
        self._loop.stop(timeout=10)
