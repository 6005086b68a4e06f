"""The rollout state machine, table by table (pure: no cluster)."""

from __future__ import annotations

import datetime as dt

import pytest
from adaflash_operator import contract as c
from adaflash_operator.rollout import Candidate, PodInfo, gate, step
from adaflash_operator.spec import Rollout

T0 = dt.datetime(2026, 11, 30, 9, 0, tzinfo=dt.timezone.utc)
CFG = Rollout(min_tau_gain=0.0, canary_fraction=0.25, bake_seconds=60, load_timeout_seconds=30,
              max_live_tau_drop=0.05, auto_promote=True)


def pods(n: int = 4, loaded: str = "v000001", tau: float | None = 4.0, **over) -> list[PodInfo]:
    out = [PodInfo(name=f"p{i}", ready=True, loaded=loaded, tau=tau) for i in range(n)]
    return [PodInfo(**{**p.__dict__, **over.get(p.name, {})}) for p in out]


GOOD = Candidate("v000002", "v000001", {"chat": 5.0}, {"chat": 4.5})


def run(state=None, cands=(GOOD,), ps=None, now=T0, cfg=CFG, pinned="", serving="v000001"):
    return step(cfg=cfg, pinned=pinned, serving=serving, state=state, candidates=list(cands),
                pods=pods() if ps is None else ps, now=now)


def test_gate_compares_with_the_parent_on_the_same_records() -> None:
    ok, reason, msg, fields = gate(GOOD, "v000001", None, 0.0)
    assert ok and reason == "GatePassed" and fields == {"evalTau": 5.0, "baselineTau": 4.5}
    ok, reason, msg, _ = gate(GOOD, "v000001", None, 0.2)  # needs 5.4
    assert not ok and reason == "GateFailed" and "5.400" in msg


def test_gate_honours_the_jobs_decision_and_records_it() -> None:
    """The mean beats the parent, but the Job's gate (noise, per-domain floor) failed: the
    version is Rejected and its status carries the Job's numbers."""
    job = {"passed": False, "reason": "DomainDrop", "gain": 0.11, "gainLow": 0.02,
           "message": "a domain dropped beyond its noise (95%): code -0.070 (noise 0.030)"}
    cand = Candidate("v000002", "v000001", {"chat": 5.0}, {"chat": 4.5}, gate=job)
    ok, reason, msg, fields = gate(cand, "v000001", None, 0.0)
    assert not ok and reason == "GateFailed" and "DomainDrop" in msg and "code -0.070" in msg
    assert fields == {"gate": job}
    d = run(cands=[cand])
    assert d.state["phase"] == "Rejected" and d.phases["v000002"].fields == {"gate": job}
    passed = {**job, "passed": True, "reason": "Passed"}
    ok, _, _, fields = gate(Candidate("v000002", "v000001", {"chat": 5.0}, {"chat": 4.5},
                                      gate=passed), "v000001", None, 0.0)
    assert ok and fields["gate"] == passed and fields["evalTau"] == 5.0
    # a decision on another parent's records says nothing about the serving version
    ok, _, _, fields = gate(cand, "v000009", {"chat": 4.0}, 0.0)
    assert ok and "gate" not in fields


def test_gate_uses_the_serving_versions_eval_when_the_parent_is_not_serving() -> None:
    cand = Candidate("v000003", "v000001", {"chat": 5.0, "code": 6.0}, {"chat": 4.0})
    ok, _, msg, fields = gate(cand, "v000002", {"chat": 5.5}, 0.0)  # only shared domains count
    assert not ok and fields["evalTau"] == 5.0 and fields["baselineTau"] == 5.5
    assert "serving v000002" in msg


@pytest.mark.parametrize("cand,reason", [
    (Candidate("v000002", "v000001", {}, {"chat": 4.5}), "NoEvaluation"),
    (Candidate("v000002", "v000001", {"chat": 4.0}, {"chat": 4.5}), "GateFailed"),
])
def test_gate_rejections(cand: Candidate, reason: str) -> None:
    d = run(cands=[cand])
    assert d.state["phase"] == "Rejected" and d.state["reason"] == reason
    assert d.phases["v000002"].phase == "Rejected" and d.annotate == {}
    assert d.serving == "v000001"


def test_candidate_goes_canary_on_a_fraction_of_ready_pods() -> None:
    ps = pods(5, p4={"ready": False})
    d = run(ps=ps)  # ceil(0.25 * 4 ready) = 1
    assert d.state["phase"] == "Canary" and d.state["canaryPods"] == ["p0"]
    assert d.annotate == {"p0": "v000002"} and d.phases["v000002"].phase == "Canary"
    assert d.state["baselineTau"] == 4.0 and d.state["startedAt"] == "2026-11-30T09:00:00Z"
    d = run(cfg=Rollout(**{**CFG.__dict__, "canary_fraction": 0.5}), ps=ps)
    assert d.state["canaryPods"] == ["p0", "p1"]


