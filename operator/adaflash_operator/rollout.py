"""The drafter rollout state machine. Pure: `step()` maps what the operator sees to what it does.

One rollout moves a candidate DrafterVersion through::

    Candidate --gate--> Rejected (GateFailed / NoEvaluation)
        |
        +--> Canary: ceil(canaryFraction * ready pods) pods get the pod annotation
             adaflash.io/desired-drafter-version=<v> and load it
               |-- a pod reports a load error, or times out --> RolledBack
               |-- a canary pod goes away (eviction, drain, rolling update, scale-down): no
               |   verdict on <v>; another ready pod takes its place and the canary starts
               |   over (or, with none ready, <v> waits at the Gate as a candidate again)
               +--> Baking: every canary pod reports adaflash.io/loaded-drafter-version=<v>
                      |-- load error / live tau drop / no live tau --> RolledBack
                      |-- a canary pod goes away --> back to Canary, as above
                      +--> Promoted: the fleet ConfigMap names <v>; the annotations are removed
                           and the version is Serving, the previous one Retired.

`spec.drafter.pinnedVersion` overrides all of it: the fleet serves the pinned version, any rollout
in flight is rolled back, and no candidate is tried until the pin is removed.

`status.rollout` holds the whole state, so a restarted operator continues where it stopped; each
call makes at most one transition, and the handler applies the Decision's actions before it
persists the new state (actions are idempotent, so replaying one after a crash is harmless).
"""

from __future__ import annotations

import datetime as dt
import math
from dataclasses import dataclass, field

from . import contract as c
from .clock import ts as _ts
from .distill import mean_tau
from .spec import Rollout

ACTIVE = ("Gate", "Canary", "Baking")


@dataclass(frozen=True)
class PodInfo:
    name: str
    ready: bool
    desired: str | None = None  # canary annotation
    loaded: str | None = None
    tau: float | None = None
    error: str | None = None
    records: int = 0
    override: str | None = None  # an admin override's version: the operator does not steer it
    waiting_for_drafter: bool = False  # its init container waits for the drafter on the volume

    @classmethod
    def from_pod(cls, pod: dict) -> PodInfo:
        meta = pod.get("metadata") or {}
        ann = meta.get("annotations") or {}
        conds = (pod.get("status") or {}).get("conditions") or []
        ready = any(x.get("type") == "Ready" and x.get("status") == "True" for x in conds)
        return cls(
            name=meta["name"],
            ready=ready and not meta.get("deletionTimestamp"),
            desired=ann.get(c.DESIRED_VERSION) or None,
            loaded=ann.get(c.LOADED_VERSION) or None,
            tau=_float(ann.get(c.ACCEPTANCE_TAU)),
            error=ann.get(c.LOAD_ERROR) or None,
            records=_int(ann.get(c.TRAFFIC_RECORDS)),
            override=ann.get(c.OVERRIDE) or None,
            waiting_for_drafter=_waiting(pod),
        )


def _waiting(pod: dict) -> bool:
    """Whether the pod's init container is still waiting for the fleet's drafter."""
    for cs in (pod.get("status") or {}).get("initContainerStatuses") or []:
        if cs.get("name") == c.WAIT_DRAFTER_CONTAINER:
            return "running" in (cs.get("state") or {})
    return False


def _float(s: str | None) -> float | None:
    try:
        v = float(s) if s is not None else None
    except ValueError:
        return None
    return v if v is not None and math.isfinite(v) and v >= 0 else None


def _int(s: str | None) -> int:
    try:
        return max(0, int(s)) if s is not None else 0
    except ValueError:
        return 0


@dataclass(frozen=True)
class Candidate:
    version: str
    parent: str = ""
    eval_tau: dict[str, float] = field(default_factory=dict)
    parent_tau: dict[str, float] = field(default_factory=dict)
    gate: dict = field(default_factory=dict)  # the Job's decision (eval.gate of its report)


@dataclass(frozen=True)
class PhaseChange:
    """A DrafterVersion status update."""
    phase: str
    reason: str
    message: str
    fields: dict = field(default_factory=dict)


@dataclass
class Decision:
    state: dict  # the new status.rollout
    serving: str  # the fleet version (ConfigMap)
    annotate: dict[str, str | None] = field(default_factory=dict)  # pod -> desired (None: remove)
    phases: dict[str, PhaseChange] = field(default_factory=dict)  # version -> change
    events: list[tuple[str, str, str]] = field(default_factory=list)  # (type, reason, message)


