"""ADAFLASH serving metrics: a per-step stats record, kept apart from where the numbers go.

Vocabulary (the same words as the verifier's docstring):

- a *draft* is one request's block in one decode step; the drafter proposes ``B - 1`` tokens
  for it (the *draft tokens*);
- the *candidate length* ``L`` is how many block slots the target verifies for that request
  (slot 0, the last committed token, plus ``L - 1`` proposals), chosen by the length head and
  the batch budget; ``1 <= L <= B``;
- the *verified tokens* are the proposals the target actually checked, ``L - 1`` per draft;
- the *accepted tokens* are the leading proposals that matched the target (the bonus token is
  not counted); ``tau = accepted / drafts + 1`` counts the bonus.

Producers (the SGLang worker, the reference engine) fill one :class:`SpecStepStats` per step and
hand it to a sink. Sinks never compute anything the producer should have: they aggregate and
export. :class:`PrometheusSink` exports the metric names of docs/contracts.md;
:class:`LoggingSink` writes a periodic one-line summary.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

logger = logging.getLogger(__name__)

#: Label value used when a request carries no domain tag (Prometheus treats an empty label
#: value as an absent label, so ``sum without (domain)`` still works).
NO_DOMAIN = ""
#: Label value that all domains past the cardinality cap are folded into.
OTHER_DOMAIN = "other"

#: The fixed set of ``result`` label values of ``adaflash_drafter_reloads_total``.
RELOAD_RESULTS = ("success", "rejected", "failed", "rolled_back")


@dataclass
class SpecStepStats:
    """What one speculative decode step did, per request of the batch.

    All per-request lists have the batch's length ``bs`` and the same order.
    """

    block_size: int  # B: slots per block; a draft proposes B - 1 tokens
    candidate_lengths: list[int]  # [bs] L_i, block slots verified (slot 0 included), 1..B
    accept_lengths: list[int]  # [bs] accepted proposals, 0..L_i - 1 (bonus not counted)
    domains: list[str | None] | None = None  # [bs] domain tag of each request, or None for all

    def __post_init__(self) -> None:
        bs = len(self.candidate_lengths)
        if len(self.accept_lengths) != bs:
            raise ValueError(
                f"SpecStepStats: expected one accept length per request ({bs}), "
                f"found {len(self.accept_lengths)}; pass lists of the batch's length"
            )
        if self.domains is not None and len(self.domains) != bs:
            raise ValueError(
                f"SpecStepStats: expected one domain per request ({bs}) or domains=None, "
                f"found {len(self.domains)}"
            )
        for i, (cand, acc) in enumerate(zip(self.candidate_lengths, self.accept_lengths)):
            if not 1 <= cand <= self.block_size:
                raise ValueError(
                    f"SpecStepStats: candidate length of request {i} is {cand}, expected "
                    f"1..{self.block_size} (the block size)"
                )
            if not 0 <= acc <= cand - 1:
                raise ValueError(
                    f"SpecStepStats: request {i} accepted {acc} proposals but only {cand - 1} "
                    "were verified; accept lengths must not count the bonus token"
                )

    @classmethod
    def trusted(
        cls,
        block_size: int,
        candidate_lengths: list[int],
        accept_lengths: list[int],
        domains: list[str | None] | None = None,
    ) -> SpecStepStats:
        """A record whose producer already guarantees the bounds (the SGLang worker clamps
        them), built without the per-request checks: this runs once per decode step on the
        scheduler thread."""
        stats = object.__new__(cls)
        stats.block_size = block_size
        stats.candidate_lengths = candidate_lengths
        stats.accept_lengths = accept_lengths
        stats.domains = domains
        return stats

    @classmethod
    def merged(cls, steps: Sequence[SpecStepStats]) -> SpecStepStats:
        """Several steps of one block size as one record (drafts concatenated)."""
        lens: list[int] = []
        acc: list[int] = []
        domains: list[str | None] = []
        for s in steps:
            lens += s.candidate_lengths
            acc += s.accept_lengths
            domains += s.domains if s.domains is not None else [None] * s.num_drafts
        return cls.trusted(
            steps[0].block_size, lens, acc, domains if any(domains) else None
        )

    @property
    def num_drafts(self) -> int:
        return len(self.candidate_lengths)

    @property
    def num_draft_tokens(self) -> int:
        return self.num_drafts * (self.block_size - 1)

    @property
    def num_verified_tokens(self) -> int:
        return sum(cand - 1 for cand in self.candidate_lengths)

    @property
    def num_accepted_tokens(self) -> int:
        return sum(self.accept_lengths)

    def domain_of(self, i: int) -> str | None:
        return None if self.domains is None else self.domains[i]


class MetricsSink(Protocol):
    """Where stats go. Every method must be cheap and must never raise into the decode loop."""

    def observe_step(self, stats: SpecStepStats) -> None: ...

    def set_drafter_version(self, version: str) -> None: ...

    def count_reload(self, result: str) -> None: ...

    def count_traffic_records(self, n: int = 1, domain: str | None = None) -> None: ...


class NullSink:
    """A sink that drops everything (metrics disabled)."""

    def observe_step(self, stats: SpecStepStats) -> None:
        pass

    def set_drafter_version(self, version: str) -> None:
        pass

    def count_reload(self, result: str) -> None:
        pass

    def count_traffic_records(self, n: int = 1, domain: str | None = None) -> None:
        pass


class DomainLabeler:
    """Maps request domain tags to label values with a cap on distinct values.

    Domains come from requests, so an unbounded set would blow up the series count; the first
    ``max_domains`` distinct tags keep their name and the rest are reported as ``other``.
    """

    def __init__(self, max_domains: int = 32) -> None:
        self.max_domains = max_domains
        self._seen: set[str] = set()
        self._lock = threading.Lock()

    def __call__(self, domain: str | None) -> str:
        if not domain:
            return NO_DOMAIN
        if domain in self._seen:
            return domain
        with self._lock:
            if domain in self._seen:
                return domain
            if len(self._seen) >= self.max_domains:
                return OTHER_DOMAIN
            self._seen.add(domain)
            return domain


def candidate_length_buckets(max_block_size: int = 16) -> tuple[float, ...]:
    """Histogram bucket bounds: one per possible candidate length 1..max_block_size."""
    return tuple(float(n) for n in range(1, max_block_size + 1))


class PrometheusSink:
    """Exports :class:`SpecStepStats` as the ADAFLASH metrics of docs/contracts.md.

    Series (``domain`` is ``""`` for requests without a tag):

    - ``adaflash_spec_drafts_total{domain}``: drafts (request-steps);
    - ``adaflash_spec_draft_tokens_total{domain}``: proposals drafted, ``B - 1`` per draft;
    - ``adaflash_spec_verified_tokens_total{domain}``: proposals the target verified;
    - ``adaflash_spec_accepted_tokens_total{domain}``: proposals accepted (bonus excluded);
    - ``adaflash_spec_accepted_by_position_total{position,domain}``: drafts whose proposal at
      position ``k`` (1-based) was accepted, i.e. the survival curve;
    - ``adaflash_candidate_length{domain}``: histogram of candidate lengths ``L``;
    - ``adaflash_drafter_info{version}``: 1 for the drafter version being served, 0 for versions
      served before by this process;
    - ``adaflash_drafter_reloads_total{result}``: hot reloads, result in
      ``success|rejected|failed|rolled_back``;
    - ``adaflash_traffic_records_total{domain}``: traffic records written.

    Derived figures (PromQL)::

        # mean acceptance length tau (bonus token included)
        sum(rate(adaflash_spec_accepted_tokens_total[5m]))
          / sum(rate(adaflash_spec_drafts_total[5m])) + 1
        # acceptance rate of the proposals the target verified
        sum(rate(adaflash_spec_accepted_tokens_total[5m]))
          / sum(rate(adaflash_spec_verified_tokens_total[5m]))
        # share of drafted proposals the length head saved from verification
        1 - sum(rate(adaflash_spec_verified_tokens_total[5m]))
              / sum(rate(adaflash_spec_draft_tokens_total[5m]))
        # acceptance probability at position k
        sum by (position) (rate(adaflash_spec_accepted_by_position_total[5m]))
          / scalar(sum(rate(adaflash_spec_drafts_total[5m])))
        # version each pod serves
        adaflash_drafter_info == 1

    Multiprocess mode: when ``PROMETHEUS_MULTIPROC_DIR`` is set before ``prometheus_client`` is
    imported (SGLang sets it for ``--enable-metrics``), values go to per-process files that the
    HTTP server process aggregates; the info gauge then uses ``livemax``.
    """

    def __init__(self, registry=None, *, max_block_size: int = 16, max_domains: int = 32) -> None:
        try:
            import prometheus_client as prom
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise ImportError(
                "PrometheusSink needs prometheus-client; install it with "
                "`pip install 'sglang-adaflash[serve]'`"
            ) from exc
        if registry is None:
            registry = prom.REGISTRY
        self._domain = DomainLabeler(max_domains)
        self._max_position = max_block_size - 1
        self._lock = threading.Lock()
        self._version: str | None = None
        kw = {"registry": registry}
        self.drafts = prom.Counter(
            "adaflash_spec_drafts", "Drafts (one request in one decode step).", ["domain"], **kw
        )
        self.draft_tokens = prom.Counter(
            "adaflash_spec_draft_tokens", "Proposals drafted (B - 1 per draft).", ["domain"], **kw
        )
        self.verified_tokens = prom.Counter(
            "adaflash_spec_verified_tokens",
            "Proposals the target verified (candidate length - 1 per draft).",
            ["domain"],
            **kw,
        )
        self.accepted_tokens = prom.Counter(
            "adaflash_spec_accepted_tokens",
            "Proposals accepted by the target, bonus token excluded.",
            ["domain"],
            **kw,
        )
        self.accepted_by_position = prom.Counter(
            "adaflash_spec_accepted_by_position",
            "Drafts whose proposal at this 1-based position was accepted.",
            ["position", "domain"],
            **kw,
        )
        self.candidate_length = prom.Histogram(
            "adaflash_candidate_length",
            "Block slots verified per draft (slot 0 included), as chosen by the length head.",
            ["domain"],
            buckets=candidate_length_buckets(max_block_size),
            **kw,
        )
        self.drafter_info = prom.Gauge(
            "adaflash_drafter_info",
            "1 for the drafter version this process serves, 0 for versions it served before.",
            ["version"],
            multiprocess_mode="livemax",
            **kw,
        )
        self.reloads = prom.Counter(
            "adaflash_drafter_reloads",
            "Drafter hot reloads by result (success, rejected, failed, rolled_back).",
            ["result"],
            **kw,
        )
        self.traffic_records = prom.Counter(
            "adaflash_traffic_records", "Traffic records written.", ["domain"], **kw
        )

    def observe_step(self, stats: SpecStepStats) -> None:
        # Aggregate per domain first, so a batch costs one update per series and bucket, not
        # per request: counts of each candidate length, and of each accept length (the drafts
        # accepted at position k are those whose accept length is >= k, a suffix sum).
        per_domain: dict[str, tuple[list[int], list[int]]] = {}
        block = stats.block_size
        for i, (cand, acc) in enumerate(zip(stats.candidate_lengths, stats.accept_lengths)):
            label = self._domain(stats.domain_of(i)) if stats.domains is not None else NO_DOMAIN
            agg = per_domain.get(label)
            if agg is None:
                agg = per_domain[label] = ([0] * (block + 1), [0] * (block + 1))
            agg[0][cand] += 1
            agg[1][acc] += 1
        for label, (by_len, by_acc) in per_domain.items():
            drafts = sum(by_len)
            self.drafts.labels(label).inc(drafts)
            self.draft_tokens.labels(label).inc(drafts * (block - 1))
            self.verified_tokens.labels(label).inc(sum((n - 1) * c for n, c in enumerate(by_len) if c))
            self.accepted_tokens.labels(label).inc(sum(a * c for a, c in enumerate(by_acc) if c))
            _observe_counts(self.candidate_length.labels(label), by_len)
            reached = 0
            for pos in range(block, 0, -1):
                reached += by_acc[pos]
                if reached and pos <= self._max_position:
                    self.accepted_by_position.labels(str(pos), label).inc(reached)

    def set_drafter_version(self, version: str) -> None:
        with self._lock:
            if self._version is not None and self._version != version:
                self.drafter_info.labels(self._version).set(0)
            self.drafter_info.labels(version).set(1)
            self._version = version

    def count_reload(self, result: str) -> None:
        if result not in RELOAD_RESULTS:
            raise ValueError(f"reload result {result!r} is not one of {RELOAD_RESULTS}")
        self.reloads.labels(result).inc()

    def count_traffic_records(self, n: int = 1, domain: str | None = None) -> None:
        self.traffic_records.labels(self._domain(domain)).inc(n)


def _observe_counts(histogram, counts: Sequence[int]) -> None:
    """``counts[v]`` observations of each integer value ``v`` in one update per bucket.

    prometheus_client has no bulk observe; this writes the same per-bucket counts and sum that
    ``observe`` would, through the child's own value objects (also in multiprocess mode).
    Falls back to ``observe`` if the client's internals differ."""
    buckets = getattr(histogram, "_buckets", None)
    bounds = getattr(histogram, "_upper_bounds", None)
    total = getattr(histogram, "_sum", None)
    if buckets is None or bounds is None or total is None:  # another client version
        for v, c in enumerate(counts):
            for _ in range(c):
                histogram.observe(v)
        return
    per_bucket = [0] * len(bounds)
    for v, c in enumerate(counts):
        if c:
            per_bucket[next(i for i, b in enumerate(bounds) if v <= b)] += c
    for i, c in enumerate(per_bucket):
        if c:
            buckets[i].inc(c)
    total.inc(sum(v * c for v, c in enumerate(counts)))


