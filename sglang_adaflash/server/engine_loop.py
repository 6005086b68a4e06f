"""The one thread that drives the engine for every HTTP request.

The engine batches continuously only if one caller owns it: so HTTP handlers never touch it.
They hand jobs to an inbox; this thread, between two steps, admits them (``submit``), drops
the ones whose client went away (``abort``), lets the hot reloader swap the drafter, runs one
step for the whole batch, and posts what happened (new tokens, finished requests) back to the
handlers in one batch per step, through ``post`` (the asyncio loop's ``call_soon_threadsafe``),
so the event loop wakes once per step, not once per request.

Admission is bounded: at most ``capacity`` requests (running plus waiting) are outstanding, and
``submit`` raises :class:`QueueFull` beyond that, which the server answers with 429. A full
queue must be told to the client at once; queueing without bound would only turn the overload
into timeouts.

Faults: a request the engine can blame for a failure (its prefill raised, see
:mod:`~sglang_adaflash.engine.admission`) comes back finished with ``fault=True``; it fails
alone, its slot is free again, and the loop goes on. A step that raises is a failure nobody can
be blamed for (a decode step half written, or an engine that cannot prefill even a probe): the
engine's state can no longer be trusted, every outstanding request fails with FAILED, the loop
stops, and ``on_fatal`` is called so that the server reports it (``/health``) and exits
non-zero for its supervisor to restart it.
"""

from __future__ import annotations

import logging
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..engine.request import Request, RequestOutput, RequestStats
from ..serving.metrics import MetricsSink, SpecStepStats

logger = logging.getLogger(__name__)

# Events a job receives, as tuples whose first item is the kind.
ACCEPTED = "accepted"  # (ACCEPTED,): the engine took the request
TOKENS = "tokens"  # (TOKENS, new_ids): tokens committed this step (only for wants_tokens jobs)
DONE = "done"  # (DONE, RequestOutput, drafter_version): finished, refused or aborted
FAILED = "failed"  # (FAILED, message): the loop stopped or broke; the request is lost


class QueueFull(Exception):
    """Every slot and every queue place is taken."""


class LoopClosed(Exception):
    """The loop is stopping or has failed; no new requests."""


@dataclass(eq=False)
class Job:
    """One request as the loop sees it. ``deliver`` runs where ``post`` runs (the event loop)."""

    request: Request
    deliver: Callable[[tuple], None]
    wants_tokens: bool = False
    no_log: bool = False
    # Set by the handler before it aborts a request that ended for its own reason (a stop
    # string: "stop"), so the traffic record says why it ended.
    finish_as: str | None = None
    # Loop-thread bookkeeping.
    sent: int = 0
    steps_seen: int = 0
    # Decode steps and tokens committed in them, by the drafter version that served each step
    # (a request that spans a hot reload is served by two); read by the handler after DONE.
    by_version: dict[str, list[int]] = field(default_factory=dict)

    @property
    def id(self) -> str:
        return self.request.request_id