def parse_ts(s: str | None) -> dt.datetime | None:
    if not s:
        return None
    return dt.datetime.strptime(s, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=dt.timezone.utc)


def _mean(vals: list[float | None]) -> float | None:
    xs = [v for v in vals if v is not None]
    return round(sum(xs) / len(xs), 4) if xs else None


def gate(cand: Candidate, serving: str, serving_eval: dict[str, float] | None,
         min_gain: float) -> tuple[bool, str, str, dict]:
    """Evaluation gate: (passed, reason, message, fields for the DrafterVersion status).

    The baseline is the parent's tau measured by the Job on the same held-out records when the
    candidate was distilled from the serving version; otherwise the serving version's own eval.
    In the first case the Job's own gate (noise estimate and per-domain floor, eval.gate) must
    have passed too; its decision is recorded in the DrafterVersion's status.
    """
    job_gate = cand.gate if cand.parent == serving and "passed" in cand.gate else None
    if job_gate is not None and not job_gate["passed"]:
        return False, "GateFailed", (f"{cand.version}: the Job's gate failed "
                                     f"({job_gate.get('reason', '?')}): "
                                     f"{job_gate.get('message', '')}").strip(), {"gate": job_gate}
    if cand.parent == serving and cand.parent_tau:
        domains = set(cand.eval_tau) & set(cand.parent_tau) or None
        base, where = mean_tau(cand.parent_tau, domains), f"parent {serving}, same records"
    elif serving_eval:
        domains = set(cand.eval_tau) & set(serving_eval) or None
        base, where = mean_tau(serving_eval, domains), f"serving {serving}, its own eval"
    else:
        domains, base, where = None, None, ""
    tau = mean_tau(cand.eval_tau, domains)
    if tau is None:
        return False, "NoEvaluation", (f"{cand.version} has no held-out eval tau; the Job must "
                                       f"report eval.tau by domain"), {}
    fields = {"evalTau": round(tau, 4), **({"gate": job_gate} if job_gate else {})}
    if base is None:
        return True, "GatePassed", (f"{cand.version} eval tau {tau:.3f}; no baseline for "
                                    f"{serving or 'the fleet'}, gate passes on its own"), fields
    fields["baselineTau"] = round(base, 4)
    need = base * (1.0 + min_gain)
    if tau >= need:
        return True, "GatePassed", (f"{cand.version} eval tau {tau:.3f} >= {need:.3f} "
                                    f"({where}: {base:.3f}, minTauGain {min_gain})"), fields
    return False, "GateFailed", (f"{cand.version} eval tau {tau:.3f} < required {need:.3f} "
                                 f"({where}: {base:.3f}, minTauGain {min_gain})"), fields


def _clear_stray(pods: list[PodInfo], keep: set[str], d: Decision) -> None:
    for p in pods:
        if p.desired is not None and p.name not in keep:
            d.annotate[p.name] = None


def _roll_back(d: Decision, state: dict, pods: list[PodInfo], reason: str, msg: str,
               extra: dict | None = None) -> Decision:
    v = state["version"]
    for name in state.get("canaryPods") or []:
        if any(p.name == name for p in pods):
            d.annotate[name] = None
    d.state = {**state, "phase": "RolledBack", "reason": reason, "message": msg}
    d.phases[v] = PhaseChange("RolledBack", reason, msg, extra or {})
    d.events.append(("Warning", "RolledBack", msg))
    return d


def _switch_fleet(d: Decision, old: str, new: str, reason: str, msg: str,
                  fields: dict | None = None) -> None:
    d.serving = new
    d.phases[new] = PhaseChange("Serving", reason, msg, fields or {})
    if old and old != new:
        d.phases.setdefault(old, PhaseChange("Retired", "Replaced", f"replaced by {new}"))