class BackgroundSink:
    """Takes step records on the caller's thread in O(1) and forwards them, merged, from a
    daemon thread every ``interval_s`` seconds: the SGLang scheduler thread (which also
    launches the next step) never pays the per-request work of the sinks. Version and reload
    events go through at once (they are rare and others read them right away)."""

    def __init__(self, sink: MetricsSink, interval_s: float = 1.0, max_pending: int = 100_000):
        from .background import BackgroundLoop

        self.sink = sink
        self._pending: deque[SpecStepStats] = deque(maxlen=max_pending)
        self._loop = BackgroundLoop(self.flush, interval_s, name="adaflash-metrics")
        self._loop.start()

    def observe_step(self, stats: SpecStepStats) -> None:
        self._pending.append(stats)  # deque.append is atomic: no lock on the hot path

    def flush(self) -> None:
        by_block: dict[int, list[SpecStepStats]] = {}
        while self._pending:
            s = self._pending.popleft()
            by_block.setdefault(s.block_size, []).append(s)
        for steps in by_block.values():
            self.sink.observe_step(SpecStepStats.merged(steps))

    def stop(self) -> None:
        self._loop.stop()
        self.flush()

    def set_drafter_version(self, version: str) -> None:
        self.sink.set_drafter_version(version)

    def count_reload(self, result: str) -> None:
        self.sink.count_reload(result)

    def count_traffic_records(self, n: int = 1, domain: str | None = None) -> None:
        self.sink.count_traffic_records(n, domain)


