"""The control loop's Job phases: the bootstrap Job that puts the first drafter on the volume,
and the distillation rounds that publish candidates (a Job, or a JobSet over several nodes).

Called by handlers._tick once per tick, after reconciliation; each reads its progress from the
AdaFlashService's status, starts or reads one Job, and returns the conditions to write. Progress
lives in status, so a restarted operator resumes where the last saved tick left off.
"""

from __future__ import annotations

import datetime as dt
import logging
from typing import Any

import kopf

from . import children, distill, job_manifests, kube, metrics, rollout
from . import contract as c
from . import spec as spec_mod
from .clock import now as _now
from .clock import ts as _ts
from .conditions import replace_patch, set_condition
from .rollout_phase import set_drafter_phase


async def bootstrap(owner: dict, body: kopf.Body, s: spec_mod.ServiceSpec, st: dict,
                     patch: kopf.Patch, conds: list) -> list:
    """spec.drafter.bootstrap: one Job at a time until the first drafter is on the volume (the
    Job reports Imported, Trained, or Present when it was there already); a failed Job is
    retried after the distillation backoff. The serving pods wait for the version meanwhile."""
    if s.bootstrap is None:
        return conds
    b = dict(st.get("bootstrap") or {})
    if b.get("phase") == "Succeeded":
        return conds
    ns = owner["metadata"]["namespace"]
    gen = body["metadata"].get("generation")
    now = _now()
    attempts = int(b.get("attempts") or 0)
    new: dict[str, Any] = {}
    if b.get("phase") == "Running" and b.get("job"):
        job = await kube.get("Job", ns, b["job"])
        outcome, detail = ("failed", "the Job was deleted before it finished") if job is None \
            else distill.job_outcome(job)
        if outcome == "running":
            return set_condition(conds, "Progressing", True, "Bootstrapping",
                                 f"Job {b['job']} is making the first drafter "
                                 f"{s.initial_version} ({s.bootstrap.source})", _ts(now), gen)
        pods = await kube.list_("Pod", ns, {c.LABEL_DISTILL_JOB: b["job"]})
        if outcome == "succeeded":
            msgs = [m for m in (distill.termination_message(p, c.BOOTSTRAP_CONTAINER)
                                for p in pods) if m]
            try:
                rep = distill.parse_bootstrap_report(msgs[-1] if msgs else None)
            except distill.ReportError as e:
                outcome, detail = "failed", str(e)
            else:
                msg = f"Job {b['job']}: {rep['outcome']} {rep['version']}"
                kopf.event(body, type="Normal", reason="BootstrapSucceeded", message=msg)
                new = {"phase": "Succeeded", "outcome": rep["outcome"],
                       "version": rep["version"], "message": msg, "retryAfter": None}
                conds = set_condition(conds, "BootstrapFailed", False, "Succeeded", msg,
                                      _ts(now), gen)
        if outcome == "failed":
            pod_detail = "; ".join(x for x in (distill.failure_detail(p, c.BOOTSTRAP_CONTAINER)
                                               for p in pods) if x)
            delay = distill.backoff_seconds(attempts, s.distillation.backoff_seconds,
                                            s.distillation.max_backoff_seconds)
            retry = now + dt.timedelta(seconds=delay)
            why = f"{detail} ({pod_detail})" if pod_detail else detail
            msg = f"Job {b['job']} failed: {why}; retrying after {_ts(retry)}"[:1000]
            kopf.warn(body, reason="BootstrapFailed", message=msg)
            new = {"phase": "Failed", "message": msg, "retryAfter": _ts(retry)}
            conds = set_condition(conds, "BootstrapFailed", True, "JobFailed", msg, _ts(now),
                                  gen)
    elif not (b.get("phase") == "Failed" and
              (rollout.parse_ts(b.get("retryAfter")) or now) > now):
        attempts += 1
        jb = job_manifests.bootstrap_job(owner, s, attempts, patch.claim_modes)
        try:
            await kube.create(jb)
        except kube.ApiError as e:
            if e.status != 409:
                raise
        msg = (f"started Job {jb['metadata']['name']}: {s.bootstrap.source} the first drafter "
               f"{s.initial_version}")
        kopf.event(body, type="Normal", reason="BootstrapStarted", message=msg)
        new = {"phase": "Running", "job": jb["metadata"]["name"], "attempts": attempts,
               "message": msg}
        conds = set_condition(conds, "Progressing", True, "Bootstrapping", msg, _ts(now), gen)
    if new:
        patch.status["bootstrap"] = {**b, **new}
    return conds


def _counts(infos: list[rollout.PodInfo]) -> dict[str, int]:
    return {p.name: p.records for p in infos}


