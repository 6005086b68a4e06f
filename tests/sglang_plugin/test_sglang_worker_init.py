"""The worker's start-up glue (planner, backend check, sinks, reloader) on CPU with fakes."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytestmark = pytest.mark.sglang
pytest.importorskip("sglang")

from sglang_adaflash.drafter.checkpoint import read_checkpoint, read_config  # noqa: E402
from sglang_adaflash.drafter.config import DrafterConfig  # noqa: E402
from sglang_adaflash.drafter.model import DFlashDrafter  # noqa: E402
from sglang_adaflash.drafter.store import publish_version  # noqa: E402
from sglang_adaflash.sglang_plugin.options import AdaFlashOptions  # noqa: E402
from sglang_adaflash.sglang_plugin.worker import AdaFlashWorkerV2  # noqa: E402

from .conftest import drafter_raw  # noqa: E402
from .fakes import FusedDraft  # noqa: E402


def bare_worker(draft_dir, mode="compact", ragged_backend=True, env=None):
    cfg = read_config(draft_dir)  # what the worker reads (SGLang loaded the weights)
    w = object.__new__(AdaFlashWorkerV2)
    w.__dict__.update(
        block_size=cfg.block_size,
        device=torch.device("cpu"),
        draft_model=FusedDraft(cfg),
        draft_parallel_layout=SimpleNamespace(tp_group=None),
        _target_worker=SimpleNamespace(
            model_runner=SimpleNamespace(
                attn_backend=SimpleNamespace(supports_ragged_verify_graph=ragged_backend)
            )
        ),
        _ada_tp_rank=0,
        _ada_tp_group=SimpleNamespace(world_size=1),
        _ada_opts=AdaFlashOptions.resolve(draft_dir, env=env or {}),
        _ada_mode=mode,
        _ada_ckpt=draft_dir,
        server_args=SimpleNamespace(model_path=None),
    )
    return w


def test_planner_loads_the_head_of_the_drafter(model_pair):
    w = bare_worker(model_pair["head"])
    planner = w._build_planner()
    assert planner.head is not None and planner.block_size == 8 and planner.rule == "load_aware"
    state = read_checkpoint(model_pair["head"])[1]
    torch.testing.assert_close(
        planner.head.out.bias, state["thresh_head_two_model.out.bias"].float()
    )


def test_head_missing_weights_keeps_compact_with_whole_blocks(model_pair, tmp_path):
    raw = drafter_raw(8, True)
    cfg = DrafterConfig.from_dict(raw)
    state = {k: v for k, v in DFlashDrafter(cfg).state_dict().items()}
    home = tmp_path / "home"
    v = publish_version(home, cfg, state, target={"name": "t", "config_sha256": "0" * 64})
    draft = home / "drafters" / v
    weights = draft / "model.safetensors"
    from safetensors.torch import load_file, save_file

    kept = {k: t for k, t in load_file(str(weights)).items() if not k.startswith("thresh_head")}
    save_file(kept, str(weights))
    w = bare_worker(draft, mode="compact")
    assert w._build_planner().head is None and w._ada_mode == "compact"
    w = bare_worker(draft, mode="cap")
    w._build_planner()
    assert w._ada_mode == "fixed"


def test_backend_check(model_pair, monkeypatch):
    from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2

    # The check runs once SGLang built the backends (test_sglang_cpu_engine.py: start-up order)
    built = []
    monkeypatch.setattr(DFlashWorkerV2, "init_attention_backends", lambda self: built.append(1))
    with pytest.raises(RuntimeError, match="--attention-backend fa3"):
        bare_worker(model_pair["head"], ragged_backend=False).init_attention_backends()
    assert built == [1]
    bare_worker(model_pair["head"])._ada_check_backend()
    with pytest.raises(RuntimeError, match="--attention-backend fa3"):
        bare_worker(model_pair["head"], ragged_backend=False)._ada_check_backend()
    bare_worker(model_pair["head"], mode="fixed", ragged_backend=False)._ada_check_backend()
    hybrid = bare_worker(model_pair["head"])
    hybrid._need_mamba_verify_commit = True
    with pytest.raises(RuntimeError, match="hybrid"):
        hybrid._ada_check_backend()


def test_sink_without_multiprocess_dir_logs_only(model_pair, monkeypatch):
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    sink = bare_worker(model_pair["head"])._build_sink()
    assert [type(s).__name__ for s in sink.sinks] == ["LoggingSink"]


def test_reloader_swaps_draft_and_head_in_place(model_pair, tmp_path, monkeypatch):
    home = tmp_path / "home"
    cfg = read_checkpoint(model_pair["head"])[0]
    fp = {"name": "target", "config_sha256": "0" * 64}
    torch.manual_seed(0)
    v1 = publish_version(home, cfg, DFlashDrafter(cfg).state_dict(), target=fp)
    desired = tmp_path / "desired"
    desired.write_text(v1)
    monkeypatch.setenv("ADAFLASH_HOME", str(home))
    monkeypatch.setenv("ADAFLASH_FLEET_VERSION_FILE", str(desired))
    monkeypatch.setenv("ADAFLASH_LOADED_VERSION_FILE", str(tmp_path / "status.json"))
    monkeypatch.setenv("ADAFLASH_RELOAD_POLL_S", "3600")  # the test polls by hand
    w = bare_worker(home / "drafters" / v1)
    w._ada_planner = w._build_planner()
    reloader = w._build_reloader(w._build_sink())
    try:
        assert reloader.status.loaded_version == v1
        torch.manual_seed(1)
        new_state = DFlashDrafter(cfg).state_dict()
        v2 = publish_version(home, cfg, new_state, target=fp)
        desired.write_text(v2)
        ptrs = [p.data_ptr() for p in w.draft_model.parameters()]
        reloader.poll_once()
        assert reloader.at_step_boundary() == v2
        assert [p.data_ptr() for p in w.draft_model.parameters()] == ptrs
        torch.testing.assert_close(
            w.draft_model.params["norm__weight"], new_state["norm.weight"].float()
        )
        torch.testing.assert_close(
            w._ada_planner.head.down.weight, new_state["thresh_head_two_model.down.weight"].float()
        )
    finally:
        reloader.stop()


def test_pod_stats_feed_tau_from_the_sink_and_count_the_request_log(model_pair, tmp_path):
    from sglang_adaflash.serving.metrics import AcceptanceWindow, SpecStepStats
    from sglang_adaflash.serving.reload import PodAnnotationReporter

    w = bare_worker(model_pair["head"])
    sink = w._build_sink()
    assert w._build_pod_stats([], sink) is None  # outside Kubernetes: nothing to publish
    bodies = []
    pod = PodAnnotationReporter("serve-0", "ml", transport=bodies.append)
    logdir = tmp_path / "traffic" / "serve-0"
    logdir.mkdir(parents=True)
    (logdir / "serve-0_0.log").write_text(
        '[t] {"timestamp": "t", "event": "request.finished", "rid": "a"}\n'
    )
    w.server_args = SimpleNamespace(
        model_path=None, log_requests=True, log_requests_target=[str(logdir)]
    )
    pub = w._build_pod_stats([pod], sink)
    assert isinstance(sink.sinks[-1], AcceptanceWindow) and pub.window is sink.sinks[-1]
    pub.window.min_drafts = 1
    sink.observe_step(SpecStepStats(8, [8, 8], [2, 4]))
    pub.tick()
    assert bodies[-1]["metadata"]["annotations"] == {
        "adaflash.io/acceptance-tau": "4.000",
        "adaflash.io/traffic-records": "1",
    }


def test_dp_attention_ranks_agree_only_with_the_ranks_of_their_batch(
    model_pair, tmp_path, monkeypatch
):
    """Under DP attention an idle DP rank runs neither the draft nor the reload point, so
    verify lengths and reload swaps must be agreed within the attention-TP group that shares
    the batch (SGLang's get_dp_tp_group), never across the whole TP group, which would hang."""
    from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2

    from sglang_adaflash.serving import reload as rl
    from sglang_adaflash.sglang_plugin import length_budget as lb
    from sglang_adaflash.sglang_plugin import worker as wmod

    draft = model_pair["head"]
    cfg = read_config(draft)

    def dflash_init(self, server_args, gpu_id, nccl_port, target_worker):
        self.__dict__.update(
            server_args=server_args,
            block_size=cfg.block_size,
            device=torch.device("cpu"),
            draft_model=FusedDraft(cfg),
            draft_parallel_layout=SimpleNamespace(tp_group=None),
            _target_worker=target_worker,
        )

    monkeypatch.setattr(DFlashWorkerV2, "__init__", dflash_init)
    whole_tp = SimpleNamespace(world_size=2, cpu_group="the whole TP group")
    monkeypatch.setattr(wmod, "get_parallel", lambda: SimpleNamespace(tp_rank=1, tp_group=whole_tp))
    monkeypatch.setattr(wmod, "get_dp_tp_group", lambda: SimpleNamespace(world_size=1))
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda *a, **k: pytest.fail("collective"))
    for name, value in {
        "ADAFLASH_RESOLVED_VERIFY_MODE": "cap",
        "ADAFLASH_HOME": str(tmp_path / "home"),
        "ADAFLASH_LOADED_VERSION_FILE": str(tmp_path / "status.json"),
        "ADAFLASH_RELOAD_POLL_S": "3600",
    }.items():
        monkeypatch.setenv(name, value)
    args = SimpleNamespace(speculative_draft_model_path=str(draft), model_path=None)
    w = AdaFlashWorkerV2(args, 0, 0, SimpleNamespace(model_runner=None))
    try:
        assert isinstance(w._ada_reloader.group, rl.SingleRank)
        plan = lb.VerifyPlan.from_lists([3, 8], cfg.block_size)
        assert w._agree_across_tp(plan) is plan
    finally:
        w._ada_reloader.stop()
