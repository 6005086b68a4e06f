"""Worker-side pieces that need no sglang: head loading, draft reload target, stats matching."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from sglang_adaflash.drafter.length_head import AdaptiveLengthHead
from sglang_adaflash.serving.metrics import NullSink
from sglang_adaflash.serving.reload import (
    CompositeTarget,
    DesiredVersionSource,
    HotReloader,
    ModuleTarget,
)
from sglang_adaflash.sglang_plugin.runtime import (
    HeadLoadError,
    SGLangDraftTarget,
    StepStatsQueue,
    checkpoint_dtypes,
    expected_draft_spec,
    initial_version,
    load_length_head,
    refresh_fused_kv_helper,
)
from sglang_adaflash.testing.fixtures import drafter_config, publish_random, random_state

from .fakes import FusedDraft

CFG = drafter_config(num_hidden_layers=2)


def test_length_head_loads_the_checkpoint_weights(tmp_path):
    home = tmp_path / "home"
    v = publish_random(home, seed=1, cfg=CFG)
    head = load_length_head(home / "drafters" / v, 16, 8, "cpu")
    ref = AdaptiveLengthHead(16, 8)
    ref.load_state_dict(
        {
            k.removeprefix("thresh_head_two_model."): t
            for k, t in random_state(CFG, 1).items()
            if k.startswith("thresh_head_two_model.")
        }
    )
    x = torch.randn(3, 4, 16)
    torch.testing.assert_close(head(x), ref(x))
    assert head.down.weight.dtype == torch.float32


def test_length_head_errors(tmp_path):
    save_file({"fc.weight": torch.zeros(2, 2)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(HeadLoadError, match="no thresh_head_two_model"):
        load_length_head(tmp_path, 16, 8, "cpu")
    save_file(
        {
            f"thresh_head_two_model.{k}": v
            for k, v in AdaptiveLengthHead(16, 4).state_dict().items()
        },
        str(tmp_path / "model.safetensors"),
    )
    with pytest.raises(HeadLoadError, match="thresh_head_bottleneck_dim"):
        load_length_head(tmp_path, 16, 8, "cpu")


def test_initial_version(tmp_path):
    d = tmp_path / "v000004"
    d.mkdir()
    assert initial_version(d, env={}) == "v000004"
    (d / "manifest.json").write_text(json.dumps({"version": "v000009"}))
    assert initial_version(d, env={}) == "v000009"
    assert initial_version(d, env={"ADAFLASH_DRAFTER_VERSION": "v000001"}) == "v000001"
    other = tmp_path / "my-drafter"
    other.mkdir()
    assert initial_version(other, env={}) == "initial:my-drafter"


def test_sglang_draft_target_reloads_in_place_with_the_head(tmp_path):
    cfg = CFG
    home = tmp_path / "home"
    v1 = publish_random(home, seed=1, cfg=cfg)
    draft = FusedDraft(cfg)
    head = AdaptiveLengthHead(16, 8)
    refreshed = []
    target = CompositeTarget(
        {
            "draft": SGLangDraftTarget(
                draft,
                expected_draft_spec(cfg, checkpoint_dtypes(home / "drafters" / v1)),
                refresh=lambda: refreshed.append(1),
            ),
            "head": ModuleTarget(head, prefix="thresh_head_two_model."),
        }
    )
    desired = tmp_path / "desired"
    desired.write_text(v1)
    reloader = HotReloader(
        source=DesiredVersionSource(home=home, version_file=desired),
        target=target,
        loaded_version=None,
        live_config=cfg,
        report_async=False,
    )
    ptrs = {n: t.data_ptr() for n, t in target.live_tensors().items()}
    reloader.poll_once()
    assert reloader.at_step_boundary() == v1
    assert {n: t.data_ptr() for n, t in target.live_tensors().items()} == ptrs
    s1 = random_state(cfg, 1)
    qkv = draft.params["layers__0__self_attn__qkv_proj__weight"]
    torch.testing.assert_close(qkv[: draft.q], s1["layers.0.self_attn.q_proj.weight"])
    torch.testing.assert_close(qkv[draft.q + draft.kv :], s1["layers.0.self_attn.v_proj.weight"])
    torch.testing.assert_close(head.out.bias, s1["thresh_head_two_model.out.bias"])
    assert refreshed == [1]


def test_refresh_fused_kv_helper_in_place():
    q, kv, hidden, layers_n = 4, 2, 3, 2
    layers = [
        SimpleNamespace(
            self_attn=SimpleNamespace(
                qkv_proj=SimpleNamespace(weight=torch.randn(q + 2 * kv, hidden)),
                k_norm=SimpleNamespace(weight=torch.randn(kv)),
                q_size=q,
                kv_size=kv,
            )
        )
        for _ in range(layers_n)
    ]
    helper = SimpleNamespace(
        flat_kv_weight_t=torch.zeros(hidden, layers_n * 2 * kv),
        k_norm_weights=torch.zeros(layers_n, kv),
    )
    ptr = helper.flat_kv_weight_t.data_ptr()
    refresh_fused_kv_helper(helper, layers)
    # Reference: the stacked k/v rows of every layer, transposed.
    ref = torch.cat([lay.self_attn.qkv_proj.weight[q:] for lay in layers]).t()
    torch.testing.assert_close(helper.flat_kv_weight_t, ref)
    torch.testing.assert_close(helper.k_norm_weights[1], layers[1].self_attn.k_norm.weight)
    assert helper.flat_kv_weight_t.data_ptr() == ptr
    refresh_fused_kv_helper(None, layers)  # no helper: nothing to do


class _Rec(NullSink):
    def __init__(self):
        self.steps = []

    def observe_step(self, stats):
        self.steps.append(stats)


def test_step_stats_queue_matches_steps_in_order():
    sink = _Rec()
    q = StepStatsQueue(sink)
    q.push(4, [4, 2], ["code", None])
    q.push(4, [3], None)
    s = q.complete([3, 5])  # SGLang's count above the verify length is clamped to L - 1
    assert s.accept_lengths == [3, 1] and s.domains == ["code", None]
    s = q.complete([1])
    assert s.candidate_lengths == [3] and s.accept_lengths == [1]
    assert q.complete([0]) is None
    q.push(4, [4, 4], None)
    q.push(4, [2], None)
    assert q.complete([1]).candidate_lengths == [2]  # the unmatched step is dropped
    assert len(sink.steps) == 3
