"""The by-hand loop through the CLI: generate with --traffic-dir, publish, distill, list."""

from __future__ import annotations

import json

import pytest

from sglang_adaflash.cli.main import main
from sglang_adaflash.serving.traffic import ReadReport
from sglang_adaflash.testing.tiny_pair import build_tiny_pair, write_tiny_workload
from training_job.opd.traffic import scan_traffic


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return build_tiny_pair(tmp_path_factory.mktemp("pair") / "p", seed=0)


def test_generate_traffic_then_distill(pair, tmp_path, capsys):
    home = tmp_path / "home"
    prompts = write_tiny_workload(tmp_path / "prompts.jsonl", num_prompts=12)
    assert main(["generate", "--target", str(pair.target_dir), "--drafter", str(pair.drafter_dir),
                 "--mode", "dflash", "--prompts", str(prompts), "--max-new-tokens", "10",
                 "--ignore-eos", "--json", "--quiet",
                 "--traffic-dir", str(home / "traffic" / "laptop")]) == 0
    printed = {r["id"]: r for r in map(json.loads, capsys.readouterr().out.splitlines())}
    report = ReadReport()
    samples = list(scan_traffic(home, report))
    assert report.skipped_total == 0 and len(samples) == 12
    assert not list((home / "traffic" / "laptop").glob("*.partial"))  # closed on exit
    for s in samples:
        assert s.output_ids == printed[s.id]["output_ids"] and s.domain == printed[s.id]["domain"]
        assert s.temperature == 0.0 and s.writer == "laptop"
    shard = next((home / "traffic" / "laptop").glob("*.jsonl"))
    rec = json.loads(shard.read_text().splitlines()[0])
    assert rec["drafter_version"] == "drafter" and rec["model"] == "target"

    assert main(["drafters", "publish", str(pair.drafter_dir), "--home", str(home),
                 "--target", str(pair.target_dir)]) == 0
    assert main(["distill", "--home", str(home), "--target", str(pair.target_dir),
                 "--min-records", "12", "--epochs", "1", "--batch-size", "4",
                 "--anchors-per-seq", "4", "--head-steps", "1", "--min-eval-records", "3",
                 "--eval-max-new-tokens", "4", "--threads", "1", "--quiet"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    report = json.loads(out[-1])
    assert report["version"] == "v000002" and report["parent"] == "v000001"
    assert report["training"]["records"] == 9
    assert main(["drafters", "list", "--home", str(home), "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert rows[-1]["version"] == "v000002" and rows[-1]["latest"]
    assert rows[-1]["algorithm"] == "opd-rkl"


def test_traffic_dir_must_be_where_the_job_reads(pair, tmp_path, capsys):
    prompts = write_tiny_workload(tmp_path / "prompts.jsonl", num_prompts=1)
    assert main(["generate", "--target", str(pair.target_dir), "--mode", "ar", "--prompts",
                 str(prompts), "--max-new-tokens", "2", "--quiet",
                 "--traffic-dir", str(tmp_path / "somewhere")]) == 2
    assert "must be HOME/traffic/<writer>" in capsys.readouterr().err
