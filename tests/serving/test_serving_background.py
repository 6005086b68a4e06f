"""The background loop behind the reload watcher and the pod-status publisher."""

from __future__ import annotations

import threading
import time

from sglang_adaflash.serving.background import BackgroundLoop


def _wait_for(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_runs_until_stopped_and_survives_exceptions(caplog):
    calls = []

    def job():
        calls.append(threading.current_thread().name)
        if len(calls) <= 2:
            raise OSError("the volume went away")

    loop = BackgroundLoop(job, 0.001, name="test-loop")
    loop.start()
    try:
        _wait_for(lambda: len(calls) >= 5)
    finally:
        assert loop.stop(timeout=5)
    assert not loop.is_alive()
    assert set(calls) == {"test-loop"}
    assert caplog.text.count("test-loop failed") == 2 and "the volume went away" in caplog.text
    n = len(calls)
    time.sleep(0.02)
    assert len(calls) == n  # stopped means no more calls


def test_stop_does_not_wait_out_the_interval():
    ran = threading.Event()
    loop = BackgroundLoop(ran.set, 3600, name="slow-interval")
    loop.start()
    ran.wait(5)
    start = time.monotonic()
    assert loop.stop(timeout=5)
    assert time.monotonic() - start < 2


def test_start_is_idempotent_and_a_stopped_loop_can_start_again():
    calls = []
    loop = BackgroundLoop(lambda: calls.append(1), 3600, name="once")
    loop.start()
    loop.start()  # already running: no second thread, no second call
    _wait_for(lambda: calls)
    time.sleep(0.02)
    assert calls == [1]
    assert [t.name for t in threading.enumerate()].count("once") == 1
    loop.stop()
    loop.start()
    _wait_for(lambda: len(calls) == 2)
    loop.stop()


def test_stop_reports_a_job_that_outlasts_the_timeout():
    release = threading.Event()
    entered = threading.Event()

    def job():
        entered.set()
        release.wait(10)

    loop = BackgroundLoop(job, 3600, name="stuck")
    loop.start()
    entered.wait(5)
    assert loop.stop(timeout=0.05) is False and loop.is_alive()
    release.set()
    assert loop.stop(timeout=5) and not loop.is_alive()


def test_stop_before_start_is_harmless():
    assert BackgroundLoop(lambda: None, 1, name="never").stop()
