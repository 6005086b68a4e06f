"""Prometheus metrics of the operator (served on --metrics-port, default 8080).

PromQL used by the chart's alerts. Every series is aggregated by (namespace, service): a
restarted operator pod, or another replica taking over the lease, exports the same gauges under
another `pod`/`instance` label, and the alerts must not start from nothing then. The gauges are
set from the AdaFlashService's status on every tick, so a new process has them within a tick.
    stuck rollout:   max by (namespace, service) (adaflash_operator_rollout_active) == 1 and
                     time() - max by (namespace, service)
                       (adaflash_operator_rollout_started_timestamp_seconds) > 3600
    acceptance drop: max by (namespace, service) (adaflash_operator_live_tau) < 0.8 *
                     max by (namespace, service) (max_over_time(adaflash_operator_live_tau[1d]))
    distillation:    max by (namespace, service)
                       (adaflash_operator_distill_consecutive_failures) >= 3
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, start_http_server

RECONCILES = Counter("adaflash_operator_reconciles_total",
                     "Reconciliations of AdaFlashService children", ["result"])
ROLLOUT_TRANSITIONS = Counter("adaflash_operator_rollout_transitions_total",
                              "Drafter rollout transitions by phase entered", ["phase"])
DISTILL_JOBS = Counter("adaflash_operator_distill_jobs_total",
                       "Distillation Jobs by outcome (started, succeeded, idle, failed)", ["result"])
SERVING_VERSION = Gauge("adaflash_operator_serving_version_info",
                        "Drafter version the fleet serves (value 1)",
                        ["namespace", "service", "version"])
LIVE_TAU = Gauge("adaflash_operator_live_tau", "Mean live acceptance length of the fleet",
                 ["namespace", "service"])
ROLLOUT_ACTIVE = Gauge("adaflash_operator_rollout_active", "1 while a rollout is in flight",
                       ["namespace", "service"])
ROLLOUT_STARTED = Gauge("adaflash_operator_rollout_started_timestamp_seconds",
                        "Start of the rollout in flight", ["namespace", "service"])
LEADER = Gauge("adaflash_operator_leader",
               "1 while this process holds the operator's lease (or runs without election)")
DISTILL_FAILURES = Gauge("adaflash_operator_distill_consecutive_failures",
                         "Failed distillation Jobs since the last success",
                         ["namespace", "service"])


_serving: set[int] = set()


def serve(port: int) -> None:
    """Serve /metrics on `port` (once per process, whoever asks first)."""
    if port not in _serving:
        start_http_server(port)
        _serving.add(port)


def set_serving(namespace: str, service: str, version: str) -> None:
    for labels in list(SERVING_VERSION._metrics):  # one series per service
        if labels[:2] == (namespace, service) and labels[2] != version:
            SERVING_VERSION.remove(*labels)
    SERVING_VERSION.labels(namespace, service, version).set(1)


def set_live_tau(namespace: str, service: str, tau: float | None) -> None:
    """The fleet's live tau; no series while no pod reports one (a stale value would hide an
    acceptance drop, or raise a false one)."""
    if tau is not None:
        LIVE_TAU.labels(namespace, service).set(tau)
        return
    try:
        LIVE_TAU.remove(namespace, service)
    except KeyError:
        pass


def forget_all() -> None:
    """Drop every per-service series (this process lost the lease: the new leader exports
    them)."""
    for gauge in (LIVE_TAU, ROLLOUT_ACTIVE, ROLLOUT_STARTED, DISTILL_FAILURES, SERVING_VERSION):
        gauge.clear()


def set_rollout(namespace: str, service: str, active: bool, started: float | None) -> None:
    """The rollout gauges; the start time exists only while a rollout is in flight."""
    ROLLOUT_ACTIVE.labels(namespace, service).set(1 if active else 0)
    if active and started is not None:
        ROLLOUT_STARTED.labels(namespace, service).set(started)
    else:
        try:
            ROLLOUT_STARTED.remove(namespace, service)
        except KeyError:
            pass


def forget(namespace: str, service: str) -> None:
    for gauge in (LIVE_TAU, ROLLOUT_ACTIVE, ROLLOUT_STARTED, DISTILL_FAILURES):
        try:
            gauge.remove(namespace, service)
        except KeyError:
            pass
    for labels in list(SERVING_VERSION._metrics):
        if labels[:2] == (namespace, service):
            SERVING_VERSION.remove(*labels)
