"""Registration through the entry point, CLI parsing and server-arg handling on sglang==0.5.23."""

from __future__ import annotations

from importlib.metadata import entry_points

import pytest

pytestmark = pytest.mark.sglang
sglang = pytest.importorskip("sglang")

from sglang.srt.speculative.spec_info import SpeculativeAlgorithm  # noqa: E402
from sglang.srt.speculative.spec_registry import get_spec  # noqa: E402

from sglang_adaflash.sglang_plugin.spec import AdaFlashSpecAlgo  # noqa: E402


def _entry_point():
    found = [ep for ep in entry_points(group="sglang.srt.plugins") if ep.name == "adaflash"]
    assert found, (
        "no 'adaflash' entry point in group sglang.srt.plugins: reinstall the package "
        "(pip install -e '.[sglang]') after editing pyproject.toml"
    )
    return found[0]


def test_entry_point_registers_adaflash_idempotently(sglang_registry):
    sglang_registry.pop("ADAFLASH", None)
    with pytest.raises(ValueError, match="Unknown speculative algorithm"):
        SpeculativeAlgorithm.from_string("ADAFLASH")
    ep = _entry_point()
    assert ep.value == "sglang_adaflash.sglang_plugin:register"
    register = ep.load()
    register()
    first = get_spec("ADAFLASH")
    assert isinstance(first, AdaFlashSpecAlgo) and first.supports_overlap
    register()  # SGLang calls plugins once per process; a second call must change nothing
    assert get_spec("ADAFLASH") is first
    assert SpeculativeAlgorithm.from_string("adaflash") is first


def test_sglang_plugin_loader_runs_our_entry_point(sglang_registry, monkeypatch):
    import sglang.srt.plugins as plugins

    sglang_registry.pop("ADAFLASH", None)
    monkeypatch.setenv("SGLANG_PLUGINS", "adaflash")
    monkeypatch.setattr(plugins, "_plugins_loaded", False)
    loaded = plugins.load_plugins_by_group(plugins.GENERAL_PLUGINS_GROUP)
    assert set(loaded) == {"adaflash"}
    func, dist = loaded["adaflash"]
    func()
    assert dist == "sglang-adaflash"
    assert isinstance(get_spec("ADAFLASH"), AdaFlashSpecAlgo)


def test_foreign_registration_of_the_name_is_reported(sglang_registry):
    from sglang.srt.speculative.spec_registry import CustomSpecAlgo

    from sglang_adaflash.sglang_plugin import register

    sglang_registry.pop("ADAFLASH", None)
    sglang_registry["ADAFLASH"] = CustomSpecAlgo("ADAFLASH", lambda args: None)
    with pytest.raises(RuntimeError, match="already registered by another plugin"):
        register()


@pytest.fixture
def registered(sglang_registry):
    from sglang_adaflash.sglang_plugin import register

    register()
    return get_spec("ADAFLASH")


def _resolve(pair, draft, *extra):
    from sglang.srt.arg_groups.overrides import resolving_view
    from sglang.srt.server_args import prepare_server_args

    args = prepare_server_args(
        [
            "--model-path",
            str(pair["target"]),
            "--speculative-algorithm",
            "ADAFLASH",
            "--speculative-draft-model-path",
            str(draft),
            "--device",
            "cuda",
            *extra,
        ]
    )
    args.resolve_once()
    return resolving_view(args)


def test_cli_accepts_adaflash(registered):
    from sglang.srt.server_args import prepare_server_args

    args = prepare_server_args(["--model-path", "m", "--speculative-algorithm", "adaflash"])
    assert args.speculative_algorithm == "adaflash"  # upper-cased during resolution
    assert SpeculativeAlgorithm.from_string(args.speculative_algorithm) is registered


def test_resolution_gives_dflash_defaults_and_compact(registered, model_pair, clean_env):
    import os

    cfg = _resolve(model_pair, model_pair["head"], "--attention-backend", "fa3")
    assert cfg.speculative_algorithm == "ADAFLASH"
    assert cfg.speculative_num_draft_tokens == 8  # the drafter's block_size
    assert (cfg.speculative_num_steps, cfg.speculative_eagle_topk) == (1, 1)
    assert cfg.max_running_requests == 48
    assert cfg.speculative_draft_attention_backend is not None
    assert os.environ["ADAFLASH_RESOLVED_VERIFY_MODE"] == "compact"
    assert os.environ["SGLANG_RAGGED_VERIFY_MODE"] == "compact"
    assert registered.supports_ragged_verify()


def test_block_size_from_another_drafter(registered, model_pair, clean_env):
    import os

    cfg = _resolve(model_pair, model_pair["nohead"])
    assert cfg.speculative_num_draft_tokens == 4
    assert os.environ["ADAFLASH_RESOLVED_VERIFY_MODE"] == "fixed"  # no head: plain DFlash
    assert not registered.supports_ragged_verify()


def test_block_size_flag_must_match_the_drafter(registered, model_pair, clean_env):
    with pytest.raises(ValueError, match="differs from the drafter's block_size 8"):
        _resolve(model_pair, model_pair["head"], "--speculative-num-draft-tokens", "16")


