"""Exactly once: a job killed at any stage boundary and run again (with the default parent,
``latest``, which the kill may already have moved) publishes one version and reports it.

The kill is a BaseException raised at ``training_job.opd.round.boundary``: nothing in the job
catches it, as nothing catches SIGKILL; what is on the volume at that moment is all the rerun
finds.
"""

from __future__ import annotations

import json

import pytest

from sglang_adaflash.drafter.store import latest_version, list_versions
from training_job import distill
from training_job.opd import round as round_mod
from training_job.opd import train as train_mod
from training_job.opd.traffic import Ledger

from .distill_volume import N_SGLANG, N_TRAFFIC

STEPS = 10  # 20 records, batch 4, 2 epochs


class Killed(BaseException):
    pass


def _argv(pair, home, report):
    """The operator's command without --parent: the job resolves drafters/latest."""
    return ["--home", str(home), "--target", str(pair.target_dir), "--min-records", "20",
            "--report", str(report), "--epochs", "2", "--batch-size", "4",
            "--anchors-per-seq", "4", "--ckpt-every", "2", "--eval-max-new-tokens", "6",
            "--min-eval-records", "4", "--max-eval-records", "4", "--threads", "1", "--quiet"]


def _count_steps(monkeypatch) -> list[int]:
    """Steps trained by the jobs that run after this (their log callback)."""
    steps: list[int] = []
    real = train_mod.train_opd

    def spy(*a, log=None, **k):
        def counting(rec):
            steps.append(rec["step"])
            if log is not None:
                log(rec)
        return real(*a, log=counting, **k)

    monkeypatch.setattr(train_mod, "train_opd", spy)
    return steps


@pytest.mark.parametrize("stage", round_mod.STAGES)
def test_a_kill_at_any_stage_boundary_publishes_once(vol, tmp_path, monkeypatch, stage):
    pair, home = vol
    report = tmp_path / "report"
    steps = _count_steps(monkeypatch)

    def kill(at):
        if at == stage:
            raise Killed(at)

    monkeypatch.setattr(round_mod, "boundary", kill)
    with pytest.raises(Killed):
        distill.main(_argv(pair, home, report))
    first = len(steps)
    monkeypatch.setattr(round_mod, "boundary", lambda at: None)
    assert distill.main(_argv(pair, home, report)) == 0

    assert list_versions(home) == ["v000001", "v000002"], stage  # never published twice
    assert latest_version(home) == "v000002"
    rep = json.loads(report.read_text())
    assert rep["version"] == "v000002" and rep["parent"] == "v000001"
    assert len(Ledger(home / "distill" / "consumed.keys").load()) == N_TRAFFIC + N_SGLANG
    assert not (home / "distill" / "work").exists()
    # Each step is trained once: killed before training, the rerun trains the whole round;
    # killed after it, nothing again.
    trained = round_mod.STAGES.index(stage) >= round_mod.STAGES.index("trained")
    assert (first, len(steps) - first) == ((STEPS, 0) if trained else (0, STEPS)), stage
    # The next job finds nothing new: the round is not retrained under the new latest.
    assert distill.main(_argv(pair, home, report)) == 3
    assert list_versions(home) == ["v000001", "v000002"]


def test_a_kill_right_after_publishing_reports_without_loading_a_model(vol, tmp_path,
                                                                        monkeypatch):
    """The rerun with the default parent (now the version the killed job published) finds the
    round by its id in the manifest: it reports that version and trains nothing."""
    pair, home = vol
    report = tmp_path / "report"

    def kill(at):
        if at == "published":
            raise Killed(at)

    monkeypatch.setattr(round_mod, "boundary", kill)
    with pytest.raises(Killed):
        distill.main(_argv(pair, home, report))
    assert latest_version(home) == "v000002" and not report.exists()
    monkeypatch.setattr(round_mod, "boundary", lambda at: None)
    monkeypatch.setattr(round_mod, "load_target",
                        lambda *a, **k: pytest.fail("the rerun loaded the target"))
    assert distill.main(_argv(pair, home, report)) == 0
    assert json.loads(report.read_text())["version"] == "v000002"
    assert list_versions(home) == ["v000001", "v000002"]
