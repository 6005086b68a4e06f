"""The demo's children end on every path: SIGTERM then SIGKILL, and with the demo's own death."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from sglang_adaflash.demo.procs import Child, ChildError, Children

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="process groups and PDEATHSIG: Linux")


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is dead for our purposes
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def wait_dead(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not alive(pid):
            return True
        time.sleep(0.05)
    return False


def test_a_child_that_ignores_sigterm_is_killed(tmp_path):
    code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(60)"
    child = Child("stubborn", [sys.executable, "-c", code], tmp_path / "c.log")
    child.wait_for_line("^up$", 20)
    t0 = time.monotonic()
    assert child.stop(timeout_s=0.5) == -signal.SIGKILL
    assert time.monotonic() - t0 < 10 and not alive(child.pid)


def test_the_whole_group_goes_with_the_child(tmp_path):
    # the child starts a grandchild of its own; stopping the child ends both
    code = textwrap.dedent("""
        import subprocess, sys, time
        p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        print("grandchild", p.pid, flush=True)
        time.sleep(60)
    """)
    with Children() as kids:
        child = kids.start("parent", [sys.executable, "-c", code], tmp_path / "p.log")
        grandchild = int(child.wait_for_line(r"grandchild (\d+)", 20).group(1))
        assert alive(grandchild)
    assert wait_dead(child.pid) and wait_dead(grandchild)


def test_children_die_with_a_killed_demo(tmp_path):
    # a stand-in for the demo: starts a child through Children, then is SIGKILLed (no clean-up runs)
    demo = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(os.getcwd())!r})
        from pathlib import Path
        from sglang_adaflash.demo.procs import Children
        kids = Children()
        c = kids.start("sleeper", [sys.executable, "-c", "import time; time.sleep(60)"], Path({str(tmp_path)!r}) / "s.log")
        print(c.pid, flush=True)
        time.sleep(60)
    """)
    proc = subprocess.Popen([sys.executable, "-c", demo], stdout=subprocess.PIPE, text=True)
    pid = int(proc.stdout.readline())
    assert alive(pid)
    proc.kill()
    proc.wait()
    assert wait_dead(pid), "the child outlived the demo that started it"


def test_a_child_that_exits_early_is_reported_with_its_log(tmp_path):
    child = Child("broken", [sys.executable, "-c", "import sys; print('no model here'); sys.exit(2)"],
                  tmp_path / "b.log")
    with pytest.raises(ChildError, match="(?s)broken exited with status 2.*no model here"):
        child.wait_for_line("listening on", 20)
    child.stop()
