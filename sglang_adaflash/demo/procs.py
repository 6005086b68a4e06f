"""The demo's two child processes (`adaflash serve`, `adaflash distill --follow`), and how they end.

A demo that leaves a server or a training job running after it stops is worse than no demo, so
every way out ends them:

- a normal end, an error or Ctrl-C: :meth:`Children.stop_all` (the ``with`` block's exit) sends
  SIGTERM to each child's process group, waits, then SIGKILLs what is left;
- SIGTERM to the demo: :func:`terminate_as_interrupt` turns it into the same unwinding;
- the demo killed outright (SIGKILL, a crash of the interpreter): each child was started with
  the kernel's parent-death signal (``PR_SET_PDEATHSIG``, Linux), so it gets SIGTERM when the
  demo's process goes away.

Each child writes stdout and stderr to its own log file, which the demo reads for the start-up
line; nothing is piped, so a chatty child can never block on a full pipe.
"""

from __future__ import annotations

import ctypes
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

_PR_SET_PDEATHSIG = 1


class ChildError(RuntimeError):
    """A child exited or did not start in time; the message carries its log's tail."""


def _die_with_parent() -> None:  # runs in the child between fork and exec
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        except (OSError, AttributeError):
            pass


class Child:
    """One process in its own session (so its whole group can be signalled), logging to a file."""

    def __init__(self, name: str, argv: list[str], log_path: Path, env: dict[str, str] | None = None):
        self.name, self.argv, self.log_path = name, list(argv), Path(log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=self._log,
                                     stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                     preexec_fn=_die_with_parent)
        self.pid = self.proc.pid
        self._terminated = False

    @property
    def terminated(self) -> bool:
        """Whether this side sent the SIGTERM (its exit status is then not the child's verdict)."""
        return self._terminated

    @property
    def running(self) -> bool:
        return self.proc.poll() is None

    def tail(self, lines: int = 15) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def wait_for_line(self, pattern: str, timeout_s: float) -> re.Match:
        """The first log line matching ``pattern``; ChildError if the child exits or time runs out."""
        rx = re.compile(pattern)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                text = self.log_path.read_text(errors="replace")
            except OSError:
                text = ""
            for line in text.splitlines():
                m = rx.search(line)
                if m:
                    return m
            if not self.running:
                raise ChildError(f"{self.name} exited with status {self.proc.returncode} before it "
                                 f"was ready; the end of its log ({self.log_path}):\n{self.tail()}")
            if time.monotonic() > deadline:
                raise ChildError(f"{self.name} was not ready after {timeout_s:.0f} s; the end of its "
                                 f"log ({self.log_path}):\n{self.tail()}")
            time.sleep(0.1)

    def terminate(self) -> None:
        """SIGTERM to the group without waiting (:meth:`stop` waits and escalates)."""
        if self.running and not self._terminated:
            self._signal(signal.SIGTERM)
            self._terminated = True

    def stop(self, timeout_s: float = 20.0) -> int:
        """SIGTERM to the group (once: a second one may mean "at once" to the child), then
        SIGKILL after ``timeout_s``; returns the exit status."""
        if self.running:
            self.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self._signal(signal.SIGKILL)
                self.proc.wait(10)
        else:
            self._signal(signal.SIGKILL)  # the leader is gone; anything it left in its group goes too
        self._log.close()
        return self.proc.returncode

    def _signal(self, sig: int) -> None:
        try:
            os.killpg(self.pid, sig)  # start_new_session: the group id is the child's pid
        except (ProcessLookupError, PermissionError):
            pass


class Children:
    """The demo's children; leaving the ``with`` block stops every one, last started first."""

    def __init__(self) -> None:
        self.children: list[Child] = []

    def start(self, name: str, argv: list[str], log_path: Path, env: dict[str, str] | None = None) -> Child:
        child = Child(name, argv, log_path, env)
        self.children.append(child)
        return child

    def stop_all(self, timeout_s: float = 20.0) -> dict[str, int]:
        codes = {}
        for child in reversed(self.children):
            codes[child.name] = child.stop(timeout_s)
        self.children.clear()
        return codes

    def __enter__(self) -> Children:
        return self

    def __exit__(self, *exc) -> None:
        self.stop_all()


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the demo's main thread is, so its clean-up runs as for Ctrl-C."""


def terminate_as_interrupt():
    """Install the SIGTERM handler; returns the one it replaced (None: not the main thread)."""

    def handler(signum, frame):
        raise Terminated(f"signal {signum}")

    try:
        return signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread: the caller's own handling applies
        return None


def restore_sigterm(previous) -> None:
    if previous is not None:
        signal.signal(signal.SIGTERM, previous)
