"""Publishing to the shared volume with more than one publisher, and pins."""

from __future__ import annotations

import os
import shutil
import threading
import time

import pytest

from sglang_adaflash.drafter import store
from sglang_adaflash.drafter.checkpoint import CheckpointError, read_checkpoint
from sglang_adaflash.drafter.manifest import read_manifest
from sglang_adaflash.drafter.store import (
    LATEST_NAME,
    latest_version,
    list_versions,
    publish_version,
    verify_version,
    write_pin,
)
from sglang_adaflash.testing.fixtures import (
    ANY_TARGET,
    drafter_config,
    publish_random,
    random_state,
)


def _publish(home, seed):
    cfg = drafter_config()
    return publish_version(home, cfg, random_state(cfg, seed), target=ANY_TARGET)


def test_concurrent_publishers_get_distinct_versions_and_latest_ends_on_the_newest(
        tmp_path, monkeypatch):
    """Publisher A (v000002) stalls just before it moves `latest`; publisher B (v000003) runs in
    the meantime. Without the lock B finishes first and A then moves `latest` back to v000002."""
    home = tmp_path / "home"
    publish_random(home, 0)
    stalled = threading.Event()
    real_write = store.write_text_atomic

    def stalling_write(path, text):
        if path.name == LATEST_NAME and text.startswith("v000002"):
            stalled.set()
            time.sleep(0.5)
        real_write(path, text)

    monkeypatch.setattr(store, "write_text_atomic", stalling_write)
    results, errors = [], []

    def run(seed):
        try:
            results.append(_publish(home, seed))
        except Exception as e:  # noqa: BLE001 - the assertion below shows it
            errors.append(e)

    a = threading.Thread(target=run, args=(1,))
    a.start()
    assert stalled.wait(timeout=30)
    b = threading.Thread(target=run, args=(2,))
    b.start()
    a.join()
    b.join()
    assert errors == []
    assert sorted(results) == ["v000002", "v000003"]
    assert list_versions(home) == ["v000001", "v000002", "v000003"]
    assert latest_version(home) == "v000003"
    for v in list_versions(home):
        assert verify_version(home, v)["version"] == v


def test_publisher_that_ignores_the_lock_makes_us_take_the_next_number(tmp_path, monkeypatch):
    home = tmp_path / "home"
    publish_random(home, 0)
    foreign = tmp_path / "foreign"
    real_rename = store._rename_noreplace

    def rename(src, dst):
        if dst.name == "v000002" and not dst.exists():
            # another host publishes v000002 between our choice and our rename
            shutil.copytree(store.drafters_dir(home) / "v000001", foreign)
            os.rename(foreign, dst)
        return real_rename(src, dst)

    monkeypatch.setattr(store, "_rename_noreplace", rename)
    v = _publish(home, 5)
    assert v == "v000003"
    assert read_manifest(home / "drafters" / v)["version"] == "v000003"
    verify_version(home, v)
    # the foreign v000002 was not replaced
    assert read_manifest(home / "drafters" / "v000002")["version"] == "v000001"


def test_empty_directory_in_the_way_is_not_replaced(tmp_path, monkeypatch):
    """POSIX rename silently replaces an empty directory: one created between our choice of
    number and our rename (a mkdir by hand, another host) must not be taken over."""
    home = tmp_path / "home"
    publish_random(home, 0)
    real_rename = store._rename_noreplace

    def rename(src, dst):
        if dst.name == "v000002" and not dst.exists():
            dst.mkdir()
            (dst.parent / "marker").write_text(str(dst.stat().st_ino))
        return real_rename(src, dst)

    monkeypatch.setattr(store, "_rename_noreplace", rename)
    v = _publish(home, 1)
    assert v == "v000003"
    empty = home / "drafters" / "v000002"
    assert list(empty.iterdir()) == []
    assert str(empty.stat().st_ino) == (home / "drafters" / "marker").read_text()


