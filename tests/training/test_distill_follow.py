"""`--follow`: the job as a worker that runs a round per batch of traffic, and stops cleanly."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from sglang_adaflash.drafter.manifest import target_fingerprint
from sglang_adaflash.drafter.store import list_versions, publish_checkpoint, verify_version
from sglang_adaflash.testing.tiny_pair import build_tiny_pair
from training_job import distill
from training_job.opd.traffic import Ledger

from . import distill_volume

BATCH = 12
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return build_tiny_pair(tmp_path_factory.mktemp("follow") / "pair", seed=0)


@pytest.fixture
def home(pair, tmp_path):
    home = tmp_path / "home"
    publish_checkpoint(home, pair.drafter_dir, target=target_fingerprint(pair.target_dir))
    return home


def write_batch(home: Path, pair, batch: int, n: int = BATCH) -> list[str]:
    return distill_volume.write_batch(home, pair, batch, n)


def _argv(pair, home, report, *extra):
    return ["--home", str(home), "--target", str(pair.target_dir), "--parent", "latest",
            "--min-records", str(BATCH), "--report", str(report), "--epochs", "1",
            "--batch-size", "4", "--anchors-per-seq", "4", "--head-steps", "1",
            "--ckpt-every", "1", "--eval-max-new-tokens", "4", "--min-eval-records", "3",
            "--max-eval-records", "3", "--threads", "1", "--quiet", "--follow",
            "--poll-interval", "0.05", *extra]


def _lines(out: str) -> list[dict]:
    return [json.loads(x) for x in out.splitlines() if x.startswith("{")]


@pytest.fixture(autouse=True)
def watchdog():
    """A follower that does not stop by itself is SIGTERMed after a while, so a broken stop
    rule fails the test instead of hanging the suite."""
    done = threading.Event()

    def bite():
        if not done.wait(120):
            os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=bite, daemon=True).start()
    yield
    done.set()


def _after(path: Path, action) -> threading.Thread:
    """Run ``action`` once ``path`` exists (the watchdog ends a follower that never gets
    there)."""
    def go():
        end = time.monotonic() + 130
        while not path.exists() and time.monotonic() < end:
            time.sleep(0.02)
        if path.exists():
            action()

    t = threading.Thread(target=go, daemon=True)
    t.start()
    return t


def test_two_batches_make_two_versions_each_from_the_last(pair, home, tmp_path, capsys):
    report = tmp_path / "report"
    first = write_batch(home, pair, 1)
    second = []
    t = _after(home / "drafters" / "v000002", lambda: second.extend(write_batch(home, pair, 2)))
    assert distill.main(_argv(pair, home, report, "--max-rounds", "2")) == 0
    t.join()
    lines = _lines(capsys.readouterr().out)
    assert [(x["round"], x["outcome"], x["version"], x["parent"]) for x in lines] == [
        (1, "published", "v000002", "v000001"), (2, "published", "v000003", "v000002")]
    assert list_versions(home) == ["v000001", "v000002", "v000003"]
    assert verify_version(home, "v000003")["parent"] == "v000002"
    # each round's new records are its own batch: nothing twice, nothing left over; the second
    # also trains on a quarter as many of the first batch's and evaluates its held-out ones
    for v, old in (("v000002", False), ("v000003", True)):
        tr = verify_version(home, v)["training"]
        new = tr["traffic"]["train"] + tr["traffic"]["eval"]
        assert new == BATCH and tr["traffic"]["new"] == BATCH
        assert tr["records"] == tr["traffic"]["train"] + tr["replay_records"]
        assert tr["eval_records"] == tr["traffic"]["eval"] + tr["traffic"]["standing_eval"]
        assert (tr["replay_records"] > 0 and tr["traffic"]["standing_eval"] > 0) == old
    assert len(Ledger(home / "distill" / "consumed.keys").load()) == len(first + second)
    assert json.loads(report.read_text())["version"] == "v000003"  # the last round's report
    assert lines[1]["report"] == json.loads(report.read_text())
    assert not (home / "distill" / "work").exists()


def test_max_rounds_stops_without_touching_later_traffic(pair, home, tmp_path, capsys):
    report = tmp_path / "report"
    write_batch(home, pair, 1)
    t = _after(home / "drafters" / "v000002", lambda: write_batch(home, pair, 2))
    from sglang_adaflash.cli.main import main  # the same through `adaflash distill --follow`

    assert main(["distill", *_argv(pair, home, report, "--max-rounds", "1")]) == 0
    t.join()
    assert [x["outcome"] for x in _lines(capsys.readouterr().out)] == ["published"]
    assert list_versions(home) == ["v000001", "v000002"]
    assert len(Ledger(home / "distill" / "consumed.keys").load()) == BATCH  # batch 2 left


def test_sigterm_while_waiting_exits_0(pair, home, tmp_path):
    report = tmp_path / "report"
    write_batch(home, pair, 1, n=BATCH - 1)  # one short of a round
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "training_job.distill",
                             *_argv(pair, home, report)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    err = []
    for line in proc.stderr:  # wait until it is waiting
        err.append(line)
        if "waiting for traffic: 11 of 12" in line:
            break
    else:
        pytest.fail(f"the follower never waited: {''.join(err)}")
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    out, rest = proc.communicate(timeout=60)
    assert proc.returncode == 0, rest
    assert time.monotonic() - t0 < 10
    assert "stopped (SIGTERM) after 0 round(s)" in rest
    assert out == "" and list_versions(home) == ["v000001"]
    assert Ledger(home / "distill" / "consumed.keys").load() == set()


def test_sigterm_mid_round_publishes_nothing_and_the_round_resumes(pair, home, tmp_path,
                                                                  capsys, monkeypatch):
    """The signal arrives during training (sent from the step log, so deterministically at
    step 2): the round stops with its checkpoint, exits 0, publishes and consumes nothing; the
    next run finishes that same round from step 2 and publishes exactly one version."""
    import training_job.opd.train as train_mod

    real = train_mod.train_opd

    def signalled(*a, log=None, **kw):
        def log2(rec):
            log(rec)
            if rec.get("step") == 2:
                os.kill(os.getpid(), signal.SIGTERM)
        return real(*a, log=log2, **kw)

    monkeypatch.setattr(train_mod, "train_opd", signalled)
    report = tmp_path / "report"
    write_batch(home, pair, 1)
    assert distill.main(_argv(pair, home, report)) == 0
    lines = _lines(capsys.readouterr().out)
    assert [x["outcome"] for x in lines] == ["stopped"] and "step 2" in lines[0]["reason"]
    assert list_versions(home) == ["v000001"]
    assert Ledger(home / "distill" / "consumed.keys").load() == set()
    work = home / "distill" / "work"
    round_id = json.loads((work / "round.json").read_text())["id"]
    steps = [json.loads(x)["step"] for x in (work / "log.jsonl").read_text().splitlines()]
    assert steps == [1, 2]

    monkeypatch.setattr(train_mod, "train_opd", real)
    assert distill.main(_argv(pair, home, report, "--max-rounds", "1")) == 0
    assert list_versions(home) == ["v000001", "v000002"]
    assert verify_version(home, "v000002")["training"]["round"] == round_id
    assert len(Ledger(home / "distill" / "consumed.keys").load()) == BATCH


def test_a_rejected_round_consumes_its_records_and_the_follower_goes_on(pair, home, tmp_path,
                                                                       capsys):
    """--require-gain refuses the candidate: nothing published, its records consumed (the same
    parent on the same records would be refused again), and the loop keeps going."""
    report = tmp_path / "report"
    write_batch(home, pair, 1)
    assert distill.main(_argv(pair, home, report, "--max-rounds", "1",
                              "--require-gain", "1000")) == 0
    lines = _lines(capsys.readouterr().out)
    assert [x["outcome"] for x in lines] == ["rejected"]
    assert "gate failed (NoGain)" in lines[0]["reason"]
    assert report.read_text().startswith("distill: gate failed (NoGain)")
    assert list_versions(home) == ["v000001"]
    assert len(Ledger(home / "distill" / "consumed.keys").load()) == BATCH
    assert not (home / "distill" / "work").exists()


def test_follow_refuses_bad_settings(pair, home, tmp_path, capsys):
    report = tmp_path / "report"
    assert distill.main(_argv(pair, home, report, "--max-rounds", "0")) == 2
    assert "--max-rounds" in capsys.readouterr().err
    assert distill.main(_argv(pair, home, report, "--parent", "v000009")) == 1
    assert "v000009 is not published" in report.read_text()
