"""Hot reload against a real (tiny) drafter module on CPU: in place, verified, rolled back."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from sglang_adaflash.drafter.model import DFlashDrafter
from sglang_adaflash.serving.metrics import NullSink
from sglang_adaflash.serving.reload import (
    DesiredVersionSource,
    HotReloader,
    ModuleTarget,
    PodAnnotationReporter,
    ReloadError,
    SingleRank,
    StatusFileReporter,
    TorchDistGroup,
    apply_in_place,
    parse_downward_annotations,
    read_latest,
    read_status,
    reporters_from_env,
    resolve_version_dir,
    stage_drafter,
    version_number,
)
from sglang_adaflash.testing.fixtures import (
    drafter_config,
    publish_random,
    random_drafter,
    random_state,
)


class RecordingSink(NullSink):
    def __init__(self):
        self.reloads: list[str] = []
        self.versions: list[str] = []

    def count_reload(self, result):
        self.reloads.append(result)

    def set_drafter_version(self, version):
        self.versions.append(version)


@pytest.fixture
def served(tmp_path):
    """A shared volume with v000001 published and a live drafter built from it."""
    home = tmp_path / "home"
    v1 = publish_random(home, seed=1)
    cfg = drafter_config()
    live = random_drafter(cfg, 1)
    version_file = tmp_path / "desired"
    version_file.write_text(v1 + "\n")
    sink = RecordingSink()
    reloader = HotReloader(
        source=DesiredVersionSource(home=home, version_file=version_file),
        target=ModuleTarget(live),
        loaded_version=v1,
        live_config=cfg,
        sink=sink,
        reporters=[StatusFileReporter(tmp_path / "status.json")],
        report_async=False,
    )
    return dict(home=home, live=live, reloader=reloader, sink=sink, file=version_file, tmp=tmp_path)


def _snapshot(module):
    return {k: (v.data_ptr(), v.detach().clone()) for k, v in module.state_dict().items()}


def _assert_weights(module, expected: dict[str, torch.Tensor]):
    for k, v in module.state_dict().items():
        assert torch.equal(v, expected[k]), k


def test_version_names():
    assert version_number("v000042") == 42
    for bad in ["v42", "42", "v000001/..", "../v000001", "latest"]:
        with pytest.raises(ValueError, match="v000001"):
            version_number(bad)


def test_resolve_version_dir_follows_latest_and_refuses_escapes(tmp_path):
    v1 = publish_random(tmp_path, seed=1)
    assert resolve_version_dir(tmp_path, "latest") == tmp_path / "drafters" / v1
    with pytest.raises(ValueError):
        resolve_version_dir(tmp_path, "../../etc")


def test_downward_api_annotations_parse():
    text = (
        'kubernetes.io/config.seen="2026-11-30T09:00:00Z"\n'
        'adaflash.io/desired-drafter-version="v000007"\n'
        'note="say \\"hi\\"\\nthere"\n'
        "garbage line\n"
    )
    ann = parse_downward_annotations(text)
    assert ann["adaflash.io/desired-drafter-version"] == "v000007"
    assert ann["note"] == 'say "hi"\nthere'
    assert "garbage line" not in ann


def test_desired_version_priority(tmp_path):
    publish_random(tmp_path, seed=1)
    publish_random(tmp_path, seed=2)  # latest = v000002
    fleet, ann, override = tmp_path / "fleet", tmp_path / "annotations", tmp_path / "override"
    src = DesiredVersionSource(
        home=tmp_path, version_file=fleet, annotations_file=ann, override_file=override
    )
    assert src.read() is None
    src.follow_latest = True
    assert src.read() == ("v000002", "drafters/latest (latest)")
    fleet.write_text("v000001\n")
    assert src.read() == ("v000001", "fleet version file")
    ann.write_text('adaflash.io/desired-drafter-version="v000005"\n')
    assert src.read() == ("v000005", "pod annotation")
    override.write_text("latest")
    assert src.read() == ("v000002", "admin override (latest)")
    override.write_text("not-a-version")
    assert src.read() == ("v000005", "pod annotation")


NOT_UTF8 = b"\xff\xfev000001\n"


def test_version_files_that_are_not_text_are_ignored(tmp_path, caplog):
    publish_random(tmp_path, seed=1)
    fleet, ann, override = tmp_path / "fleet", tmp_path / "annotations", tmp_path / "override"
    src = DesiredVersionSource(
        home=tmp_path,
        version_file=fleet,
        annotations_file=ann,
        override_file=override,
        follow_latest=True,
    )
    (tmp_path / "drafters" / "latest").write_bytes(NOT_UTF8)
    assert read_latest(tmp_path) is None
    assert src.read() is None
    assert "drafters/latest: it is not text" in caplog.text
    fleet.write_text("v000001\n")
    ann.write_bytes(NOT_UTF8)
    override.write_bytes(NOT_UTF8)
    assert src.read() == ("v000001", "fleet version file")  # the sources below still count
    assert f"ignoring {override}: it is not UTF-8" in caplog.text
    assert f"ignoring {ann}: it is not UTF-8" in caplog.text
    fleet.write_bytes(NOT_UTF8)
    assert src.read() is None


def test_watcher_keeps_serving_when_the_version_file_is_not_text(served):
    served["file"].write_bytes(NOT_UTF8)
    assert served["reloader"].poll_once() is None
    assert served["reloader"].status.loaded_version == "v000001"
    assert served["reloader"].at_step_boundary() is None


def test_status_file_that_is_not_text_reads_as_an_error(tmp_path):
    (tmp_path / "status.json").write_bytes(b'{"loaded_version": "v\xff"}')
    status = read_status(tmp_path / "status.json")
    assert status["loaded_version"] is None and "not valid JSON" in status["error"]


def test_desired_version_from_env(tmp_path):
    env = {
        "ADAFLASH_HOME": str(tmp_path),
        "ADAFLASH_FLEET_VERSION_FILE": str(tmp_path / "f"),
        "ADAFLASH_POD_ANNOTATIONS_FILE": str(tmp_path / "a"),
        "ADAFLASH_FOLLOW_LATEST": "true",
    }
    src = DesiredVersionSource.from_env(env)
    assert src.home == tmp_path and src.follow_latest
    assert src.annotations_file == tmp_path / "a" and src.override_file is None


def test_reload_copies_in_place(served):
    live, reloader, sink = served["live"], served["reloader"], served["sink"]
    before = _snapshot(live)
    assert reloader.at_step_boundary() is None  # nothing staged: no work
    v2 = publish_random(served["home"], seed=2)
    served["file"].write_text(v2)
    staged = reloader.poll_once()
    assert staged is not None and staged.version == v2
    _assert_weights(live, {k: v for k, (_, v) in before.items()})  # not swapped yet
    assert reloader.at_step_boundary() == v2
    for name, tensor in live.state_dict().items():
        assert tensor.data_ptr() == before[name][0], f"{name} was replaced, not copied into"
    _assert_weights(live, random_state(drafter_config(), 2))
    assert reloader.status.loaded_version == v2
    # its manifest goes to the engine with the swap (its eval seeds the calibration: planner.prior)
    assert reloader.loaded_manifest == json.loads((served["home"] / "drafters" / v2 / "manifest.json").read_text())
    assert sink.reloads == ["success"] and sink.versions[-1] == v2
    status = json.loads((served["tmp"] / "status.json").read_text())
    assert status["loaded_version"] == v2 and status["last_error"] is None
    assert reloader.poll_once() is None and reloader.at_step_boundary() is None


def test_tampered_checkpoint_is_rejected_and_old_weights_kept(served):
    live, reloader, sink = served["live"], served["reloader"], served["sink"]
    before = {k: v.clone() for k, v in live.state_dict().items()}
    v2 = publish_random(served["home"], seed=2)
    weights = served["home"] / "drafters" / v2 / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # flip one bit of the last weight: the manifest hash no longer matches
    weights.write_bytes(bytes(data))
    served["file"].write_text(v2)
    assert reloader.poll_once() is None
    assert reloader.at_step_boundary() is None
    _assert_weights(live, before)
    assert sink.reloads == ["rejected"]
    assert "sha256" in reloader.status.last_error and reloader.status.last_error_version == v2
    assert reloader.status.loaded_version == "v000001"
    reloader.poll_once()  # unchanged bytes: not retried, not counted again
    assert sink.reloads == ["rejected"]


def test_torn_write_is_retried_once_complete(served):
    live, reloader, sink = served["live"], served["reloader"], served["sink"]
    v2 = publish_random(served["home"], seed=2)
    weights = served["home"] / "drafters" / v2 / "model.safetensors"
    full = weights.read_bytes()
    weights.write_bytes(full[: len(full) // 2])  # a copy that is still in progress
    served["file"].write_text(v2)
    assert reloader.poll_once() is None
    assert sink.reloads == ["rejected"]
    assert reloader.at_step_boundary() is None
    weights.write_bytes(full)  # the copy completes: new size and mtime
    assert reloader.poll_once().version == v2
    assert reloader.at_step_boundary() == v2
    _assert_weights(live, random_state(drafter_config(), 2))
    assert sink.reloads == ["rejected", "success"]


def test_unpublished_directory_needs_a_manifest(served):
    v2 = publish_random(served["home"], seed=2)
    (served["home"] / "drafters" / v2 / "manifest.json").unlink()
    served["file"].write_text(v2)
    assert served["reloader"].poll_once() is None
    assert "no manifest.json" in served["reloader"].status.last_error


def test_architecture_change_is_rejected(served):
    v2 = publish_random(served["home"], seed=2, cfg=drafter_config(intermediate_size=48))
    served["file"].write_text(v2)
    assert served["reloader"].poll_once() is None
    err = served["reloader"].status.last_error
    assert "intermediate_size" in err and "restart" in err


def test_missing_version_is_rejected(served):
    served["file"].write_text("v000099")
    assert served["reloader"].poll_once() is None
    assert "not found" in served["reloader"].status.last_error


def test_stage_checks_names_against_the_live_target(tmp_path):
    v1 = publish_random(tmp_path, seed=1)
    expected = ModuleTarget(DFlashDrafter(drafter_config())).expected()
    expected["extra.weight"] = ((2,), torch.float32)
    with pytest.raises(ReloadError, match="lacks 1 weights"):
        stage_drafter(tmp_path / "drafters" / v1, version=v1, expected=expected)
    del expected["extra.weight"]
    del expected["norm.weight"]
    with pytest.raises(ReloadError, match="has 1 weights the serving drafter does not"):
        stage_drafter(tmp_path / "drafters" / v1, version=v1, expected=expected)


def test_stage_casts_to_the_live_dtype(tmp_path):
    v1 = publish_random(tmp_path, seed=1)
    live = DFlashDrafter(drafter_config()).to(torch.bfloat16)
    staged = stage_drafter(
        tmp_path / "drafters" / v1, version=v1, expected=ModuleTarget(live).expected()
    )
    assert {t.dtype for t in staged.state.values()} == {torch.bfloat16}


class _FailingTarget(ModuleTarget):
    """Copies half of the weights, then fails, like a device error in the middle of a copy."""

    def write(self, state):
        names = sorted(state)
        super().write({k: state[k] for k in names[: len(names) // 2]})
        raise RuntimeError("simulated device error")


class _ReplacingTarget(ModuleTarget):
    """Swaps parameter storage instead of copying: CUDA graphs would keep the old pointers."""

    def write(self, state):
        for name, p in self.module.named_parameters():
            p.data = state[name].clone()


@pytest.mark.parametrize(
    "target_cls, match", [(_FailingTarget, "simulated"), (_ReplacingTarget, "replaced")]
)
def test_failed_copy_restores_old_weights(served, target_cls, match):
    live = served["live"]
    before = {k: v.clone() for k, v in live.state_dict().items()}
    staged = stage_drafter(
        served["home"] / "drafters" / publish_random(served["home"], seed=2),
        version="v000002",
        expected=ModuleTarget(live).expected(),
    )
    with pytest.raises(ReloadError, match=match):
        apply_in_place(target_cls(live), staged.state)
    _assert_weights(live, before)


def test_refresh_hook_runs_after_a_copy(served):
    calls = []
    live = served["live"]
    target = ModuleTarget(live, refresh=lambda: calls.append(live.norm.weight.clone()))
    staged = stage_drafter(
        served["home"] / "drafters" / publish_random(served["home"], seed=2),
        version="v000002",
        expected=target.expected(),
    )
    apply_in_place(target, staged.state)
    assert len(calls) == 1 and torch.equal(calls[0], staged.state["norm.weight"])


class _ThreadGroup:
    """A fake tensor-parallel group: ranks are threads that meet at a barrier."""

    def __init__(self, size):
        self.size = size
        self._barrier = threading.Barrier(size)
        self._values: dict[int, list[int]] = {}
        self._lock = threading.Lock()

    def rank(self, r):
        group = self

        class Rank:
            size = group.size

            def all_min(self, values):
                with group._lock:
                    group._values[r] = values
                group._barrier.wait(timeout=10)
                out = [min(col) for col in zip(*group._values.values())]
                group._barrier.wait(timeout=10)
                return out

        return Rank()


def _tp_reloaders(tmp_path, targets, group):
    home = tmp_path / "home"
    desired = tmp_path / "desired"
    desired.write_text("v000001")
    out = []
    for r, target in enumerate(targets):
        out.append(
            HotReloader(
                source=DesiredVersionSource(home=home, version_file=desired),
                target=target,
                loaded_version="v000001",
                group=group.rank(r),
                sync_every_steps=2,
                report_async=False,
            )
        )
    return home, desired, out


def _run_ranks(reloaders, steps):
    results = [[] for _ in reloaders]

    def run(i):
        for _ in range(steps):
            results[i].append(reloaders[i].at_step_boundary())

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(reloaders))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return results


def test_tp_ranks_swap_on_the_same_step(tmp_path):
    cfg = drafter_config()
    lives = [DFlashDrafter(cfg) for _ in range(2)]
    home, desired, (r0, r1) = _tp_reloaders(
        tmp_path, [ModuleTarget(m) for m in lives], _ThreadGroup(2)
    )
    publish_random(home, seed=1)
    v2 = publish_random(home, seed=2)
    desired.write_text(v2)
    r0.poll_once()  # rank 1 has not staged yet: nobody swaps
    assert _run_ranks([r0, r1], 4) == [[None] * 4, [None] * 4]
    r1.poll_once()
    assert _run_ranks([r0, r1], 2) == [[None, v2], [None, v2]]  # checks every 2nd step
    for m in lives:
        _assert_weights(m, random_state(cfg, 2))


def test_tp_rank_failure_rolls_back_every_rank(tmp_path):
    cfg = drafter_config()
    lives = [random_drafter(cfg, 1) for _ in range(2)]
    targets = [ModuleTarget(lives[0]), _FailingTarget(lives[1])]
    home, desired, (r0, r1) = _tp_reloaders(tmp_path, targets, _ThreadGroup(2))
    publish_random(home, seed=1)
    desired.write_text(publish_random(home, seed=2))
    r0.poll_once()
    r1.poll_once()
    assert _run_ranks([r0, r1], 2) == [[None, None], [None, None]]
    for m in lives:
        _assert_weights(m, random_state(cfg, 1))
    assert r0.status.reloads == {"rolled_back": 1} and r1.status.reloads == {"failed": 1}
    assert r0.status.loaded_version == r1.status.loaded_version == "v000001"


def test_torch_dist_group_all_min(tmp_path):
    import torch.distributed as dist

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        assert TorchDistGroup().all_min([3, -3, 1]) == [3, -3, 1]
    finally:
        dist.destroy_process_group()


def test_watcher_thread_stages_in_background(served):
    reloader = served["reloader"]
    reloader.poll_interval_s = 0.02
    v2 = publish_random(served["home"], seed=2)
    reloader.start()
    try:
        served["file"].write_text(v2)
        deadline = time.monotonic() + 20
        while reloader.status.staged_version != v2 and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        reloader.stop()
    assert reloader.at_step_boundary() == v2


def test_watcher_can_be_stopped_and_started_again(served):
    reloader = served["reloader"]
    reloader.poll_interval_s = 0.02
    reloader.start()
    reloader.stop()
    v2 = publish_random(served["home"], seed=2)
    served["file"].write_text(v2)
    reloader.start()
    try:
        deadline = time.monotonic() + 5
        while reloader.status.staged_version != v2 and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        reloader.stop()
    assert reloader.status.staged_version == v2


def test_single_rank_group_is_identity():
    assert SingleRank().all_min([1, 2]) == [1, 2]


class _Recorder(BaseHTTPRequestHandler):
    seen: list = []

    def do_PATCH(self):  # noqa: N802 - http.server naming
        body = self.rfile.read(int(self.headers["Content-Length"]))
        type(self).seen.append((self.path, dict(self.headers), json.loads(body)))
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args):
        pass


def test_pod_annotation_reporter_patches_the_pod():
    _Recorder.seen = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        rep = PodAnnotationReporter(
            "serve-0",
            "ns1",
            api_url=f"http://127.0.0.1:{server.server_address[1]}",
            token="tok",
            ca_file=None,
        )
        rep.report({"loaded_version": "v000003"})
        rep.report({"loaded_version": "v000003"})  # unchanged: no call
        rep.report({"loaded_version": "v000003", "last_error": "x", "last_error_version": "v4"})
    finally:
        server.shutdown()
    assert len(_Recorder.seen) == 2
    path, headers, body = _Recorder.seen[0]
    assert path == "/api/v1/namespaces/ns1/pods/serve-0"
    assert headers["Content-Type"] == "application/merge-patch+json"
    assert headers["Authorization"] == "Bearer tok"
    assert body == {
        "metadata": {
            "annotations": {
                "adaflash.io/loaded-drafter-version": "v000003",
                "adaflash.io/drafter-load-error": None,  # clears one left by an earlier container
            }
        }
    }
    assert _Recorder.seen[1][2] == {
        "metadata": {"annotations": {"adaflash.io/drafter-load-error": "v4: x"}}
    }


def test_reporters_from_env(tmp_path):
    assert reporters_from_env({}) == []
    reps = reporters_from_env(
        {
            "ADAFLASH_LOADED_VERSION_FILE": str(tmp_path / "s.json"),
            "KUBERNETES_SERVICE_HOST": "10.0.0.1",
            "POD_NAME": "p",
            "POD_NAMESPACE": "n",
        }
    )
    assert [type(r).__name__ for r in reps] == ["StatusFileReporter", "PodAnnotationReporter"]
    assert reps[1].api_url == "https://10.0.0.1:443"


def test_drafter_for_another_target_is_rejected(tmp_path):
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text('{"hidden_size": 16}')
    home = tmp_path / "home"
    v1 = publish_random(home, seed=1)  # its manifest names a target with another config hash
    expected = ModuleTarget(DFlashDrafter(drafter_config())).expected()
    with pytest.raises(ReloadError, match="was built for target 'tiny-target'"):
        stage_drafter(home / "drafters" / v1, version=v1, expected=expected, target_dir=target)
    from sglang_adaflash.drafter.manifest import target_fingerprint

    v2 = publish_random(home, seed=2, target=target_fingerprint(target))
    staged = stage_drafter(home / "drafters" / v2, version=v2, expected=expected, target_dir=target)
    assert staged.version == v2
