"""The control loop's rollout phase: one step of rollout.step's state machine, applied.

Called by handlers._tick once per tick, after the Job phases: it lists the service's
DrafterVersions, asks the pure state machine (rollout.py) for the next step, and applies it in
the order that survives a crash between writes: the fleet's ConfigMap first, then the pods'
annotations, then the DrafterVersions' phases; the caller saves status last.
"""

from __future__ import annotations

import logging

import kopf

from . import contract as c
from . import kube, manifests, metrics, rollout
from . import spec as spec_mod
from .clock import now as _now
from .clock import ts as _ts
from .conditions import replace_patch, set_condition


async def set_drafter_phase(dv: dict, phase: str, reason: str, message: str, fields: dict,
                             logger: logging.Logger, only_if_new: bool = False) -> None:
    """Record a phase transition on a DrafterVersion (idempotent), with an Event."""
    meta = dv["metadata"]
    live = await kube.get(c.DRAFTER_KIND, meta["namespace"], meta["name"])
    if live is None:
        return
    cur = live.get("status") or {}
    if (cur.get("phase") == phase and cur.get("reason") == reason) or \
            (only_if_new and cur.get("phase")):
        return
    history = list(cur.get("history") or [])[-19:]
    history.append({"phase": phase, "reason": reason, "time": _ts(_now())})
    body = {"status": {"phase": phase, "reason": reason, "message": message,
                       "history": history, **fields}}
    await kube.patch(c.DRAFTER_KIND, meta["namespace"], meta["name"], body, sub="status")
    metrics.ROLLOUT_TRANSITIONS.labels(phase).inc()
    try:
        kopf.event(live, type="Warning" if phase in ("Rejected", "RolledBack") else "Normal",
                   reason=phase, message=message)
    except Exception as e:  # events are best effort
        logger.debug(f"event for {meta['name']} not posted: {e}")


def _candidate(dv: dict) -> rollout.Candidate:
    sp = dv.get("spec") or {}
    ev = sp.get("eval") or {}
    return rollout.Candidate(version=sp["version"], parent=sp.get("parent") or "",
                             eval_tau=dict(ev.get("tau") or {}),
                             parent_tau=dict(ev.get("parentTau") or {}),
                             gate=dict(ev.get("gate") or {}))


async def rollout_step(owner: dict, body: kopf.Body, s: spec_mod.ServiceSpec, fleet_data: dict,
                   infos: list, st: dict, patch: kopf.Patch, conds: list,
                   logger: logging.Logger) -> list:
    ns, name = owner["metadata"]["namespace"], owner["metadata"]["name"]
    fleet = fleet_data[c.FLEET_VERSION_KEY]
    gen = body["metadata"].get("generation")
    now = _now()
    dvs = [x for x in await kube.list_(c.DRAFTER_KIND, ns, {c.LABEL_SERVICE: name})
           if (x.get("spec") or {}).get("service") == name]
    by_version = {x["spec"]["version"]: x for x in dvs}
    old_state = st.get("rollout") or {}
    in_flight = old_state.get("version") if old_state.get("phase") in rollout.ACTIVE else None
    # A version left in Canary without a rollout in status was interrupted (the operator died
    # between acting and saving status): it is a candidate again.
    candidates = [_candidate(x) for x in dvs
                  if (x.get("status") or {}).get("phase") in (None, "Candidate")
                  or ((x.get("status") or {}).get("phase") == "Canary"
                      and x["spec"]["version"] != in_flight)]
    serving_dv = by_version.get(fleet)
    serving_eval = ((serving_dv or {}).get("spec") or {}).get("eval", {}).get("tau")
    d = rollout.step(cfg=s.rollout, pinned=s.pinned_version, serving=fleet, state=old_state,
                     candidates=candidates, pods=infos, now=now, serving_eval=serving_eval)
    # One Serving version: repair a switch torn by a crash between the ConfigMap and the records.
    for version, dv in by_version.items():
        if version != d.serving and version not in d.phases and \
                (dv.get("status") or {}).get("phase") == "Serving":
            d.phases[version] = rollout.PhaseChange("Retired", "Replaced",
                                                    f"the fleet serves {d.serving}")
    # The versions the pods' admin call refuses without force, as they are after this step.
    phases = {v: (dv.get("status") or {}).get("phase") for v, dv in by_version.items()}
    phases.update({v: ch.phase for v, ch in d.phases.items() if v in by_version})
    blocked = manifests.blocked_versions(
        [{"spec": {"version": v}, "status": {"phase": ph}} for v, ph in phases.items()])
    # Apply: the fleet first, then the pods, then the records; status last (see rollout.py).
    if d.serving != fleet or manifests.blocked_text(blocked) != fleet_data.get(
            c.BLOCKED_VERSIONS_KEY):
        await kube.apply(manifests.configmap(owner, d.serving, blocked))
    if d.serving != fleet:
        patch.status["servingVersion"] = d.serving
        metrics.set_serving(ns, name, d.serving)
    for pod, version in sorted(d.annotate.items()):
        try:
            await kube.patch("Pod", ns, pod,
                             {"metadata": {"annotations": {c.DESIRED_VERSION: version}}})
        except kube.ApiError as e:
            if e.status != 404:
                raise
    for version, ch in d.phases.items():
        dv = by_version.get(version)
        if dv is not None:
            await set_drafter_phase(dv, ch.phase, ch.reason, ch.message, ch.fields, logger)
    for type_, reason, message in d.events:
        kopf.event(body, type=type_, reason=reason, message=message)
    if d.state != old_state:
        patch.status["rollout"] = replace_patch(old_state, d.state)
    phase = d.state.get("phase")
    active = phase in rollout.ACTIVE
    patch.status["candidateVersion"] = d.state.get("version") if active else None
    versions = sorted(set(by_version) | {d.serving})
    patch.status["latestVersion"] = versions[-1] if versions else None
    t = _ts(now)
    if active:
        conds = set_condition(conds, "Progressing", True, f"Rollout{phase}",
                              d.state.get("message", ""), t, gen)
    elif not st.get("distillation", {}).get("activeJob") and \
            not (patch.status.get("distillation") or {}).get("activeJob"):
        conds = set_condition(conds, "Progressing", False, "Idle",
                              f"serving {d.serving}; no rollout in flight", t, gen)
    if phase == "RolledBack" and d.state.get("reason") != "Pinned":
        conds = set_condition(conds, "Degraded", True, d.state.get("reason", phase),
                              f"last rollout: {d.state.get('message', '')}", t, gen)
    else:
        conds = set_condition(conds, "Degraded", False, "Healthy",
                              d.state.get("message") or "no failed rollout", t, gen)
    started = rollout.parse_ts(d.state.get("startedAt"))
    metrics.set_rollout(ns, name, active, started.timestamp() if started else None)
    return conds