class EngineLoop:
    def __init__(
        self,
        engine,
        *,
        capacity: int,
        post: Callable[[Callable[[], None]], None],
        reloader=None,
        sink: MetricsSink | None = None,
        on_finish: Callable[[Job, RequestOutput, str | None], None] | None = None,
        on_fatal: Callable[[str], None] | None = None,
        version: str | None = None,
        idle_wait_s: float = 0.2,
    ):
        self.engine = engine
        self.capacity = capacity
        self.post = post
        self.reloader = reloader
        self.sink = sink if getattr(engine, "block_size", 1) > 1 else None  # ar: nothing drafted
        self.on_finish = on_finish
        self.on_fatal = on_fatal  # called on the loop thread, once, after a failure stopped it
        self.version = reloader.status.loaded_version if reloader is not None else version
        self.idle_wait_s = idle_wait_s
        self.steps = 0
        self.swaps: list[tuple[str, float]] = []  # (version, seconds the swap held the loop)
        # Each swap with the loop's step count and the median of the steps just before it, so
        # a client can see a pause in units of steps (`/ready`). Bounded: a long-lived server
        # keeps the latest.
        self.swap_log: deque[dict[str, Any]] = deque(maxlen=64)
        self._step_s: deque[float] = deque(maxlen=64)
        self._last_step_end: float | None = None
        self._swap_pending: dict[str, Any] | None = None  # its gap to the next step is not known yet
        self.error: str | None = None
        self._cv = threading.Condition()
        self._inbox: list[tuple[str, Job]] = []
        self._jobs: dict[str, Job] = {}
        self._outstanding = 0
        self._stopping = False
        self._thread: threading.Thread | None = None

    # -- any thread ----------------------------------------------------------------------------

    def submit(self, job: Job) -> None:
        with self._cv:
            if self._stopping or self.error is not None:
                raise LoopClosed(self.error or "the server is shutting down")
            if self._outstanding >= self.capacity:
                raise QueueFull(f"{self._outstanding} requests are running or queued, the limit")
            self._outstanding += 1
            self._inbox.append(("submit", job))
            self._cv.notify()

    def abort(self, job: Job) -> None:
        """Drop the job at the next step boundary (nothing happens if it already finished)."""
        with self._cv:
            self._inbox.append(("abort", job))
            self._cv.notify()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="adaflash-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Stop after the current step; requests still outstanding fail with FAILED."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    def snapshot(self) -> dict[str, Any]:
        """Counts for /ready and the gauges (read without the loop's cooperation: approximate)."""
        return {
            "running": len(self.engine.running),
            "waiting": len(self.engine.waiting),
            "outstanding": self._outstanding,
            "capacity": self.capacity,
            "steps": self.steps,
            "drafter_version": self.version,
            "swaps": list(self.swap_log),
        }

    # -- the loop thread -----------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                with self._cv:
                    if not self._inbox and not self.engine.has_unfinished() and not self._stopping:
                        # Idle: wake now and then anyway, so a staged drafter is swapped in.
                        self._cv.wait(self.idle_wait_s)
                    if self._stopping:
                        break
                    inbox, self._inbox = self._inbox, []
                events: list[tuple[Job, tuple]] = []
                for kind, job in inbox:
                    if kind == "submit":
                        self._admit(job, events)
                    else:
                        out = self.engine.abort(job.id)
                        if out is not None and self._jobs.pop(job.id, None) is not None:
                            self._finish(job, out, events)
                self._flush(events)
                self._boundary()
                if self.engine.has_unfinished():
                    self._flush(self._step())
        except Exception as e:  # no request to blame, the engine's state is unknown: serve no more
            logger.exception("adaflash serve: the engine loop failed; no more requests are served")
            with self._cv:
                self.error = f"the engine failed: {type(e).__name__}: {e}"
        self._fail_all(self.error or "the server is shutting down")
        if self.error is not None and self.on_fatal is not None:
            try:
                self.on_fatal(self.error)
            except Exception:
                logger.exception("adaflash serve: reporting the engine loop's failure failed")

    def _admit(self, job: Job, events: list) -> None:
        refused = self.engine.submit(job.request)
        if refused is not None:
            self._finish(job, refused, events)
            return
        self._jobs[job.id] = job
        events.append((job, (ACCEPTED,)))

    def _boundary(self) -> None:
        if self.reloader is None:
            return
        t0 = time.perf_counter()
        swapped = self.reloader.at_step_boundary()
        if swapped is not None:
            forget = getattr(self.engine, "drafter_swapped", None)
            if forget is not None:  # the old version's acceptance history is not the new one's
                forget(getattr(self.reloader, "loaded_manifest", None))
            pause = time.perf_counter() - t0
            self.version = swapped
            self.swaps.append((swapped, pause))
            recent = statistics.median(self._step_s) if self._step_s else None
            entry = {"version": swapped, "at": time.time(), "pause_s": pause,
                     "after_step": self.steps, "median_step_s": recent,
                     "pause_steps": pause / recent if recent else None, "gap_s": None}
            self.swap_log.append(entry)
            self._swap_pending = entry
            logger.info("adaflash serve: drafter %s swapped in between steps (%.1f ms)",
                        swapped, pause * 1e3)

    def _step(self) -> list[tuple[Job, tuple]]:
        t0 = time.perf_counter()
        if self._swap_pending is not None and self._last_step_end is not None:
            # From the end of the last step before the swap to the start of the first after it:
            # what a running request waited for the reload (an idle loop's wait included).
            self._swap_pending["gap_s"] = t0 - self._last_step_end
        self._swap_pending = None
        finished = self.engine.step()
        self._last_step_end = time.perf_counter()
        self._step_s.append(self._last_step_end - t0)
        self.steps += 1
        events: list[tuple[Job, tuple]] = []
        observed: list[tuple[Job, RequestStats]] = []
        for seq in self.engine.running:
            job = self._jobs[seq.req.request_id]
            observed.append((job, seq.stats))
            if job.wants_tokens and len(seq.output) > job.sent:
                events.append((job, (TOKENS, seq.output[job.sent:])))
                job.sent = len(seq.output)
        done = []
        for out in finished:
            job = self._jobs.pop(out.request_id)
            observed.append((job, out.stats))
            done.append((job, out))
        self._observe(observed)
        for job, out in done:
            self._finish(job, out, events)
        return events

    def _observe(self, observed: list[tuple[Job, RequestStats]]) -> None:
        cands, accs, domains = [], [], []
        version = self.version or ""
        for job, stats in observed:
            n = len(stats.verify_lens)
            tally = job.by_version.setdefault(version, [0, 0])
            for k in range(job.steps_seen, n):
                cands.append(stats.verify_lens[k])
                accs.append(stats.accept_lens[k] - 1)
                domains.append(job.request.domain)
                tally[0] += 1
                tally[1] += stats.accept_lens[k]
            job.steps_seen = n
        if cands and self.sink is not None:
            try:
                self.sink.observe_step(SpecStepStats(self.engine.block_size, cands, accs, domains))
            except Exception:  # metrics must never stop decoding
                logger.exception("adaflash serve: recording step metrics failed")

    def _finish(self, job: Job, out: RequestOutput, events: list) -> None:
        with self._cv:
            self._outstanding -= 1
        events.append((job, (DONE, out, self.version)))
        if self.on_finish is not None:
            try:
                self.on_finish(job, out, self.version)
            except Exception:  # the record is lost, the request is not
                logger.exception("adaflash serve: on_finish failed for %s", job.id)

    def _flush(self, events: list[tuple[Job, tuple]]) -> None:
        if not events:
            return

        def deliver() -> None:
            for job, event in events:
                job.deliver(event)

        self.post(deliver)

    def _fail_all(self, message: str) -> None:
        with self._cv:
            self._stopping = True
            inbox, self._inbox = self._inbox, []
            jobs = list(self._jobs.values()) + [job for kind, job in inbox if kind == "submit"]
            self._jobs.clear()
            self._outstanding = 0
        try:
            self._flush([(job, (FAILED, message)) for job in jobs])
        except RuntimeError:  # the event loop is already closed: nobody is waiting
            pass
