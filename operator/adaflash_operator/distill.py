"""Distillation trigger, retry backoff, Job outcome and Job report parsing. Pure functions.

Traffic trigger: every serving pod reports `adaflash.io/traffic-records`, the count of records it
logged since it started. At the start of a round the operator stores each pod's count in
`status.distillation.recordsAtLastRound`; new records are the sum over pods of what each logged
since (a pod whose count went down restarted, so all its count is new).

Job report: the Job's container writes one JSON object to /dev/termination-log, which Kubernetes
copies into the terminated container state's `message` (4096 bytes at most)::

    {"version": "v000002", "parent": "v000001", "created": "2026-...Z",
     "target": {"name": "Qwen/Qwen3-8B", "sha256": "..."},
     "training": {"algorithm": "opd-rkl", "records": 512, "steps": 64, "finalLoss": 0.41},
     "eval": {"tau": {"chat": 5.1, "code": 6.0}, "parentTau": {"chat": 4.8, "code": 5.9},
              "gate": {"passed": true, "reason": "Passed", "gain": 0.04, "gainLow": 0.02, ...}}}

Only `version` is required. ``eval.gate`` is the Job's own decision (paired bootstrap over the
held-out prompts, per-domain floor); the rollout gate honours it (rollout.gate). The same fields are in drafters/<version>/manifest.json. A Job that
found too few new records writes ``{"outcome": "NotEnoughRecords", "records": {"usable": 40,
"required": 128}, "message": "..."}`` instead, and exits 0 (the operator passes
``--idle-exit-code 0``).
"""

from __future__ import annotations

import datetime as dt
import json
import re
from dataclasses import dataclass

from .spec import Distillation

VERSION_RE = re.compile(r"^v[0-9]{6}$")
# Kubernetes keeps at most this much of a termination message (the kubelet keeps the end).
MAX_MESSAGE_BYTES = 4096
# A report's `outcome`: a published version (the default when absent), or no round for lack of
# new traffic (the Job completes; not a failure, no backoff).
OUTCOME_PUBLISHED = "Published"
OUTCOME_NOT_ENOUGH = "NotEnoughRecords"


class ReportError(ValueError):
    """The Job succeeded but its report is missing or malformed."""


def new_records(counts: dict[str, int], baseline: dict[str, int]) -> int:
    total = 0
    for pod, count in counts.items():
        before = baseline.get(pod, 0)
        total += count - before if count >= before else count
    return total


@dataclass(frozen=True)
class Trigger:
    start: bool
    reason: str  # Records | Interval | Retry | Running | Backoff | Waiting | Disabled


def should_start(d: Distillation, *, active_job: str | None, new: int,
                 last_round_at: dt.datetime | None, retry_after: dt.datetime | None,
                 now: dt.datetime, retrying: bool = False) -> Trigger:
    """Whether to start a distillation Job now (at most one runs at a time).

    `retrying`: the last Job failed; its round is tried again once the backoff has passed,
    whatever the traffic since.
    """
    if not d.enabled:
        return Trigger(False, "Disabled")
    if active_job:
        return Trigger(False, "Running")
    if retry_after is not None and now < retry_after:
        return Trigger(False, "Backoff")
    if retrying:
        return Trigger(True, "Retry")
    if new >= d.min_new_records:
        return Trigger(True, "Records")
    if d.interval_seconds and last_round_at is not None and \
            (now - last_round_at).total_seconds() >= d.interval_seconds:
        return Trigger(True, "Interval")
    return Trigger(False, "Waiting")


def backoff_seconds(failures: int, base: int, cap: int) -> int:
    """Delay before the next try after `failures` consecutive failures (>= 1): doubles, capped."""
    return int(min(cap, base * 2 ** max(0, failures - 1)))


def job_outcome(job: dict) -> tuple[str, str]:
    """("running" | "succeeded" | "failed", detail) from a batch/v1 Job's status (or a
    JobSet's: conditions Completed and Failed)."""
    status = job.get("status") or {}
    for cond in status.get("conditions") or []:
        if cond.get("status") != "True":
            continue
        if cond.get("type") in ("Complete", "SuccessCriteriaMet", "Completed"):  # JobSet
            return "succeeded", ""
        if cond.get("type") in ("Failed", "FailureTarget"):
            return "failed", f"{cond.get('reason', 'Failed')}: {cond.get('message', '')}".strip()
    if status.get("succeeded"):
        return "succeeded", ""
    if status.get("failed"):
        return "failed", "BackoffLimitExceeded: the distillation pod failed"
    return "running", ""


def termination_message(pod: dict, container: str) -> str | None:
    for cs in (pod.get("status") or {}).get("containerStatuses") or []:
        if cs.get("name") == container:
            term = (cs.get("state") or {}).get("terminated")
            if term is not None:
                return term.get("message") or ""
    return None


def job_pod_phase(pods: list[dict], container: str) -> tuple[str, str]:
    """("Pending" | "Running", detail) of a running Job from its pods: a Job whose pod waits
    for a node, an image or a volume is Pending, and the detail says what it waits for."""
    live = [p for p in pods if not (p.get("metadata") or {}).get("deletionTimestamp")]
    if any((p.get("status") or {}).get("phase") == "Running" for p in live):
        return "Running", ""
    if not live:
        return "Pending", "its pod is not created yet"
    st = live[-1].get("status") or {}
    for cond in st.get("conditions") or []:
        if cond.get("type") == "PodScheduled" and cond.get("status") == "False":
            return "Pending", (f"not scheduled ({cond.get('reason', 'Unschedulable')}): "
                               f"{cond.get('message', '')}").strip()
    for cs in st.get("containerStatuses") or []:
        if cs.get("name") == container:
            waiting = (cs.get("state") or {}).get("waiting")
            if waiting:
                return "Pending", (f"container waiting ({waiting.get('reason', '')}): "
                                   f"{waiting.get('message', '')}").strip()
    if not (live[-1].get("spec") or {}).get("nodeName"):
        return "Pending", "waiting for a node"
    return "Pending", "starting"


