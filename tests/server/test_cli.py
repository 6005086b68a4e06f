"""The `adaflash serve` command: flag errors before any model loads, and (slow) the real process
end to end: the start-up line, a chat request, Ctrl-C, the closed traffic shard."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from sglang_adaflash.cli.main import main as cli_main


@pytest.mark.parametrize("extra, message", [
    (["--port", "70000"], "--port must be in 0..65535"),
    (["--max-queue", "-1"], "--max-queue must be >= 0"),
    (["--request-timeout", "0"], "--request-timeout must be > 0"),
    (["--drafter", "x", "--drafter-version", "v000001"], "not both"),
    (["--drafter-version", "v000001", "--follow-latest"], "choose one"),
    (["--drafter-version", "latest2"], "is not a version name"),
    ([], "names no published version"),  # no --drafter and nothing published under --home
])
def test_bad_serve_flags_exit_2_with_one_line(tmp_path, capsys, extra, message):
    code = cli_main(["serve", "--target", str(tmp_path), "--home", str(tmp_path / "home"), *extra])
    err = capsys.readouterr().err
    assert code == 2 and message in err and err.count("\n") == 1


@pytest.mark.slow
def test_the_serve_process_answers_and_stops_cleanly_on_ctrl_c(pair, tmp_path):
    import openai

    home = tmp_path / "home"
    cmd = [sys.executable, "-m", "sglang_adaflash.cli.main", "serve", "--target", str(pair.target_dir),
           "--drafter", str(pair.drafter_dir), "--home", str(home), "--port", "0", "--threads", "1",
           "--traffic-writer", "cli", "--log-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        line = proc.stdout.readline()  # printed once the socket listens
        assert "listening on http://127.0.0.1:" in line, proc.stderr.read() if not line else line
        url = line.rsplit("listening on ", 1)[1].strip()
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        deadline = time.monotonic() + 60
        while True:  # the socket listens before uvicorn accepts: retry briefly
            try:
                out = client.chat.completions.create(model="target", messages=[{"role": "user", "content": "hi"}],
                                                     max_tokens=4, temperature=0)
                break
            except openai.APIConnectionError:
                assert time.monotonic() < deadline
                time.sleep(0.2)
        assert out.choices[0].finish_reason in ("stop", "length")
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 130
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    shards = sorted((home / "traffic" / "cli").iterdir())
    assert [p.suffix for p in shards] == [".jsonl"]  # closed at shutdown, not left .partial
    assert json.loads(shards[0].read_text().splitlines()[0])["id"] == out.id