def test_no_ready_pods_waits_at_the_gate() -> None:
    d = run(ps=pods(2, p0={"ready": False}, p1={"ready": False}))
    assert d.state["phase"] == "Gate" and d.state["reason"] == "NoReadyPods" and not d.annotate
    d2 = run(state=d.state, ps=pods(2))
    assert d2.state["phase"] == "Canary"
    assert not any(e[1] == "GatePassed" for e in d2.events)  # announced once


def test_gate_wait_ends_when_the_candidate_goes() -> None:
    d = run(state={"version": "v000002", "phase": "Gate"}, cands=[])
    assert d.state == {}


def test_newest_candidate_wins_and_older_ones_retire() -> None:
    older = Candidate("v000002", "v000001", {"chat": 5.0}, {"chat": 4.5})
    newer = Candidate("v000003", "v000001", {"chat": 5.1}, {"chat": 4.5})
    d = run(cands=[older, newer])
    assert d.state["version"] == "v000003"
    assert d.phases["v000002"].phase == "Retired" and d.phases["v000002"].reason == "Superseded"


def canary_state(**over) -> dict:
    st = {"version": "v000002", "phase": "Canary", "canaryPods": ["p0"],
          "startedAt": "2026-11-30T09:00:00Z", "baselineTau": 4.0}
    st.update(over)
    return st


def test_canary_waits_for_the_load_then_bakes() -> None:
    d = run(state=canary_state(), now=T0 + dt.timedelta(seconds=5))
    assert d.state["phase"] == "Canary" and d.annotate == {"p0": "v000002"}  # re-asserted
    ps = pods(p0={"loaded": "v000002", "desired": "v000002"})
    d = run(state=canary_state(), ps=ps, now=T0 + dt.timedelta(seconds=5))
    assert d.state["phase"] == "Baking" and d.state["loadedAt"] == "2026-11-30T09:00:05Z"
    assert d.annotate == {}


@pytest.mark.parametrize("over,reason", [
    ({"p0": {"error": "v000002: hidden size 2048 does not match 4096"}}, "LoadFailed"),
    ({"p0": {"error": "manifest hash mismatch", "loaded": "v000001"}}, "LoadFailed"),
])
def test_load_error_rolls_back(over: dict, reason: str) -> None:
    d = run(state=canary_state(), ps=pods(**over))
    assert d.state["phase"] == "RolledBack" and d.state["reason"] == reason
    assert d.annotate == {"p0": None} and d.phases["v000002"].phase == "RolledBack"
    assert d.serving == "v000001"


def test_stale_error_of_another_version_is_ignored_once_loaded() -> None:
    ps = pods(p0={"loaded": "v000002", "error": "v000009: old failure"})
    assert run(state=canary_state(), ps=ps).state["phase"] == "Baking"


def test_load_timeout_rolls_back() -> None:
    d = run(state=canary_state(), now=T0 + dt.timedelta(seconds=31))
    assert d.state["reason"] == "LoadTimeout" and "p0" in d.state["message"]
    assert d.phases["v000002"].phase == "RolledBack"


def baking(**over) -> dict:
    return canary_state(phase="Baking", loadedAt="2026-11-30T09:00:10Z", **over)


AFTER_BAKE = T0 + dt.timedelta(seconds=71)


@pytest.mark.parametrize("state", [canary_state(), baking()])
def test_a_lost_canary_pod_is_replaced_not_rolled_back(state: dict) -> None:
    """Eviction, a drain or a rolling update took the canary pod: no verdict on the version.
    Another ready pod takes over and the canary starts over, clocks included."""
    later = T0 + dt.timedelta(seconds=50)
    ps = [p for p in pods() if p.name != "p0"]  # p0 is gone
    d = run(state=state, ps=ps, now=later)
    assert d.state["phase"] == "Canary" and d.state["reason"] == "CanaryPodReplaced"
    assert d.state["canaryPods"] == ["p1"] and d.annotate == {"p1": "v000002"}
    assert d.state["startedAt"] == "2026-11-30T09:00:50Z" and "loadedAt" not in d.state
    assert d.state["replacedPods"] == 1
    assert d.phases["v000002"].phase == "Canary" and d.serving == "v000001"
    assert all(ch.phase != "RolledBack" for ch in d.phases.values())
    # The replacement loads the version: the bake starts then, with no timeout from before.
    ps = [PodInfo(**{**p.__dict__, "loaded": "v000002", "desired": "v000002"})
          if p.name == "p1" else p for p in ps]
    d = run(state=d.state, ps=ps, now=later + dt.timedelta(seconds=20))
    assert d.state["phase"] == "Baking"