@dataclass
class _Totals:
    drafts: int = 0
    draft_tokens: int = 0
    verified_tokens: int = 0
    accepted_tokens: int = 0
    accepted_by_position: list[int] = field(default_factory=list)


class LoggingSink:
    """Logs a one-line acceptance summary at most every ``interval_s`` seconds."""

    def __init__(self, interval_s: float = 30.0, log: logging.Logger | None = None, clock=None):
        self.interval_s = interval_s
        self._log = log or logger
        self._clock = clock or time.monotonic
        self._since = self._clock()
        self._totals = _Totals()
        self._version: str | None = None

    def observe_step(self, stats: SpecStepStats) -> None:
        t = self._totals
        t.drafts += stats.num_drafts
        t.draft_tokens += stats.num_draft_tokens
        t.verified_tokens += stats.num_verified_tokens
        t.accepted_tokens += stats.num_accepted_tokens
        if len(t.accepted_by_position) < stats.block_size - 1:
            t.accepted_by_position.extend(
                [0] * (stats.block_size - 1 - len(t.accepted_by_position))
            )
        by_acc = [0] * stats.block_size
        for acc in stats.accept_lengths:
            by_acc[min(acc, stats.block_size - 1)] += 1
        reached = 0
        for pos in range(stats.block_size - 1, 0, -1):
            reached += by_acc[pos]
            t.accepted_by_position[pos - 1] += reached
        now = self._clock()
        if now - self._since >= self.interval_s:
            self._log.info("%s", self.summary())
            self._totals = _Totals()
            self._since = now

    def summary(self) -> str:
        t = self._totals
        if t.drafts == 0:
            return "adaflash: no drafts"
        tau = t.accepted_tokens / t.drafts + 1
        rate = t.accepted_tokens / t.verified_tokens if t.verified_tokens else 0.0
        saved = 1 - t.verified_tokens / t.draft_tokens if t.draft_tokens else 0.0
        return (
            f"adaflash: drafter={self._version} drafts={t.drafts} tau={tau:.2f} "
            f"accept_rate={rate:.3f} verify_saved={saved:.1%}"
        )

    def set_drafter_version(self, version: str) -> None:
        self._version = version
        self._log.info("adaflash: serving drafter version %s", version)

    def count_reload(self, result: str) -> None:
        self._log.info("adaflash: drafter reload %s", result)

    def count_traffic_records(self, n: int = 1, domain: str | None = None) -> None:
        pass