async def distillation(owner: dict, body: kopf.Body, s: spec_mod.ServiceSpec, fleet: str,
                        infos: list, st: dict, patch: kopf.Patch, conds: list,
                        logger: logging.Logger) -> list:
    ns, name = owner["metadata"]["namespace"], owner["metadata"]["name"]
    gen = body["metadata"].get("generation")
    now = _now()
    d = dict(st.get("distillation") or {})
    new: dict[str, Any] = {}
    active = d.get("activeJob")
    counts = _counts(infos)
    failures = int(d.get("consecutiveFailures") or 0)
    if active:
        job = await kube.get(d.get("activeJobKind") or "Job", ns, active)
        outcome, detail = ("failed", "the Job was deleted before it finished") if job is None \
            else distill.job_outcome(job)
        pods = await kube.list_("Pod", ns, {c.LABEL_DISTILL_JOB: active})
        if outcome == "running":
            phase, why = distill.job_pod_phase(pods, c.DISTILL_CONTAINER)
            if d.get("activeJobPhase") != phase:
                patch.status["distillation"] = {"activeJobPhase": phase}
            if phase == "Pending":
                return set_condition(conds, "Progressing", True, "DistillationPending",
                                     f"Job {active} is pending: {why}", _ts(now), gen)
            return set_condition(conds, "Progressing", True, "Distilling",
                                 f"Job {active} is running", _ts(now), gen)
        report_err = ""
        if outcome == "succeeded":
            try:
                report = await _job_report(ns, pods)
            except distill.ReportError as e:
                outcome, report_err = "failed", str(e)
        if outcome == "succeeded" and report.get("outcome") == distill.OUTCOME_NOT_ENOUGH:
            # Too little new traffic for a round: nothing was published or consumed. Not a
            # failure (no backoff); the next round starts when minNewRecords more arrive.
            recs = report["records"]
            msg = (f"Job {active} found {recs['usable']} new usable records, fewer than the "
                   f"{recs['required']} a round needs; nothing published, waiting for traffic")
            kopf.event(body, type="Normal", reason="NotEnoughRecords", message=msg)
            metrics.DISTILL_JOBS.labels("idle").inc()
            new.update(activeJob=None, activeJobPhase=None, activeJobKind=None,
                       consecutiveFailures=0, retryAfter=None, lastError=None,
                       lastOutcome=distill.OUTCOME_NOT_ENOUGH, lastOutcomeMessage=msg)
            conds = set_condition(conds, "DistillationFailed", False, "NotEnoughRecords", msg,
                                  _ts(now), gen)
        elif outcome == "succeeded":
            try:
                dv = job_manifests.drafter_version(owner, report, active)
                try:
                    await kube.create(dv)
                except kube.ApiError as e:
                    if e.status in (400, 422):  # the schema refused what the report says
                        raise distill.ReportError(
                            f"the API server rejected DrafterVersion "
                            f"{dv['metadata']['name']} built from the report: {e.message}"
                        ) from e
                    if e.status != 409:
                        raise
                await set_drafter_phase(dv, "Candidate", "Published",
                                         f"published by Job {active}", {}, logger,
                                         only_if_new=True)
                msg = f"Job {active} published {report['version']}"
                kopf.event(body, type="Normal", reason="Published", message=msg)
                metrics.DISTILL_JOBS.labels("succeeded").inc()
                new.update(activeJob=None, activeJobPhase=None, activeJobKind=None,
                           consecutiveFailures=0, lastSuccessAt=_ts(now), retryAfter=None,
                           lastError=None, lastOutcome=distill.OUTCOME_PUBLISHED,
                           lastOutcomeMessage=msg)
                conds = set_condition(conds, "DistillationFailed", False, "Published", msg,
                                      _ts(now), gen)
            except distill.ReportError as e:
                outcome, report_err = "failed", str(e)
        if outcome == "failed":
            failures += 1
            why = report_err or detail
            pod_detail = "; ".join(x for x in (distill.failure_detail(p, c.DISTILL_CONTAINER)
                                               for p in pods) if x)
            if pod_detail and not report_err:
                why = f"{why} ({pod_detail})"
            delay = distill.backoff_seconds(failures, s.distillation.backoff_seconds,
                                            s.distillation.max_backoff_seconds)
            retry = now + dt.timedelta(seconds=delay)
            msg = (f"Job {active} failed ({failures} in a row): {why}; retrying after "
                   f"{_ts(retry)}")
            kopf.warn(body, reason="DistillationFailed", message=msg)
            metrics.DISTILL_JOBS.labels("failed").inc()
            new.update(activeJob=None, activeJobPhase=None, activeJobKind=None,
                       consecutiveFailures=failures, retryAfter=_ts(retry),
                       lastError=why[:1000], lastOutcome="Failed",
                       lastOutcomeMessage=msg[:1000])
            conds = set_condition(conds, "DistillationFailed", True, "JobFailed", msg,
                                  _ts(now), gen)
        metrics.DISTILL_FAILURES.labels(ns, name).set(failures if outcome == "failed" else 0)
    else:
        baseline = {k: int(v) for k, v in (d.get("recordsAtLastRound") or {}).items()}
        n_new = distill.new_records(counts, baseline)
        new["newRecords"] = n_new
        last = rollout.parse_ts(d.get("lastRoundAt")) or rollout.parse_ts(
            body["metadata"].get("creationTimestamp"))
        trig = distill.should_start(s.distillation, active_job=None, new=n_new,
                                    last_round_at=last, retrying=failures > 0,
                                    retry_after=rollout.parse_ts(d.get("retryAfter")), now=now)
        booting = s.bootstrap is not None and \
            ((patch.status.get("bootstrap") or st.get("bootstrap") or {}).get("phase")
             != "Succeeded")
        if s.distillation.enabled and booting:
            trig = distill.Trigger(False, "Bootstrapping")
            new.update(idleReason="Bootstrapping", message=(
                "no round before spec.drafter.bootstrap has put the first drafter on the volume"))
        elif s.distillation.enabled and not s.log_traffic:
            # The pods write no traffic: a round would learn from nothing, or from what an
            # earlier setting left on the volume, which is not what the switch says.
            trig = distill.Trigger(False, "TrafficLoggingOff")
            new.update(idleReason="TrafficLoggingOff", message=(
                "spec.serving.logTraffic is false: the serving pods log no traffic, so "
                "distillation has nothing to learn from and starts no rounds"))
        else:
            new.update(idleReason=None, message=None)
        if trig.start:
            retry = failures > 0
            round_ = int(d.get("round") or 0) + (0 if retry else 1)
            round_ = max(round_, 1)
            jobset = s.distillation.nodes > 1 and await kube.has_api(job_manifests.JOBSET_API)
            jb = job_manifests.job(owner, s, round_, failures + 1, fleet, patch.claim_modes,
                               jobset=jobset)
            jname, kind = jb["metadata"]["name"], jb["kind"]
            foreign = None
            try:
                created = await kube.create(jb)
            except kube.ApiError as e:
                if e.status != 409:
                    raise
                # Ours from a pass whose status was lost, or someone else's: look.
                created = await kube.get(kind, ns, jname)
                ctl = children.controller(created or {})
                if created is not None and (ctl or {}).get("uid") != owner["metadata"]["uid"]:
                    foreign = (f"{kind} {jname} already exists and is not controlled by this "
                               f"AdaFlashService")
            if not foreign and kind == "Job" and s.distillation.nodes > 1 and created:
                await _ensure_rendezvous_service(created)
            if foreign:
                failures += 1
                delay = distill.backoff_seconds(failures, s.distillation.backoff_seconds,
                                                s.distillation.max_backoff_seconds)
                retry_at = now + dt.timedelta(seconds=delay)
                msg = f"{foreign}; retrying as attempt {failures + 1} after {_ts(retry_at)}"
                kopf.warn(body, reason="DistillationFailed", message=msg)
                new.update(consecutiveFailures=failures, retryAfter=_ts(retry_at),
                           lastError=foreign, round=round_)
                conds = set_condition(conds, "DistillationFailed", True, "JobConflict", msg,
                                      _ts(now), gen)
            else:
                msg = (f"started {kind} {jname} ({trig.reason}: {n_new} new records, parent "
                       f"{fleet})")
                kopf.event(body, type="Normal", reason="DistillationStarted", message=msg)
                metrics.DISTILL_JOBS.labels("started").inc()
                new.update(activeJob=jname, activeJobPhase="Pending", round=round_,
                           lastRoundAt=_ts(now), activeJobKind=kind)
                if not retry:
                    new["recordsAtLastRound"] = replace_patch(d.get("recordsAtLastRound"),
                                                              counts)
                    new["newRecords"] = 0
    if new:
        patch.status["distillation"] = {**patch.status.get("distillation", {}), **new}
    active_now = new.get("activeJob", active) if "activeJob" in new else active
    if active_now:
        conds = set_condition(conds, "Progressing", True, "DistillationPending",
                              f"Job {active_now} is pending: just created", _ts(now), gen)
    return conds


async def _ensure_rendezvous_service(job: dict) -> None:
    """The headless Service a multi-node Job's pods find each other by (owned by the Job)."""
    try:
        await kube.create(job_manifests.rendezvous_service(job))
    except kube.ApiError as e:
        if e.status != 409:
            raise


async def _job_report(ns: str, pods: list[dict]) -> dict:
    """The report of a succeeded Job: its termination message, or, when that does not parse
    (a report cut at 4096 bytes), the last JSON line of its log."""
    msgs = [m for m in (distill.termination_message(p, c.DISTILL_CONTAINER) for p in pods)
            if m]
    try:
        return distill.parse_report(msgs[-1] if msgs else None)
    except distill.ReportError as first:
        for p in reversed(pods):
            try:
                text = await kube.pod_log(ns, p["metadata"]["name"], c.DISTILL_CONTAINER)
            except kube.ApiError:
                continue
            line = distill.report_from_log(text)
            if line:
                return distill.parse_report(line)
        raise first