def step(*, cfg: Rollout, pinned: str, serving: str, state: dict | None,
         candidates: list[Candidate], pods: list[PodInfo], now: dt.datetime,
         serving_eval: dict[str, float] | None = None) -> Decision:
    state = dict(state or {})
    d = Decision(state=state, serving=serving)
    phase = state.get("phase")

    if pinned:
        if phase in ACTIVE and state.get("version") != pinned:
            _roll_back(d, state, pods, "Pinned",
                       f"spec.drafter.pinnedVersion={pinned} stops the rollout of "
                       f"{state['version']}")
        _clear_stray(pods, set(), d)
        msg = f"fleet pinned to {pinned} (was {serving or 'unset'})"
        _switch_fleet(d, serving, pinned, "Pinned", msg)  # idempotent: repairs a torn switch
        if pinned != serving:
            d.events.append(("Normal", "Pinned", msg))
        if phase in ACTIVE and state.get("version") == pinned:
            for name in state.get("canaryPods") or []:
                d.annotate[name] = None
            d.state = {**state, "phase": "Promoted", "reason": "Pinned",
                       "message": f"{pinned} promoted by pinning"}
        return d

    if phase in ("Canary", "Baking"):
        return _watch_canary(cfg, d, state, pods, now, serving)

    # No rollout in flight (or waiting for pods at the gate): pick the newest candidate.
    newest = max((x for x in candidates if x.version > serving), key=lambda x: x.version,
                 default=None)
    for x in candidates:
        if newest is None or x.version != newest.version:
            why = "Superseded" if newest else "Outdated"
            d.phases[x.version] = PhaseChange("Retired", why, (
                f"{newest.version} is newer" if newest else f"fleet already serves {serving}"))
    if newest is None:
        _clear_stray(pods, set(), d)
        if phase == "Gate":  # the candidate it waited with is gone
            d.state = {}
        return d
    v = newest.version
    ok, reason, msg, fields = gate(newest, serving, serving_eval, cfg.min_tau_gain)
    if not ok:
        d.state = {"version": v, "phase": "Rejected", "reason": reason, "message": msg}
        d.phases[v] = PhaseChange("Rejected", reason, msg, fields)
        d.events.append(("Warning", "Rejected", msg))
        _clear_stray(pods, set(), d)
        return d
    if phase != "Gate" or state.get("version") != v:
        d.events.append(("Normal", "GatePassed", msg))
    state = {"version": v, "phase": "Gate", "reason": reason, "message": msg}
    d.state = state
    # A pod on an admin override would not load the candidate (the override outranks the
    # canary annotation), and the version would be rolled back for it: never a canary.
    ready = sorted(p.name for p in pods if p.ready and not p.override)
    if not ready:
        d.state = {**state, "reason": "NoReadyPods",
                   "message": f"{v} passed the gate; waiting for a ready serving pod without "
                              f"an admin override"}
        return d
    n = max(1, math.ceil(cfg.canary_fraction * len(ready)))
    canary = ready[:n]
    _clear_stray(pods, set(canary), d)
    for name in canary:
        d.annotate[name] = v
    baseline = _mean([p.tau for p in pods if p.ready])
    msg = f"{v} canary on {len(canary)}/{len(ready)} ready pods: {', '.join(canary)}"
    fields = {**fields, "canaryPods": canary}
    d.state = {"version": v, "phase": "Canary", "canaryPods": canary, "startedAt": _ts(now),
               "reason": "CanaryStarted", "message": msg}
    if baseline is not None:
        d.state["baselineTau"] = baseline
    d.phases[v] = PhaseChange("Canary", "CanaryStarted", msg, fields)
    d.events.append(("Normal", "CanaryStarted", msg))
    return d


def _replace_lost(d: Decision, state: dict, pods: list[PodInfo], lost: list[str],
                  now: dt.datetime) -> Decision:
    """Canary pods went away (evicted, drained, replaced by a rolling update, scaled down):
    that says nothing about the version, so it is no rollback. Other ready pods take their
    places and the canary starts over (load timeout and bake included); with no ready pod
    to take over, the version goes back to the Gate as a candidate and waits for one."""
    v = state["version"]
    kept = [n for n in state.get("canaryPods") or [] if n not in lost]
    spare = sorted(p.name for p in pods if p.ready and not p.override and p.name not in kept)
    new = kept + spare[:len(lost)]
    replaced = int(state.get("replacedPods") or 0) + len(lost)
    msg = (f"canary pod(s) {', '.join(lost)} of {v} went away (evicted, drained or replaced); "
           f"no verdict on {v}")
    if not new:
        msg += ": waiting for a ready pod to canary on"
        d.state = {"version": v, "phase": "Gate", "reason": "CanaryPodLost", "message": msg,
                   "replacedPods": replaced}
        d.phases[v] = PhaseChange("Candidate", "CanaryPodLost", msg)
        d.events.append(("Normal", "CanaryPodLost", msg))
        return d
    msg += f": the canary starts over on {', '.join(new)}"
    desired = {p.name: p.desired for p in pods}
    for name in new:
        if desired.get(name) != v:
            d.annotate[name] = v
    d.state = {k: x for k, x in state.items() if k != "loadedAt"}
    d.state.update(phase="Canary", canaryPods=new, startedAt=_ts(now), replacedPods=replaced,
                   reason="CanaryPodReplaced", message=msg)
    d.phases[v] = PhaseChange("Canary", "CanaryPodReplaced", msg, {"canaryPods": new})
    d.events.append(("Normal", "CanaryPodReplaced", msg))
    return d