def test_a_lost_canary_with_no_pod_to_take_over_waits_at_the_gate() -> None:
    d = run(state=canary_state(), ps=[PodInfo(name="p9", ready=False)])
    assert d.state["phase"] == "Gate" and d.state["reason"] == "CanaryPodLost"
    assert d.phases["v000002"].phase == "Candidate" and d.annotate == {}
    # A pod becomes ready: the version is canaried again (still a candidate, same gate).
    d = run(state=d.state, ps=pods(2), now=T0 + dt.timedelta(seconds=5))
    assert d.state["phase"] == "Canary" and d.annotate == {"p0": "v000002"}
    assert not any(e[1] == "GatePassed" for e in d.events)


def test_bake_time_is_respected() -> None:
    ps = pods(p0={"loaded": "v000002", "tau": 9.0})
    d = run(state=baking(), ps=ps, now=T0 + dt.timedelta(seconds=69))
    assert d.state["phase"] == "Baking" and d.serving == "v000001"


def test_good_bake_promotes_through_the_fleet_version() -> None:
    ps = pods(p0={"loaded": "v000002", "tau": 3.9, "desired": "v000002"})  # -2.5% < 5% drop
    d = run(state=baking(), ps=ps, now=AFTER_BAKE)
    assert d.state["phase"] == "Promoted" and d.serving == "v000002"
    assert d.annotate == {"p0": None}
    assert d.phases["v000002"].phase == "Serving" and d.phases["v000002"].fields == {
        "liveTau": 3.9}
    assert d.phases["v000001"].phase == "Retired"


def test_live_tau_drop_rolls_back() -> None:
    ps = pods(p0={"loaded": "v000002", "tau": 3.7})  # -7.5%
    d = run(state=baking(), ps=ps, now=AFTER_BAKE)
    assert d.state["reason"] == "LiveTauDrop" and d.serving == "v000001"
    assert d.phases["v000002"].fields == {"liveTau": 3.7}


def test_baseline_from_canary_start_when_no_other_pod_reports() -> None:
    ps = [PodInfo("p0", True, "v000002", "v000002", 3.0)]
    d = run(state=baking(baselineTau=4.0), ps=ps, now=AFTER_BAKE)
    assert d.state["reason"] == "LiveTauDrop" and "fleet at canary start" in d.state["message"]


def test_no_live_acceptance_rolls_back() -> None:
    ps = pods(p0={"loaded": "v000002", "tau": None})
    assert run(state=baking(), ps=ps, now=AFTER_BAKE).state["reason"] == "NoLiveAcceptance"


def test_manual_promotion_waits() -> None:
    cfg = Rollout(**{**CFG.__dict__, "auto_promote": False})
    ps = pods(p0={"loaded": "v000002", "tau": 4.2})
    d = run(state=baking(), ps=ps, now=AFTER_BAKE, cfg=cfg)
    assert d.state["phase"] == "Baking" and d.state["reason"] == "AwaitingPromotion"
    assert d.serving == "v000001"


def test_pin_stops_a_rollout_and_sets_the_fleet() -> None:
    ps = pods(p0={"desired": "v000002"})
    d = run(state=canary_state(), ps=ps, pinned="v000001")
    assert d.state["phase"] == "RolledBack" and d.state["reason"] == "Pinned"
    assert d.annotate == {"p0": None} and d.serving == "v000001"
    d = run(state=None, pinned="v000001", serving="v000003")  # roll back by spec
    assert d.serving == "v000001" and d.phases["v000003"].phase == "Retired"
    assert d.phases["v000001"].phase == "Serving"
    assert run(state=None, pinned="v000001").state == {}  # no candidate tried while pinned


def test_stray_canary_annotations_are_cleared_when_idle() -> None:
    d = run(state={"version": "v000002", "phase": "Promoted"}, cands=[],
            ps=pods(p2={"desired": "v000002"}), serving="v000002")
    assert d.annotate == {"p2": None}


def test_pod_info_reads_the_annotation_contract() -> None:
    pod = {"metadata": {"name": "p", "annotations": {
        c.LOADED_VERSION: "v000002", c.ACCEPTANCE_TAU: "5.25", c.TRAFFIC_RECORDS: "17",
        c.DESIRED_VERSION: "v000003", c.LOAD_ERROR: "v000003: boom"}},
        "status": {"conditions": [{"type": "Ready", "status": "True"}]}}
    info = PodInfo.from_pod(pod)
    assert info == PodInfo("p", True, "v000003", "v000002", 5.25, "v000003: boom", 17)
    bad = {"metadata": {"name": "q", "annotations": {c.ACCEPTANCE_TAU: "nan",
                                                     c.TRAFFIC_RECORDS: "many"}}}
    assert PodInfo.from_pod(bad) == PodInfo("q", False)