def test_auto_picks_compact_on_triton(registered, model_pair, clean_env, capfd):
    """The plugin extends SGLang's Triton backend with ragged verify (backends.py), so auto
    resolves compact there and the start-up message names the backend and the mode."""
    import os

    _resolve(model_pair, model_pair["head"], "--attention-backend", "triton")
    assert os.environ["ADAFLASH_RESOLVED_VERIFY_MODE"] == "compact"
    assert os.environ["SGLANG_RAGGED_VERIFY_MODE"] == "compact"
    assert "verify mode compact on target attention backend 'triton'" in capfd.readouterr().err


@pytest.mark.parametrize("backend", ["flashinfer", "torch_native"])
def test_backend_without_ragged_verify_falls_back_in_auto(
    registered, model_pair, clean_env, backend, capfd
):
    import os

    _resolve(model_pair, model_pair["head"], "--attention-backend", backend)
    assert os.environ["ADAFLASH_RESOLVED_VERIFY_MODE"] == "fixed"
    assert "SGLANG_RAGGED_VERIFY_MODE" not in os.environ
    # SGLang configures its own log handler on stderr, so read the stream, not caplog.
    err = capfd.readouterr().err
    assert f"verify mode fixed on target attention backend '{backend}'" in err
    assert (
        f"falling back to fixed-length DFlash verification because attention backend '{backend}'"
        in err
    )
    # SGLang's automatic choice gives ADAFLASH flashinfer on Blackwell; the message says so
    assert ("--attention-backend trtllm_mha" in err) == (backend == "flashinfer")


def test_compact_on_flashinfer_only_when_asked_for(registered, model_pair, clean_env, capfd):
    """FlashInfer verifies ragged layouts through the plugin eagerly only (no CUDA graphs for
    the verify forward), so auto keeps fixed there (the test above) and an explicit compact
    resolves compact and says it is eager."""
    import os

    clean_env.setenv("ADAFLASH_VERIFY_MODE", "compact")
    _resolve(model_pair, model_pair["head"], "--attention-backend", "flashinfer")
    assert os.environ["ADAFLASH_RESOLVED_VERIFY_MODE"] == "compact"
    err = capfd.readouterr().err
    assert "verify mode compact on target attention backend 'flashinfer'" in err
    assert "eager verify forward" in err


@pytest.mark.parametrize("backend", ["torch_native", "flashmla"])
def test_backend_without_ragged_verify_is_rejected_for_compact(
    registered, model_pair, clean_env, backend
):
    clean_env.setenv("ADAFLASH_VERIFY_MODE", "compact")
    with pytest.raises(
        ValueError, match=f"attention backend '{backend}'.*ADAFLASH_VERIFY_MODE=auto"
    ):
        _resolve(model_pair, model_pair["head"], "--attention-backend", backend)


def test_compact_with_a_conflicting_ragged_env_is_rejected(registered, model_pair, clean_env):
    clean_env.setenv("ADAFLASH_VERIFY_MODE", "compact")
    clean_env.setenv("SGLANG_RAGGED_VERIFY_MODE", "static")
    with pytest.raises(ValueError, match="SGLANG_RAGGED_VERIFY_MODE='static'"):
        _resolve(model_pair, model_pair["head"], "--attention-backend", "fa3")


def test_cap_mode_without_head_is_rejected(registered, model_pair, clean_env):
    clean_env.setenv("ADAFLASH_VERIFY_MODE", "cap")
    with pytest.raises(ValueError, match="needs the drafter's length head"):
        _resolve(model_pair, model_pair["nohead"])


def test_bad_option_fails_validation(registered, model_pair, clean_env):
    clean_env.setenv("ADAFLASH_VERIFY_MODE", "fastest")
    with pytest.raises(ValueError, match="ADAFLASH_VERIFY_MODE='fastest'"):
        _resolve(model_pair, model_pair["head"])


def test_create_worker_returns_our_dflash_subclass(registered, model_pair, clean_env):
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2

    from sglang_adaflash.sglang_plugin.worker import AdaFlashWorkerV2

    args = prepare_server_args(
        [
            "--model-path",
            str(model_pair["target"]),
            "--speculative-algorithm",
            "ADAFLASH",
            "--speculative-draft-model-path",
            str(model_pair["head"]),
            "--device",
            "cuda",
            "--attention-backend",
            "fa3",
        ]
    )
    args.resolve_once()
    worker_cls = registered.create_worker(args)
    assert worker_cls is AdaFlashWorkerV2 and issubclass(worker_cls, DFlashWorkerV2)


def test_sglang_reads_our_drafter_config_as_we_do(model_pair):
    """SGLang's own DFlash config parser agrees with ours on a checkpoint we publish."""
    from sglang.srt.speculative.dflash_utils import parse_dflash_draft_config
    from transformers import AutoConfig

    from sglang_adaflash.drafter.checkpoint import read_config

    ours = read_config(model_pair["head"])
    theirs = parse_dflash_draft_config(
        draft_hf_config=AutoConfig.from_pretrained(model_pair["head"])
    )
    assert theirs.block_size == ours.block_size == 8
    assert theirs.mask_token_id == ours.mask_token_id
    assert list(theirs.target_layer_ids) == ours.target_layer_ids
    assert theirs.num_target_layers == ours.num_target_layers
    assert theirs.require_num_layers() == ours.num_hidden_layers
    hf = AutoConfig.from_pretrained(model_pair["head"])
    assert hf.architectures == ["DFlashDraftModel"]
