"""Builders of tiny random drafters, targets and published versions, shared by every test folder.

Plain functions rather than pytest fixtures, so tests in any folder, conftest files and the
scripts that tests run in subprocesses all build the same models: one copy of each builder, and
one place to change when a config field changes.

Two sizes, because tests need two different things:

- :func:`drafter_config` and friends: the smallest drafter that is still a complete checkpoint,
  for tests that only store, verify, reload or copy weights (hidden size 16 by default; every
  size can be overridden by its config key);
- :func:`tiny_target` and :func:`tiny_drafter`: a target and a drafter that run together
  (hidden size 48, float64 so that greedy argmaxes do not tie), for tests that decode.

A seed fixes the weights: the same config and seed give the same tensors in every test.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch

from sglang_adaflash.drafter.config import DrafterConfig
from sglang_adaflash.drafter.model import DFlashDrafter
from sglang_adaflash.drafter.store import publish_version

if TYPE_CHECKING:
    from sglang_adaflash.target.hf_target import HFTarget

#: The target fingerprint of versions published for tests that do not check targets.
ANY_TARGET = {"name": "tiny-target", "config_sha256": "0" * 64}

#: Vocabulary of :func:`tiny_target`; the drafters built for it mask with the last id.
TINY_VOCAB = 96


def drafter_raw(
    *,
    hidden_size: int = 16,
    intermediate_size: int = 32,
    num_hidden_layers: int = 1,
    num_attention_heads: int = 2,
    num_key_value_heads: int = 1,
    head_dim: int = 8,
    vocab_size: int = 64,
    num_target_layers: int = 4,
    block_size: int = 4,
    length_head: bool = True,
    length_head_bottleneck_dim: int = 8,
) -> dict[str, Any]:
    """A drafter's ``config.json`` as published (the mask token is the last id)."""
    return dict(
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        head_dim=head_dim,
        vocab_size=vocab_size,
        num_target_layers=num_target_layers,
        block_size=block_size,
        dflash_config=dict(
            mask_token_id=vocab_size - 1,
            use_thresh_head_two_model=length_head,
            thresh_head_bottleneck_dim=length_head_bottleneck_dim,
        ),
    )


def drafter_config(**sizes: Any) -> DrafterConfig:
    """The config of :func:`drafter_raw` with ``sizes`` changed."""
    return DrafterConfig.from_dict(drafter_raw(**sizes))


def random_drafter(
    cfg: DrafterConfig, seed: int, dtype: torch.dtype | None = None
) -> DFlashDrafter:
    """A drafter with the random initial weights that ``seed`` gives, in eval mode."""
    torch.manual_seed(seed)
    model = DFlashDrafter(cfg)
    if dtype is not None:
        model = model.to(dtype)
    return model.eval()


def random_state(cfg: DrafterConfig, seed: int) -> dict[str, torch.Tensor]:
    """The checkpoint state of :func:`random_drafter` (detached copies, float32)."""
    model = random_drafter(cfg, seed)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def publish_random(
    home: str | os.PathLike,
    seed: int,
    cfg: DrafterConfig | None = None,
    target: dict[str, str] = ANY_TARGET,
) -> str:
    """Publish :func:`random_state` as the next version under ``home``; returns its name."""
    cfg = cfg or drafter_config()
    return publish_version(home, cfg, random_state(cfg, seed), target=target)


def tiny_target(
    seed: int = 0,
    vocab: int = TINY_VOCAB,
    layers: int = 3,
    dtype: torch.dtype = torch.float64,
    family: str = "qwen3",
) -> HFTarget:
    """A random Hugging Face causal LM (``qwen3`` or ``llama``) behind the engine's target API."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    from sglang_adaflash.target.hf_target import HFTarget

    torch.manual_seed(seed)
    config_cls, model_cls = {
        "qwen3": (Qwen3Config, Qwen3ForCausalLM),
        "llama": (LlamaConfig, LlamaForCausalLM),
    }[family]
    cfg = config_cls(
        hidden_size=48,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=12,
        intermediate_size=96,
        vocab_size=vocab,
        max_position_embeddings=512,
    )
    model = model_cls(cfg).to(dtype).eval()
    model.generation_config.eos_token_id = None  # Llama's default eos would stop HF generate early
    return HFTarget(model)


def tiny_drafter_config(
    vocab: int = TINY_VOCAB,
    block_size: int = 8,
    layers: int = 1,
    head: bool = True,
    target_layers: int = 3,
) -> DrafterConfig:
    """A drafter config that fits :func:`tiny_target` (``target_layers`` = its ``layers``)."""
    return drafter_config(
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=12,
        vocab_size=vocab,
        num_target_layers=target_layers,
        block_size=block_size,
        length_head=head,
        length_head_bottleneck_dim=256,
    )


def tiny_drafter(seed: int = 1, dtype: torch.dtype = torch.float64, **kw: Any) -> DFlashDrafter:
    """A random drafter for :func:`tiny_target`; ``kw`` go to :func:`tiny_drafter_config`."""
    return random_drafter(tiny_drafter_config(**kw), seed, dtype)
