"""What `adaflash bench` leaves on disk: no temp files, no machine paths, nothing lost on a failed write."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from sglang_adaflash import fsio
from sglang_adaflash.bench import runner
from sglang_adaflash.cli.main import main

REPO = Path(__file__).resolve().parents[2]


def _bench(pair, workload, out, *extra):
    return main(["bench", "--target", str(pair.target_dir), "--drafter", str(pair.drafter_dir), "--prompts", str(workload),
                 "--concurrency", "2", "--modes", "ar,dflash", "--max-new-tokens", "3", "--ignore-eos", "--quiet",
                 "--out", str(out), *extra])


def test_stale_temp_files_of_a_killed_run_are_removed(tiny_pair, workload, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    hour_ago = time.time() - 3600
    stale = [out / ".bench.png.k1ll3d_x.tmp.png", out / ".results.json.a8c_9zqv.tmp"]
    young = out / ".bench.png.inflight.tmp.png"  # maybe a concurrent run's: kept
    unrelated = [out / ".bench.png.notes", out / "mine.tmp.png"]
    for p in [*stale, young, *unrelated]:
        p.write_bytes(b"x")
    for p in [*stale, *unrelated]:
        os.utime(p, (hour_ago, hour_ago))
    assert _bench(tiny_pair, workload, out) == 0
    assert "removed 2 temporary file(s) an interrupted run left" in capsys.readouterr().err
    assert not any(p.exists() for p in stale)
    assert young.exists() and all(p.exists() for p in unrelated)


def test_a_failed_plot_write_keeps_results_and_leaves_no_temp(tiny_pair, workload, tmp_path, capsys, monkeypatch):
    real_replace = os.replace

    def replace(src, dst):
        if str(dst).endswith(".png"):
            raise OSError(28, "No space left on device")
        return real_replace(src, dst)

    monkeypatch.setattr(fsio.os, "replace", replace)
    rc = _bench(tiny_pair, workload, tmp_path)
    captured = capsys.readouterr()
    assert rc == 2 and "Traceback" not in captured.err
    assert f"wrote {tmp_path / 'results.json'}, but cannot write {tmp_path / 'bench.png'} (No space left on device)" in captured.err
    assert "T=0 equality: OK" in captured.out  # the table is printed before any write
    assert json.loads((tmp_path / "results.json").read_text())["equality"]["ok"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.json"]


def test_a_failed_results_write_prints_the_document(tiny_pair, workload, tmp_path, capsys, monkeypatch):
    def full_disk(path, obj, **kw):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(runner, "write_json_atomic", full_disk)
    rc = _bench(tiny_pair, workload, tmp_path)
    captured = capsys.readouterr()
    assert rc == 2 and "the results document is printed above" in captured.err
    doc = json.loads(captured.out[captured.out.index("\n{") + 1:])
    assert doc["format"] == "adaflash.bench/v1" and len(doc["results"]) == 2


def _strings(obj):
    if isinstance(obj, str):
        yield obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield k
            yield from _strings(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from _strings(v)


def _is_machine_path(word: str) -> bool:
    """An absolute path into this machine's filesystem (`/home/...`, `/tmp/...`); an HTTP route
    such as `/v1/completions` names no top-level directory and is not one."""
    word = (word.partition("=")[2] or word).strip(",;:()[]'\"")
    top = word.strip("/").split("/")[0]
    return os.path.isabs(word) and bool(top) and os.path.isdir("/" + top)


def _absolute_paths(doc) -> list[str]:
    return [word for s in _strings(doc) for word in s.split() if _is_machine_path(word)]


def test_results_hold_no_absolute_path(tiny_pair, workload, tmp_path, capsys, monkeypatch):
    out = tmp_path / "out"
    argv = ["bench", "--target", str(tiny_pair.target_dir), "--drafter", str(tiny_pair.drafter_dir),
            "--prompts", str(workload), "--concurrency", "2", "--modes", "ar", "--max-new-tokens", "2",
            "--quiet", f"--out={out}"]
    monkeypatch.setattr(sys, "argv", ["/usr/local/bin/adaflash", *argv])  # so the command line is recorded
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 0
    doc = json.loads((out / "results.json").read_text())
    assert _absolute_paths(doc) == []
    assert doc["config"]["target"] == "<outside>/target" and doc["models"]["target"]["path"] == "<outside>/target"
    assert doc["config"]["prompts"] == ["<outside>/w.jsonl"]
    assert doc["command"].endswith("--quiet --out=out")  # under the current directory: relative to it


def test_recorded_path():
    from sglang_adaflash.assets import ASSETS_DIR

    rec = runner.recorded_path
    assert rec(ASSETS_DIR / "models" / "target") == "<embedded>/models/target"
    assert rec("models/target") == "models/target"  # relative: as given
    assert rec(Path.cwd() / "a" / "b.jsonl") == "a/b.jsonl"
    assert rec("/nowhere/else/x.jsonl") == "<outside>/x.jsonl"
    assert rec(None) is None


def test_committed_results_hold_no_absolute_path():
    """Every JSON a benchmark folder commits (results.json, and the side runs beside it:
    phase times, the levels between, earlier records), not only the files named results.json."""
    found = {}
    for path in sorted((REPO / "benchmarks").rglob("*.json")):
        bad = _absolute_paths(json.loads(path.read_text()))
        if bad:
            found[str(path.relative_to(REPO))] = bad
    assert found == {}


def test_a_seed_torch_cannot_take_exits_2(tiny_pair, workload, tmp_path, capsys):
    assert _bench(tiny_pair, workload, tmp_path, "--seed", str(2**64)) == 2
    err = capsys.readouterr().err
    assert "--seed must be an integer in [0, 2**64)" in err and "Traceback" not in err
