"""The controller that ties source, staging, apply, lockstep and reporters together.

Two threads meet here: the watcher, which may block on the volume for seconds, and the decode
loop, which must not block at all; they share one reference to the staged version, so the
decode loop's usual cost is a single attribute read.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from sglang_adaflash.drafter.store import drafters_dir

from ..background import BackgroundLoop
from ..metrics import MetricsSink, NullSink
from .apply import ReloadTarget, SnapshotBuffers, apply_in_place
from .contract import ReloadError, version_number
from .lockstep import LockstepGroup, SingleRank
from .reporters import Reporter, ReportQueue
from .source import DesiredVersionSource
from .staging import StagedDrafter, dir_signature, stage_drafter

logger = logging.getLogger(__name__)


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
        config_resolved: dict | None = None,
    ):
        self.source = source
        # Config values the server resolved that a drafter may leave out (a string mask token's
        # id, the target's layer count): see DrafterConfig.from_dict.
        self.config_resolved = config_resolved
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
        # reports run off the decode thread, in order (an older status never lands after a newer)
        self._reports = ReportQueue() if report_async and self.reporters else None
        self._steps = 0
        self._snapshot_buffers: SnapshotBuffers | None = None
        self.loaded_manifest: dict[str, Any] | None = None  # the last version swapped in's manifest
        self._watcher = BackgroundLoop(self.poll_once, poll_interval_s, name="adaflash-reload")
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
        if (version, origin) != (self.status.desired_version, self.status.desired_from):
            # Reported even when nothing is to load: an override naming the loaded version
            # (or cleared back to it) must still reach the operator.
            self.status.desired_version, self.status.desired_from = version, origin
            self._report()
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
                config_resolved=self.config_resolved,
            )
        except ReloadError as e:
            self._rejected[version] = dir_signature(path)
            self._fail("rejected", version, str(e))
            return staged
        self._prepare_snapshot_buffers()
        with self._lock:
            self._staged = new
        self.status.staged_version = version
        logger.info(
            "drafter %s (%s) verified and staged; swapping at the next step", version, origin
        )
        return new

    def _prepare_snapshot_buffers(self) -> None:
        """The swap's rollback copy needs host memory the size of the drafter; allocate it here,
        on the watcher thread, once (live shapes never change), not on the decode thread."""
        live = self.target.live_tensors()
        if self._snapshot_buffers is None or not self._snapshot_buffers.fits(live):
            self._snapshot_buffers = SnapshotBuffers(live)

    def start(self) -> None:
        """Run :meth:`poll_once` every ``poll_interval_s`` on a watcher thread."""
        self._watcher.interval_s = self.poll_interval_s
        self._watcher.start()

    def stop(self) -> None:
        self._watcher.stop(timeout=10)
        if self._reports is not None:
            self._reports.close(timeout=10)

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
            snapshot = apply_in_place(self.target, staged.state, self._snapshot_buffers)
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
        self.loaded_manifest = staged.manifest  # its eval seeds the engine's calibration (planner.prior)
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

        if self._reports is not None:
            self._reports.put(run)
        elif self.reporters:
            run()

    def flush_reports(self, timeout: float | None = None) -> bool:
        """Wait until every status reported so far reached the reporters; False on timeout."""
        return self._reports.flush(timeout) if self._reports is not None else True