def test_latest_never_moves_backwards(tmp_path):
    home = tmp_path / "home"
    publish_random(home, 0)
    publish_random(home, 1)
    assert latest_version(home) == "v000002"
    with store.publish_lock(home):
        assert store._advance_latest(home, "v000001") is False
    assert latest_version(home) == "v000002"


def test_numbers_are_never_reused_after_a_deletion(tmp_path):
    home = tmp_path / "home"
    for seed in range(3):
        publish_random(home, seed)
    shutil.rmtree(home / "drafters" / "v000003")
    (home / "drafters" / LATEST_NAME).write_text("v000002\n")  # rolled back by hand
    assert _publish(home, 9) == "v000004"
    assert latest_version(home) == "v000004"


def test_stale_staging_is_swept_and_fresh_staging_is_kept(tmp_path):
    home = tmp_path / "home"
    publish_random(home, 0)
    d = home / "drafters"
    old = d / ".host.1.abc.stage"
    fresh = d / ".host.2.def.stage"
    old.mkdir()
    fresh.mkdir()
    past = time.time() - 2 * store.STALE_STAGING_S
    os.utime(old, (past, past))
    publish_random(home, 1)
    assert not old.exists() and fresh.exists()
    assert list_versions(home) == ["v000001", "v000002"]


def test_a_failed_publish_leaves_nothing_behind(tmp_path, monkeypatch):
    home = tmp_path / "home"
    publish_random(home, 0)

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(store, "_advance_latest", boom)
    with pytest.raises(OSError):
        publish_random(home, 1)
    leftovers = [p.name for p in (home / "drafters").iterdir() if p.name.endswith(".stage")]
    assert leftovers == []


def test_publish_checkpoint_and_verify(tmp_path):
    from sglang_adaflash.drafter.checkpoint import write_checkpoint

    cfg = drafter_config()
    src = write_checkpoint(tmp_path / "ckpt", cfg, random_state(cfg, 3))
    home = tmp_path / "home"
    v = store.publish_checkpoint(home, src, target=ANY_TARGET, parent=None,
                                 training={"algorithm": "manual"})
    assert verify_version(home, v)["training"] == {"algorithm": "manual"}
    assert read_checkpoint(home / "drafters" / v)[0].hidden_size == cfg.hidden_size
    (home / "drafters" / v / "model.safetensors").write_bytes(b"torn")
    with pytest.raises(CheckpointError, match="does not match"):
        verify_version(home, v)


def test_verify_version_refuses_a_renamed_directory(tmp_path):
    home = tmp_path / "home"
    publish_random(home, 0)
    shutil.copytree(home / "drafters" / "v000001", home / "drafters" / "v000007")
    with pytest.raises(CheckpointError, match="says version 'v000001'"):
        verify_version(home, "v000007")


def test_pin_writes_only_verified_versions(tmp_path):
    home = tmp_path / "home"
    publish_random(home, 0)
    pin = tmp_path / "fleet" / "drafter-version"
    write_pin(pin, home, "v000001")
    assert pin.read_text() == "v000001\n"
    with pytest.raises(CheckpointError, match="not published"):
        write_pin(pin, home, "v000002")
    assert pin.read_text() == "v000001\n"
    write_pin(pin, home, None)
    assert not pin.exists()


def test_a_directory_named_with_other_scripts_digits_is_not_a_version(tmp_path):
    """`\\d` matched fullwidth digits, and int() read `v００００08` as version 8."""
    home = tmp_path / "home"
    v1 = _publish(home, 0)
    (home / "drafters" / "v００００08").mkdir()
    (home / "drafters" / "v000009\n").mkdir()
    assert list_versions(home) == [v1]
    assert _publish(home, 1) == "v000002"  # numbering ignores them too
    for bad in ("v００００08", "v000009\n"):
        with pytest.raises(CheckpointError, match="is not of the form v000001"):
            verify_version(home, bad)
    (home / "drafters" / LATEST_NAME).write_text("v００００08\n")
    with pytest.raises(CheckpointError, match="is not a version"):
        latest_version(home)