def _watch_canary(cfg: Rollout, d: Decision, state: dict, pods: list[PodInfo],
                  now: dt.datetime, serving: str) -> Decision:
    v = state["version"]
    canary = list(state.get("canaryPods") or [])
    by_name = {p.name: p for p in pods}
    lost = [n for n in canary if n not in by_name]
    if lost:
        return _replace_lost(d, state, pods, lost, now)
    for name in canary:
        p = by_name[name]
        if p.error and (p.error.startswith(v) or p.loaded != v):
            return _roll_back(d, state, pods, "LoadFailed",
                              f"pod {name} failed to load {v}: {p.error}")
    # Keep the canary annotations in place (a pod may have lost them, e.g. patched by a user).
    for name in canary:
        if by_name[name].desired != v:
            d.annotate[name] = v
    if state["phase"] == "Canary":
        if all(by_name[n].loaded == v for n in canary):
            msg = f"{v} loaded on {len(canary)} canary pods; baking {cfg.bake_seconds}s"
            d.state = {**state, "phase": "Baking", "loadedAt": _ts(now), "reason": "Loaded",
                       "message": msg}
            d.events.append(("Normal", "Baking", msg))
            return d
        started = parse_ts(state.get("startedAt")) or now
        if (now - started).total_seconds() > cfg.load_timeout_seconds:
            late = [n for n in canary if by_name[n].loaded != v]
            return _roll_back(d, state, pods, "LoadTimeout",
                              f"{', '.join(late)} did not report loading {v} within "
                              f"{cfg.load_timeout_seconds}s")
        return d

    # Baking.
    for name in canary:
        if by_name[name].loaded != v:
            return _roll_back(d, state, pods, "LoadFailed",
                              f"pod {name} stopped serving {v} (reports "
                              f"{by_name[name].loaded or 'nothing'})")
    loaded_at = parse_ts(state.get("loadedAt")) or now
    if (now - loaded_at).total_seconds() < cfg.bake_seconds:
        return d
    canary_tau = _mean([by_name[n].tau for n in canary])
    fleet_tau = _mean([p.tau for p in pods if p.ready and p.name not in canary])
    where = "other pods"
    if fleet_tau is None:
        fleet_tau, where = state.get("baselineTau"), "fleet at canary start"
    if canary_tau is None:
        return _roll_back(d, state, pods, "NoLiveAcceptance",
                          f"canary pods of {v} reported no {c.ACCEPTANCE_TAU} during the bake")
    live = {"liveTau": canary_tau}
    if fleet_tau is not None and canary_tau < fleet_tau * (1.0 - cfg.max_live_tau_drop):
        return _roll_back(d, state, pods, "LiveTauDrop",
                          f"{v} live tau {canary_tau:.3f} < {fleet_tau:.3f} ({where}) * "
                          f"(1 - {cfg.max_live_tau_drop})", live)
    if not cfg.auto_promote:
        d.state = {**state, "reason": "AwaitingPromotion",
                   "message": f"{v} baked well (live tau {canary_tau:.3f}); set "
                              f"spec.drafter.pinnedVersion={v} to promote it"}
        return d
    base = f"{fleet_tau:.3f} ({where})" if fleet_tau is not None else "no fleet baseline"
    msg = f"{v} promoted: canary live tau {canary_tau:.3f} vs {base}"
    _switch_fleet(d, serving, v, "Promoted", msg, live)
    for name in canary:
        d.annotate[name] = None
    d.state = {**state, "phase": "Promoted", "reason": "Promoted", "message": msg}
    d.events.append(("Normal", "Promoted", msg))
    return d
