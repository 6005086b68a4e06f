"""What a hot reload costs the decode thread: no device sync, no allocation of the rollback copy.

A swap runs between two decode steps on the thread that launches them. Waiting for the device
there (or copying the whole drafter into freshly allocated pageable memory, which waits too)
stalls every running request; so the rollback copy's host memory is allocated by the watcher
thread, pinned on a GPU, and the swap only queues copies.
"""

from __future__ import annotations

import pytest
import torch

from sglang_adaflash.serving.reload import (
    DesiredVersionSource,
    HotReloader,
    ModuleTarget,
    Snapshot,
    SnapshotBuffers,
)
from sglang_adaflash.testing.fixtures import drafter_config, publish_random, random_drafter


class _FailingTarget(ModuleTarget):
    def write(self, state):
        super().write(state)
        raise RuntimeError("simulated copy failure")


@pytest.fixture
def reloader_for(tmp_path, monkeypatch):
    """A reloader over a live CPU drafter with v000002 staged; then the machine looks like it
    has CUDA, and any device sync on the decode path fails the test."""
    home = tmp_path / "home"
    publish_random(home, seed=1)
    live = random_drafter(drafter_config(), 1)
    desired = tmp_path / "desired"
    taken: list[Snapshot] = []
    take = Snapshot.take.__func__

    def spy(cls, tensors, buffers=None):
        taken.append(take(cls, tensors, buffers))
        return taken[-1]

    monkeypatch.setattr(Snapshot, "take", classmethod(spy))

    def build(target_cls=ModuleTarget):
        r = HotReloader(
            source=DesiredVersionSource(home=home, version_file=desired),
            target=target_cls(live),
            loaded_version="v000001",
        )
        version = publish_random(home, seed=2)
        desired.write_text(version)
        r.poll_once()
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(
            torch.cuda, "synchronize", lambda *a: pytest.fail("the decode thread waited")
        )
        return r, live, taken

    return build


def test_a_swap_never_waits_for_the_device(reloader_for):
    reloader, live, _ = reloader_for()
    assert reloader.at_step_boundary() == "v000002"


def test_a_failed_swap_restores_without_waiting_for_the_device(reloader_for):
    reloader, live, _ = reloader_for(_FailingTarget)
    before = {k: v.clone() for k, v in live.state_dict().items()}
    assert reloader.at_step_boundary() is None
    assert reloader.status.reloads == {"failed": 1}
    assert all(torch.equal(v, before[k]) for k, v in live.state_dict().items())


def test_the_rollback_copy_uses_memory_the_watcher_allocated(reloader_for):
    reloader, live, taken = reloader_for()
    buffers = reloader._snapshot_buffers
    assert isinstance(buffers, SnapshotBuffers)  # allocated by poll_once, before the swap
    held = {name: t.data_ptr() for name, t in buffers.tensors.items()}
    before = {k: v.clone() for k, v in live.state_dict().items()}
    assert reloader.at_step_boundary() == "v000002"
    (snapshot,) = taken
    assert {n: t.data_ptr() for n, t in snapshot.tensors.items()} == held
    assert all(torch.equal(snapshot.tensors[k], before[k]) for k in before)


def test_snapshot_buffers_follow_the_live_tensors():
    live = {"a": torch.zeros(2, 3), "b": torch.ones(4, dtype=torch.bfloat16)}
    buffers = SnapshotBuffers(live)
    assert buffers.fits(live)
    assert not buffers.fits({"a": torch.zeros(2, 3)})
    assert not buffers.fits({**live, "b": torch.ones(4)})
    assert not any(t.is_pinned() for t in buffers.tensors.values())  # CPU tensors: not pinned


def _faults_in_this_thread() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt


@pytest.mark.skipif(not hasattr(__import__("resource"), "RUSAGE_THREAD"),
                    reason="per-thread page-fault counts need Linux (RUSAGE_THREAD)")
def test_the_rollback_copy_does_not_fault_its_memory_in_on_the_decode_thread():
    """Fresh host memory is mapped at its first write, a page fault per 4 KB: the buffers are
    written where they are allocated (the watcher thread), so the swap's copy into them costs the
    decode thread no fault. 64 MB, past glibc's largest mmap threshold, so the memory is fresh.
    Control: buffers left unwritten (torch.empty, the old allocation) take at least one fault per
    16 KB on the first copy."""
    live = {"w": torch.randn(16 * 1024 * 1024)}  # 64 MB of float32, already written
    buffers = SnapshotBuffers(live)
    before = _faults_in_this_thread()
    Snapshot.take(live, buffers)
    written = _faults_in_this_thread() - before
    buffers.tensors = {k: torch.empty_like(v) for k, v in buffers.tensors.items()}
    before = _faults_in_this_thread()
    Snapshot.take(live, buffers)
    unwritten = _faults_in_this_thread() - before
    assert unwritten >= 64 * 1024 // 16, unwritten
    assert written <= 64, written


def test_reports_start_no_thread_on_the_decode_thread(tmp_path, monkeypatch):
    """A swap reports the new status from the decode thread. Reports run in order on a thread
    that was started with the reloader, so the swap only queues them: starting a thread there
    (the Thread.start handshake, then waiting for the lock it took) held the loop for up to 3
    ms of a 5 ms step."""
    import threading

    home = tmp_path / "home"
    publish_random(home, seed=1)
    desired = tmp_path / "desired"
    seen: list[dict] = []

    class Recorder:
        def report(self, status):
            seen.append(status)

    reloader = HotReloader(source=DesiredVersionSource(home=home, version_file=desired),
                           target=ModuleTarget(random_drafter(drafter_config(), 1)),
                           loaded_version="v000001", reporters=[Recorder()])
    desired.write_text(publish_random(home, seed=2))
    reloader.poll_once()
    assert reloader.flush_reports(timeout=10)
    started: list[str] = []
    start = threading.Thread.start

    def spy(thread):
        started.append(thread.name)
        return start(thread)

    monkeypatch.setattr(threading.Thread, "start", spy)
    assert reloader.at_step_boundary() == "v000002"
    assert started == []
    assert reloader.flush_reports(timeout=10)
    assert seen[-1]["loaded_version"] == "v000002"
    reloader.stop()
    reloader._report()  # after stop: reported at once, not lost
    assert len(seen) >= 3 and seen[-1]["loaded_version"] == "v000002"
