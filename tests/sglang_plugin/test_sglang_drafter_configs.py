"""Every drafter config SGLang's DFLASH serves, ADAFLASH serves; reloads keep each tensor's dtype.

The worker is built without ``__init__`` (SGLang's needs CUDA) and given what DFlash's own
``__init__`` would have resolved (``_mask_token``, ``_mask_token_id``); then its start-up glue
(config, planner, reloader) runs for real on drafters written in each spelling DFLASH reads,
and a second version in the same spelling is hot-reloaded into the live draft.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

pytestmark = pytest.mark.sglang
pytest.importorskip("sglang")

from sglang_adaflash.drafter.config import DrafterConfig  # noqa: E402
from sglang_adaflash.serving.metrics import NullSink  # noqa: E402
from sglang_adaflash.sglang_plugin.options import AdaFlashOptions  # noqa: E402
from sglang_adaflash.sglang_plugin.worker import AdaFlashWorkerV2  # noqa: E402
from sglang_adaflash.testing.fixtures import random_state  # noqa: E402

from .conftest import drafter_raw  # noqa: E402
from .fakes import FusedDraft  # noqa: E402

MASK_ID = 250  # what SGLang resolved the mask token string to (its tokenizer's id)


def spelled(kind: str, head: bool = True) -> dict:
    """The conftest drafter's config.json in one of the spellings DFLASH accepts."""
    raw = drafter_raw(8, head)
    d = raw["dflash_config"]
    if kind == "nested":  # num_target_layers and block_size inside dflash_config
        d["num_target_layers"] = raw.pop("num_target_layers")
        d["block_size"] = raw.pop("block_size")
    elif kind == "mask_string":  # the mask token named by its string only
        del d["mask_token_id"]
        d["mask_token"] = "<|MASK|>"
    elif kind == "layer_ids_only":  # no num_target_layers: SGLang uses max(ids) + 1
        del raw["num_target_layers"]
        d["target_layer_ids"] = [1, 3]
    elif kind == "top_level_mask_id":
        raw["mask_token_id"] = d.pop("mask_token_id")
    return raw


def write_drafter(path, raw, state, dtype=torch.float32):
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(raw))
    save_file({k: v.to(dtype).contiguous() for k, v in state.items()}, str(path / "model.safetensors"))
    return path


def canonical(raw) -> DrafterConfig:
    return DrafterConfig.from_dict(
        raw, resolved={"mask_token": "<|MASK|>", "mask_token_id": MASK_ID, "num_target_layers": 4}
    )


def worker(draft_dir, cfg, draft_model, mode="cap"):
    w = object.__new__(AdaFlashWorkerV2)
    w.__dict__.update(
        block_size=cfg.block_size,
        device=torch.device("cpu"),
        draft_model=draft_model,
        draft_parallel_layout=SimpleNamespace(tp_group=None),
        server_args=SimpleNamespace(model_path=None),
        _mask_token="<|MASK|>",  # DFlashWorkerV2.__init__ resolves these from the tokenizer
        _mask_token_id=MASK_ID,
        _ada_tp_rank=1,  # no pod reporters
        _ada_tp_group=SimpleNamespace(world_size=1),
        _ada_opts=AdaFlashOptions.resolve(draft_dir, env={}),
        _ada_mode=mode,
        _ada_ckpt=draft_dir,
        _target_worker=SimpleNamespace(),
    )
    w._ada_planner = w._build_planner()
    return w


@pytest.fixture
def reload_env(clean_env, tmp_path):
    home = tmp_path / "home"
    fleet = tmp_path / "fleet"
    clean_env.setenv("ADAFLASH_HOME", str(home))
    clean_env.setenv("ADAFLASH_FLEET_VERSION_FILE", str(fleet))
    clean_env.setenv("ADAFLASH_RELOAD_REQUIRE_MANIFEST", "0")
    clean_env.setenv("ADAFLASH_RELOAD_POLL_S", "3600")
    clean_env.setenv("ADAFLASH_LOADED_VERSION_FILE", str(tmp_path / "loaded.json"))
    clean_env.setenv("ADAFLASH_ADMIN_OVERRIDE_FILE", str(tmp_path / "override"))
    return home, fleet


