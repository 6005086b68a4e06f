"""The distillation job end to end on a tiny pair: the operator's contract, resume, failures."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from sglang_adaflash.drafter.manifest import target_fingerprint
from sglang_adaflash.drafter.store import (
    latest_version,
    list_versions,
    publish_checkpoint,
    verify_version,
)
from training_job import distill
from training_job.opd import round as round_mod
from training_job.opd.traffic import Ledger

from .distill_volume import N_SGLANG, N_TRAFFIC, job_argv, write_batch

_argv = job_argv


def _drafter_version_spec(report: dict) -> dict:
    """What the operator makes of the report, checked against the CRD schema."""
    import jsonschema
    from adaflash_operator import crds, job_manifests
    from adaflash_operator.distill import parse_report

    parsed = parse_report(json.dumps(report))
    owner = {"metadata": {"name": "svc", "namespace": "ns", "uid": "u"},
             "apiVersion": "adaflash.io/v1alpha1", "kind": "AdaFlashService"}
    dv = job_manifests.drafter_version(owner, parsed, "svc-distill-1-1")
    schema = crds.openapi_schema("DrafterVersion")
    schema["properties"]["metadata"] = {"type": "object"}
    jsonschema.Draft4Validator(schema, format_checker=jsonschema.FormatChecker()).validate(dv)
    return dv["spec"]


def test_round_publishes_and_reports_what_the_operator_accepts(vol, tmp_path, capsys):
    pair, home = vol
    report_path = tmp_path / "termination-log"
    assert distill.main(_argv(pair, home, report_path)) == 0
    data = report_path.read_bytes()
    assert len(data) <= 4096
    report = json.loads(data)
    assert report["version"] == "v000002" and report["parent"] == "v000001"
    assert report["training"]["algorithm"] == "opd-rkl"
    assert report["training"]["records"] == 20 and report["training"]["steps"] == 10
    assert report["training"]["finalLoss"] > 0
    assert set(report["eval"]["tau"]) == set(report["eval"]["parentTau"]) <= {"code", "math"}
    assert all(t >= 1.0 for t in report["eval"]["tau"].values())
    spec = _drafter_version_spec(report)
    assert spec["eval"]["tau"] == report["eval"]["tau"]
    gate = report["eval"]["gate"]  # the job's decision and its numbers reach the operator
    assert spec["eval"]["gate"] == gate and isinstance(gate["passed"], bool)
    assert gate["reason"] in ("Passed", "NoGain", "DomainDrop") and gate["prompts"] == 4
    assert set(gate["domains"]) == set(report["eval"]["tau"])
    assert manifest_gate_matches(home, gate)
    assert spec["target"]["name"] == str(pair.target_dir)
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == report

    manifest = verify_version(home, "v000002")
    assert latest_version(home) == "v000002" and manifest["parent"] == "v000001"
    assert manifest["training"]["traffic"]["new"] == N_TRAFFIC + N_SGLANG
    head = manifest["training"]["length_head"]  # trained in the drafter's 10 steps
    assert head["mode"] == "joint" and head["steps"] == 10
    calibration = manifest["training"]["length_head"]["calibration"]  # on the held-out slice
    assert calibration["blocks"] > 0 and isinstance(calibration["applied"], bool)
    assert manifest["eval"]["records_by_domain"]
    assert report["target"]["sha256"] == target_fingerprint(pair.target_dir)["config_digest"]
    # the new version has the parent's shapes (hot reload refuses anything else)
    from sglang_adaflash.drafter.checkpoint import read_checkpoint

    _, old = read_checkpoint(home / "drafters" / "v000001")
    _, new = read_checkpoint(home / "drafters" / "v000002")
    assert {k: v.shape for k, v in old.items()} == {k: v.shape for k, v in new.items()}
    assert {v.dtype for v in new.values()} == {v.dtype for v in old.values()}
    assert not torch.equal(old["fc.weight"], new["fc.weight"])
    assert len(Ledger(home / "distill" / "consumed.keys").load()) == N_TRAFFIC + N_SGLANG
    assert not (home / "distill" / "work").exists()
    # eval.tau and eval.parentTau are the two versions' engine tau on the same held-out records
    assert {k: report["eval"][k] for k in ("tau", "parentTau")} == _recomputed_eval(pair, home)

    # Nothing new: no round, and the report says why (exit code 3: not a failure).
    assert distill.main(_argv(pair, home, report_path, "--parent", "v000002")) == 3
    assert json.loads(report_path.read_text())["message"].startswith(
        "only 0 new usable traffic records")
    assert list_versions(home) == ["v000001", "v000002"]
    # Traffic the retention CronJob deleted leaves the ledger at the next round.
    shutil.rmtree(home / "traffic" / "pod-b")
    assert distill.main(_argv(pair, home, report_path, "--parent", "v000002")) == 3
    assert len(Ledger(home / "distill" / "consumed.keys").load()) == N_TRAFFIC


def manifest_gate_matches(home, gate) -> bool:
    """The manifest keeps every prompt's numbers: the gate's decision can be recomputed."""
    from training_job.opd.gate import GateConfig, decide

    ev = verify_version(home, "v000002")["eval"]
    again = decide(ev["per_prompt"]["candidate"], ev["per_prompt"]["parent"], GateConfig())
    return ev["gate"] == again and {k: again[k] for k in gate} == gate


def _recomputed_eval(pair, home) -> dict:
    from transformers import AutoModelForCausalLM

    from sglang_adaflash.drafter.checkpoint import load_drafter
    from sglang_adaflash.serving.traffic import ReadReport
    from training_job.opd.evaluate import engine_tau, taus
    from training_job.opd.traffic import scan_traffic, select_round

    held = select_round(scan_traffic(home, ReadReport()), set(), max_records=4096,
                        eval_fraction=0.1, min_eval=4, max_eval=4).eval
    target = AutoModelForCausalLM.from_pretrained(pair.target_dir).eval()
    out = {}
    for key, v in (("tau", "v000002"), ("parentTau", "v000001")):
        drafter = load_drafter(home / "drafters" / v, dtype=torch.float32)
        out[key] = taus(engine_tau(target, drafter, held, max_new_tokens=6, max_prompt_len=1024,
                                   stop_ids=(2, 6)))
    return out


@pytest.mark.parametrize("keep_old", [True, False])
def test_a_round_of_one_domain_replays_the_others_and_evaluates_them(vol, tmp_path, keep_old):
    """The second round's new traffic is prose alone. By default it also trains on a quarter as
    many of the first round's code and math records and evaluates the first round's held-out
    ones, so the gate sees whether code and math dropped. Control: with --replay-share 0
    --standing-eval-records 0 the round sees prose alone (the old behaviour)."""
    pair, home = vol
    report = tmp_path / "report"
    assert distill.main(_argv(pair, home, report)) == 0
    first_held = Ledger(home / "distill" / "heldout.keys").load()
    first_eval = {k for k, *_ in verify_version(home, "v000002")["eval"]["per_prompt"]["candidate"]}
    assert first_held == first_eval and len(first_held) == 4
    write_batch(home, pair, 2, 24, domains=("prose",))
    extra = () if keep_old else ("--replay-share", "0", "--standing-eval-records", "0")
    assert distill.main(_argv(pair, home, report, "--parent", "v000002", *extra)) == 0
    m = verify_version(home, "v000003")
    training, ev = m["training"], m["eval"]
    assert training["traffic"]["train"] == 20 and training["traffic"]["eval"] == 4
    evaluated = {k for k, *_ in ev["per_prompt"]["candidate"]}
    if keep_old:
        assert training["replay_records"] == 5 and training["records"] == 25  # ceil(0.25 x 20)
        assert set(training["domains"]) - {"prose"}  # earlier domains, trained on again
        assert set(ev["records_by_domain"]) - {"prose"}
        assert first_held <= evaluated  # the standing held-out records, evaluated again
        assert len(Ledger(home / "distill" / "heldout.keys").load()) == 8
    else:
        assert training["replay_records"] == 0 and training["records"] == 20
        assert set(training["domains"]) == set(ev["records_by_domain"]) == {"prose"}
        assert not first_held & evaluated


def test_too_few_records_is_a_report_not_a_failure_and_consumes_nothing(vol, tmp_path, capsys):
    from adaflash_operator.distill import parse_report

    pair, home = vol
    report = tmp_path / "report"
    stale = home / "distill" / ".work.999.tmp"  # a selection a crash cut short
    stale.mkdir(parents=True)
    assert distill.main(_argv(pair, home, report, "--min-records", "25")) == 3
    assert not stale.exists()
    rep = parse_report(report.read_text())
    assert rep["outcome"] == "NotEnoughRecords" and "version" not in rep
    assert rep["records"] == {"usable": 24, "required": 25}
    assert "only 24 new usable traffic records" in rep["message"]
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == rep
    assert Ledger(home / "distill" / "consumed.keys").load() == set()
    assert list_versions(home) == ["v000001"]
    # The operator asks for exit code 0 (its Job completes); the same records make a round.
    assert distill.main(_argv(pair, home, report, "--min-records", "25",
                              "--idle-exit-code", "0")) == 0
    assert parse_report(report.read_text())["outcome"] == "NotEnoughRecords"
    assert distill.main(_argv(pair, home, report, "--min-records", "24")) == 0
    assert parse_report(report.read_text())["version"] == "v000002"


def test_failed_round_resumes_without_training_again(vol, tmp_path, monkeypatch):
    pair, home = vol
    report = tmp_path / "report"
    real_publish = round_mod.publish

    def broken(*a, **k):
        raise OSError("volume went away")

    monkeypatch.setattr(round_mod, "publish", broken)
    assert distill.main(_argv(pair, home, report)) == 1
    assert "OSError: volume went away" in report.read_text()
    work = home / "distill" / "work"
    steps_logged = len((work / "log.jsonl").read_text().splitlines())
    assert steps_logged == 10 and (work / "eval.json").exists()

    monkeypatch.setattr(round_mod, "publish", real_publish)
    import training_job.opd.evaluate as evaluate

    monkeypatch.setattr(evaluate, "engine_tau", lambda *a, **k: pytest.fail("evaluated again"))
    real_finish = round_mod.finish
    seen = {}

    def spy(home_, work_, version, args):
        seen["steps"] = len((work_ / "log.jsonl").read_text().splitlines())
        return real_finish(home_, work_, version, args)

    monkeypatch.setattr(round_mod, "finish", spy)
    assert distill.main(_argv(pair, home, report)) == 0
    assert seen["steps"] == steps_logged  # resumed from the final checkpoint: no step again
    assert json.loads(report.read_text())["version"] == "v000002"


def test_crash_after_publishing_reports_the_same_version(vol, tmp_path, monkeypatch):
    pair, home = vol
    report = tmp_path / "report"
    real = round_mod._write_json

    def crash(path, obj):
        if path.name == "published.json":
            raise OSError("killed")
        real(path, obj)

    monkeypatch.setattr(round_mod, "_write_json", crash)
    assert distill.main(_argv(pair, home, report)) == 1
    assert list_versions(home) == ["v000001", "v000002"]
    assert Ledger(home / "distill" / "consumed.keys").load() == set()
    monkeypatch.setattr(round_mod, "_write_json", real)
    assert distill.main(_argv(pair, home, report)) == 0
    assert list_versions(home) == ["v000001", "v000002"]  # not published twice
    assert json.loads(report.read_text())["version"] == "v000002"
    assert len(Ledger(home / "distill" / "consumed.keys").load()) == N_TRAFFIC + N_SGLANG


def test_changed_settings_start_the_round_over(vol, tmp_path, monkeypatch):
    pair, home = vol
    report = tmp_path / "report"
    monkeypatch.setattr(round_mod, "publish", lambda *a, **k: (_ for _ in ()).throw(OSError("x")))
    assert distill.main(_argv(pair, home, report)) == 1
    first = json.loads((home / "distill" / "work" / "round.json").read_text())["id"]
    assert distill.main(_argv(pair, home, report, "--lr", "1e-4")) == 1
    second = json.loads((home / "distill" / "work" / "round.json").read_text())["id"]
    assert first != second


def test_one_job_per_volume(vol, tmp_path):
    pair, home = vol
    report = tmp_path / "report"
    with distill.volume_lock(home / "distill"):
        assert distill.main(_argv(pair, home, report)) == 1
    assert "another distillation job holds" in report.read_text()


def test_parent_for_another_target_is_refused(vol, tmp_path):
    pair, home = vol
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text('{"model_type": "qwen3", "hidden_size": 1}')
    publish_checkpoint(home, pair.drafter_dir, target=target_fingerprint(other))  # v000002
    report = tmp_path / "report"
    assert distill.main(_argv(pair, home, report, "--parent", "v000002")) == 1
    assert "parent v000002: this drafter (v000002) was built for target 'other'" in \
        report.read_text()
    assert distill.main(_argv(pair, home, report, "--parent", "v000009")) == 1
    assert "v000009 is not published" in report.read_text()


def test_tau_is_the_candidates_and_parent_tau_the_parents(vol, tmp_path, monkeypatch):
    """The evaluation is wired to the right drafters: a stand-in engine returns a number that
    identifies the weights it was given."""
    import training_job.opd.evaluate as evaluate
    from sglang_adaflash.drafter.checkpoint import read_checkpoint

    def mark(state):
        return round(1.0 + float(state["fc.weight"].double().sum()) * 1000 % 7, 4)

    def fake(target, drafter, samples, **kw):
        tokens = round(mark(drafter.state_dict()) * 10000)
        return [[s.key, "code", tokens, 10000] for s in samples]

    monkeypatch.setattr(evaluate, "engine_results", fake)
    pair, home = vol
    report = tmp_path / "report"
    assert distill.main(_argv(pair, home, report, "--lr", "1e-2")) == 0
    ev = json.loads(report.read_text())["eval"]
    assert ev["tau"] == {"code": mark(read_checkpoint(home / "drafters" / "v000002")[1])}
    assert ev["parentTau"] == {"code": mark(read_checkpoint(home / "drafters" / "v000001")[1])}
    assert ev["tau"] != ev["parentTau"]


def test_the_operators_command_line_parses_and_the_module_runs(tmp_path):
    """The Job's args exactly as the operator builds them, and `python -m training_job.distill`
    as the container runs it (it fails here: the volume is empty, and says so in the report)."""
    import subprocess
    import sys

    from adaflash_operator import job_manifests
    from adaflash_operator.spec import parse

    spec = parse({"model": {"target": "Qwen/Qwen3-8B"}, "serving": {"image": "img"},
                  "distillation": {"minNewRecords": 256,
                                   "extraArgs": ["--algorithm", "osd", "--epochs", "3"]}})
    args = distill.build_parser().parse_args(job_manifests.distill_args(spec, "v000004"))
    assert (args.home, args.target, args.parent, args.min_records, args.report) == (
        "/var/lib/adaflash", "Qwen/Qwen3-8B", "v000004", 256, "/dev/termination-log")
    assert (args.algorithm, args.epochs) == ("osd", 3)
    assert distill.opd_config(args).loss == "sft"  # the deprecated alias still means OSD
    report = tmp_path / "report"
    target = tmp_path / "no-such-target"
    r = subprocess.run([sys.executable, "-m", "training_job.distill", "--home", str(tmp_path),
                        "--target", str(target), "--parent", "v000001", "--min-records", "1",
                        "--report", str(report)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    assert report.read_text() == f"distill: target directory {target} does not exist"


@pytest.mark.parametrize("loss,name", [("fkl", "opd-fkl"), ("sft", "osd-ce")])
def test_loss_flag_reaches_the_manifest(vol, tmp_path, loss, name):
    pair, home = vol
    report = tmp_path / "report"
    assert distill.main(_argv(pair, home, report, "--loss", loss, "--parent", "latest")) == 0
    rep = json.loads(report.read_text())
    assert rep["training"]["algorithm"] == name and rep["parent"] == "v000001"
    assert verify_version(home, "v000002")["training"]["loss"] == loss


def test_contradicting_loss_and_algorithm_are_refused(vol, tmp_path):
    pair, home = vol
    report = tmp_path / "report"
    assert distill.main(_argv(pair, home, report, "--loss", "rkl", "--algorithm", "osd")) == 2
    assert "contradicts --loss rkl" in report.read_text()
    assert list_versions(home) == ["v000001"]