def report_from_log(text: str | None) -> str | None:
    """The report as the Job's last stdout line (a JSON object), for a report the termination
    message could not hold whole."""
    for line in reversed((text or "").splitlines()):
        line = line.strip()
        if line.startswith("{") and line.endswith("}"):
            return line
    return None


def failure_detail(pod: dict, container: str) -> str:
    """The failed container's exit code and last words, for the condition message."""
    for cs in (pod.get("status") or {}).get("containerStatuses") or []:
        if cs.get("name") == container:
            term = (cs.get("state") or {}).get("terminated") or {}
            if term:
                msg = (term.get("message") or "").strip().splitlines()
                tail = f": {msg[-1][:300]}" if msg else ""
                return f"exit code {term.get('exitCode')} ({term.get('reason', '')}){tail}"
    return ""


def parse_report(message: str | None) -> dict:
    """Parse and check the Job's report; raise ReportError saying what the Job must write."""
    if not message:
        raise ReportError("the distillation Job succeeded but wrote no report to "
                          "/dev/termination-log; the job must write one JSON object with at "
                          "least {\"version\": \"vNNNNNN\"}")
    try:
        report = json.loads(message)
    except json.JSONDecodeError as e:
        if len(message.encode()) >= MAX_MESSAGE_BYTES:
            raise ReportError(f"the distillation Job's report fills the {MAX_MESSAGE_BYTES}-byte "
                              f"termination message and was cut (Kubernetes keeps its last "
                              f"{MAX_MESSAGE_BYTES} bytes), and its log has no whole report "
                              f"either; the job must keep the report under "
                              f"{MAX_MESSAGE_BYTES} bytes") from e
        raise ReportError(f"the distillation Job's report is not JSON ({e}); it must be one "
                          f"JSON object, got {message[:120]!r}") from e
    if not isinstance(report, dict):
        raise ReportError(f"the distillation Job's report must be a JSON object, got "
                          f"{type(report).__name__}")
    outcome = report.get("outcome", OUTCOME_PUBLISHED)
    if outcome not in (OUTCOME_PUBLISHED, OUTCOME_NOT_ENOUGH):
        raise ReportError(f"the report's outcome must be {OUTCOME_PUBLISHED!r} or "
                          f"{OUTCOME_NOT_ENOUGH!r}, got {outcome!r}")
    if outcome == OUTCOME_NOT_ENOUGH:
        recs = report.get("records") or {}
        if not isinstance(recs, dict) or not all(
                isinstance(recs.get(k), int) and recs[k] >= 0 for k in ("usable", "required")):
            raise ReportError(f"a NotEnoughRecords report's records must hold usable and "
                              f"required counts >= 0, got {recs!r}")
        return report
    version = report.get("version")
    if not isinstance(version, str) or not VERSION_RE.match(version):
        raise ReportError(f"the report's version must look like v000002, got {version!r}")
    parent = report.get("parent") or ""
    if parent and not VERSION_RE.match(str(parent)):
        raise ReportError(f"the report's parent must look like v000001, got {parent!r}")
    ev = report.get("eval") or {}
    gate = ev.get("gate")
    if gate is not None and not (isinstance(gate, dict) and isinstance(gate.get("passed"), bool)):
        raise ReportError(f"the report's eval.gate must be an object with a boolean passed, "
                          f"got {gate!r}")
    for key in ("tau", "parentTau"):
        taus = ev.get(key) or {}
        if not isinstance(taus, dict) or not all(
                isinstance(v, (int, float)) and v >= 0 for v in taus.values()):
            raise ReportError(f"the report's eval.{key} must map domain -> tau >= 0, got {taus!r}")
    return report


def mean_tau(taus: dict[str, float] | None, domains: set[str] | None = None) -> float | None:
    """Unweighted mean over domains (restricted to `domains` when given); None if empty."""
    if not taus:
        return None
    vals = [float(v) for k, v in taus.items() if domains is None or k in domains]
    return sum(vals) / len(vals) if vals else None


#: What a bootstrap Job reports (python -m training_job.bootstrap): the first version imported,
#: trained, or found on the volume already.
BOOTSTRAP_OUTCOMES = ("Imported", "Trained", "Present")


def parse_bootstrap_report(message: str | None) -> dict:
    """The bootstrap Job's report: ``{"outcome": "Imported", "version": "v000001", ...}``."""
    try:
        report = json.loads(message or "")
    except json.JSONDecodeError:
        raise ReportError(f"the bootstrap Job succeeded but its report is not JSON: "
                          f"{(message or '')[:120]!r}; it must write {{\"outcome\": ..., "
                          f"\"version\": ...}} to /dev/termination-log") from None
    if not isinstance(report, dict) or report.get("outcome") not in BOOTSTRAP_OUTCOMES or \
            not VERSION_RE.match(str(report.get("version", ""))):
        raise ReportError(f"the bootstrap Job's report must hold an outcome in "
                          f"{list(BOOTSTRAP_OUTCOMES)} and a version like v000001, got "
                          f"{report!r}"[:600])
    return report