@pytest.mark.parametrize("kind", ["nested", "mask_string", "layer_ids_only", "top_level_mask_id"])
def test_every_dflash_spelling_builds_plans_and_reloads(kind, reload_env, tmp_path):
    """Fails on a worker that reads config.json only in our canonical spelling: start-up dies
    in read_config (no top-level num_target_layers / no dflash_config.mask_token_id)."""
    home, fleet = reload_env
    raw = spelled(kind)
    cfg = canonical(raw)
    first = write_drafter(tmp_path / "start", raw, random_state(cfg, 1))
    draft = FusedDraft(cfg)
    w = worker(first, cfg, draft)
    live = w._drafter_config()
    assert live.num_target_layers == 4
    assert live.mask_token_id == (MASK_ID if kind == "mask_string" else 255)
    assert live.block_size == 8 and w._ada_opts.block_size == 8
    assert w._ada_planner.head is not None  # cap mode reads the length head
    reloader = w._build_reloader(NullSink())
    try:
        write_drafter(home / "drafters" / "v000002", raw, random_state(cfg, 2))
        fleet.write_text("v000002\n")
        reloader.poll_once()
        assert reloader.status.last_error is None, reloader.status.last_error
        assert reloader.at_step_boundary() == "v000002"
    finally:
        reloader.stop()
    want = random_state(cfg, 2)["fc.weight"]
    torch.testing.assert_close(draft.params["fc__weight"].data, want)


def test_a_changed_mask_token_string_is_not_given_the_live_id(reload_env, tmp_path):
    home, fleet = reload_env
    raw = spelled("mask_string")
    cfg = canonical(raw)
    w = worker(write_drafter(tmp_path / "start", raw, random_state(cfg, 1)), cfg, FusedDraft(cfg))
    reloader = w._build_reloader(NullSink())
    try:
        other = json.loads(json.dumps(raw))
        other["dflash_config"]["mask_token"] = "<|OTHER|>"
        write_drafter(home / "drafters" / "v000002", other, random_state(cfg, 2))
        fleet.write_text("v000002\n")
        reloader.poll_once()
        assert "mask_token_id" in (reloader.status.last_error or "")
    finally:
        reloader.stop()


def test_reload_keeps_each_tensors_checkpoint_dtype(reload_env, tmp_path):
    """The live draft holds bf16 matrices and float32 norms (its first parameter is bf16); the
    checkpoint is float32. The reload must hand SGLang's loader the checkpoint's float32 values,
    as start-up did. Fails when one dtype (the first live parameter's) is used for all:
    the norms come back rounded through bf16."""
    home, fleet = reload_env
    raw = drafter_raw(8, True)
    cfg = DrafterConfig.from_dict(raw)
    draft = FusedDraft(cfg)
    for name, p in draft.params.items():
        if "norm" not in name:
            p.data = p.data.to(torch.bfloat16)
    assert next(draft.parameters()).dtype == torch.bfloat16
    w = worker(write_drafter(tmp_path / "start", raw, random_state(cfg, 1)), cfg, draft)
    reloader = w._build_reloader(NullSink())
    try:
        new = random_state(cfg, 2)
        new = {k: v + 1e-3 * torch.randn(v.shape) if "norm" in k else v for k, v in new.items()}
        write_drafter(home / "drafters" / "v000002", raw, new)
        fleet.write_text("v000002\n")
        reloader.poll_once()
        assert reloader.at_step_boundary() == "v000002"
    finally:
        reloader.stop()
    norm = draft.params["layers__0__input_layernorm__weight"]
    assert norm.dtype == torch.float32
    assert torch.equal(norm.data, new["layers.0.input_layernorm.weight"])


def test_a_quantized_draft_refuses_reload_with_the_fix(reload_env, tmp_path):
    home, fleet = reload_env
    raw = drafter_raw(8, True)
    cfg = DrafterConfig.from_dict(raw)
    draft = FusedDraft(cfg)

    class Fp8LinearMethod:  # what SGLang's fp8 quantization puts on each linear layer
        pass

    draft.fc = torch.nn.Module()
    draft.fc.quant_method = Fp8LinearMethod()
    before = draft.params["fc__weight"].detach().clone()
    w = worker(write_drafter(tmp_path / "start", raw, random_state(cfg, 1)), cfg, draft)
    reloader = w._build_reloader(NullSink())
    try:
        write_drafter(home / "drafters" / "v000002", raw, random_state(cfg, 2))
        fleet.write_text("v000002\n")
        reloader.poll_once()
        assert reloader.at_step_boundary() is None
        assert "--speculative-draft-model-quantization unquant" in reloader.status.last_error
    finally:
        reloader.stop()
    assert torch.equal(draft.params["fc__weight"].data, before)
