"""`adaflash generate` prints each record as it finishes: a killed or interrupted run keeps them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

from sglang_adaflash.cli.main import main
from sglang_adaflash.engine import engine as engine_mod

from .conftest import write_jsonl

REPO = Path(__file__).resolve().parents[2]
N = 300  # requests; at batch size 1 each takes dozens of decode steps, so a run lasts seconds


def _start(pair, prompts, *extra):
    cmd = [sys.executable, "-m", "sglang_adaflash.cli.main", "generate", "--target", str(pair.target_dir),
           "--drafter", str(pair.drafter_dir), "--mode", "ar", "--prompts", str(prompts), "--max-batch-size", "1",
           "--max-new-tokens", "64", "--ignore-eos", "--quiet", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "0"}
    # SIGINT as a terminal delivers it: a suite started in the background (`cmd &`, nohup) passes
    # on an ignored SIGINT, which Python then leaves ignored, and Ctrl-C could not be tested
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    watchdog = threading.Timer(180, proc.kill)  # a hung child must not hang the suite
    watchdog.start()
    return proc, watchdog


def _first_lines(proc, n: int) -> list[str]:
    lines = []
    while len(lines) < n:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
    return lines


def _prompts(tmp_path):
    return write_jsonl(tmp_path / "many.jsonl", [{"id": f"p{i}", "prompt": f"prompt number {i}"} for i in range(N)])


def _check_records(text: str) -> list[dict]:
    assert text.endswith("\n")  # no half-written record
    recs = [json.loads(line) for line in text.splitlines()]
    assert recs and all(r["error"] is None and len(r["output_ids"]) == 64 for r in recs)
    assert all(r["id"] == f"p{r['index']}" for r in recs)  # each record says which prompt it answers
    assert len({r["index"] for r in recs}) == len(recs)
    return recs


def test_sigkill_keeps_the_records_already_printed(tiny_pair, tmp_path):
    proc, watchdog = _start(tiny_pair, _prompts(tmp_path), "--json")
    try:
        head = _first_lines(proc, 3)
        proc.send_signal(signal.SIGKILL)
        rest, _ = proc.communicate(timeout=60)
    finally:
        watchdog.cancel()
    assert proc.returncode == -signal.SIGKILL
    recs = _check_records("".join(head) + rest)
    assert 3 <= len(recs) < N


def test_sigint_keeps_finished_records_and_exits_130(tiny_pair, tmp_path):
    proc, watchdog = _start(tiny_pair, _prompts(tmp_path), "--json")
    try:
        head = _first_lines(proc, 3)
        proc.send_signal(signal.SIGINT)
        rest, err = proc.communicate(timeout=60)
    finally:
        watchdog.cancel()
    assert proc.returncode == 130, err
    recs = _check_records("".join(head) + rest)
    assert 3 <= len(recs) < N
    assert f"interrupted: {N - len(recs)} of {N} request(s) unfinished" in err
    assert "Traceback" not in err


def test_plain_text_records_stream_and_survive_ctrl_c(tiny_pair, tmp_path, capsys, monkeypatch):
    """Each plain-text record is on stdout before the engine takes its next step; Ctrl-C keeps them."""
    path = write_jsonl(tmp_path / "p.jsonl", [{"id": f"q{i}", "prompt": f"question {i}"} for i in range(5)])
    real_step = engine_mod.SpecEngine.step
    finished, printed_at_step = [], []

    def step(self):
        printed_at_step.append(capsys.readouterr().out)
        if len(finished) >= 2:
            raise KeyboardInterrupt  # Ctrl-C in the middle of the third request
        out = real_step(self)
        finished.extend(out)
        return out

    monkeypatch.setattr(engine_mod.SpecEngine, "step", step)
    rc = main(["generate", "--target", str(tiny_pair.target_dir), "--drafter", str(tiny_pair.drafter_dir),
               "--mode", "ar", "--prompts", path, "--max-batch-size", "1", "--max-new-tokens", "4", "--ignore-eos"])
    err = capsys.readouterr().err
    assert rc == 130
    heads = [line for out in printed_at_step for line in out.splitlines() if line.startswith("=== ")]
    assert [h.split()[1] for h in heads] == [f"q{o.request_id[1:]}" for o in finished]  # engine ids are r<index>
    assert "interrupted: 3 of 5 request(s) unfinished" in err


def test_a_closed_stdout_stops_the_run_quietly(tiny_pair, tmp_path):
    """`adaflash generate ... | head -1`: the reader leaves, generation stops without a traceback."""
    proc, watchdog = _start(tiny_pair, _prompts(tmp_path), "--json")
    try:
        assert json.loads(proc.stdout.readline())["error"] is None
        proc.stdout.close()
        err = proc.stderr.read()
        proc.wait(timeout=60)
    finally:
        watchdog.cancel()
    assert proc.returncode == 141, err
    assert "stdout was closed after" in err and "Traceback" not in err