class FanoutSink:
    """Sends everything to several sinks; a sink that raises is logged and skipped."""

    def __init__(self, sinks: Sequence[MetricsSink]) -> None:
        self.sinks = list(sinks)

    def _each(self, method: str, *args, **kwargs) -> None:
        for sink in self.sinks:
            try:
                getattr(sink, method)(*args, **kwargs)
            except Exception:  # a broken sink must not stop decoding
                logger.exception("adaflash metrics sink %r failed in %s", sink, method)

    def observe_step(self, stats: SpecStepStats) -> None:
        self._each("observe_step", stats)

    def set_drafter_version(self, version: str) -> None:
        self._each("set_drafter_version", version)

    def count_reload(self, result: str) -> None:
        self._each("count_reload", result)

    def count_traffic_records(self, n: int = 1, domain: str | None = None) -> None:
        self._each("count_traffic_records", n, domain)


class AcceptanceWindow:
    """Live mean acceptance length (tau, bonus token included) for the pod annotation.

    A sink: it sums drafts and accepted proposals from the step stats the worker already records,
    and :meth:`take` turns them into tau over the steps since the previous take, once at least
    ``min_drafts`` drafts have been seen (fewer: the window grows until they have). Between takes
    the last value holds, so an idle pod keeps reporting its last tau. A new drafter version
    starts afresh: until its own steps fill a window, :meth:`take` returns None, so nobody reads
    the old version's tau as the new one's.
    """

    def __init__(self, min_drafts: int = 32) -> None:
        self.min_drafts = max(1, min_drafts)
        self._lock = threading.Lock()
        self._drafts = 0
        self._accepted = 0
        self._tau: float | None = None
        self._version: str | None = None

    def observe_step(self, stats: SpecStepStats) -> None:
        with self._lock:
            self._drafts += stats.num_drafts
            self._accepted += stats.num_accepted_tokens

    def set_drafter_version(self, version: str) -> None:
        with self._lock:
            if version != self._version:
                self._version = version
                self._drafts = self._accepted = 0
                self._tau = None

    def count_reload(self, result: str) -> None:
        pass

    def count_traffic_records(self, n: int = 1, domain: str | None = None) -> None:
        pass

    def take(self) -> float | None:
        """Tau over the window that just closed, else the last one (None: none yet)."""
        with self._lock:
            if self._drafts >= self.min_drafts:
                self._tau = self._accepted / self._drafts + 1.0
                self._drafts = self._accepted = 0
            return self._tau
