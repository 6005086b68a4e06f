"""ADAFLASH's server-argument handling: DFLASH's, then our own checks and the verify mode.

SGLang calls :func:`handle_server_args` with a stand-in that records field writes (see
``record_foreign_defaults`` in ``arg_groups/overrides.py``). We run SGLang's own DFLASH handler
on it, so ADAFLASH gets exactly DFLASH's defaults (block size from the draft config, steps = topk
= 1, draft attention backend, max running requests), then decide the verify mode:

- ``compact`` needs a target attention backend that can verify ragged layouts with CUDA graphs
  (FlashAttention 3/4, TRT-LLM MHA/MLA, DSv4, and Triton through the plugin), or FlashInfer,
  which the plugin verifies ragged layouts on eagerly (only when compact is asked for), and none of the features SGLang's compact graphs
  refuse (two-batch overlap, LoRA, disabled graph padding), and no DP attention (the idle-rank
  guards of the DFlash worker assume fixed-width verify);
- ``auto`` picks compact when possible, else fixed-length DFlash, and says why at start-up;
- ``compact`` requested explicitly where impossible is an error that names the fix.

The resolved mode goes to ``ADAFLASH_RESOLVED_VERIFY_MODE`` (and ``SGLANG_RAGGED_VERIFY_MODE``
for compact) in the launcher's environment, which every SGLang subprocess inherits.
"""

from __future__ import annotations

import logging
import os

from .options import (
    RESOLVED_MODE_ENV,
    VERIFY_AUTO,
    VERIFY_CAP,
    VERIFY_COMPACT,
    VERIFY_FIXED,
    AdaFlashOptions,
    OptionError,
)

logger = logging.getLogger(__name__)

#: Target attention backends whose TARGET_VERIFY path honours a RaggedVerifyLayout, with CUDA
#: graphs: SGLang 0.5.23's own (``supports_ragged_verify_graph = True``), and ``triton``
#: through the plugin's extension of SGLang's Triton backend (``backends.py``).
RAGGED_VERIFY_BACKENDS = frozenset({"fa3", "fa4", "trtllm_mha", "trtllm_mla", "dsv4", "triton"})
#: Backends the plugin verifies ragged layouts on eagerly only (no CUDA graphs for the verify
#: forward): ``flashinfer`` (``flashinfer_verify.py``). Compact there only when asked for.
EAGER_RAGGED_VERIFY_BACKENDS = frozenset({"flashinfer"})
#: Why ``auto`` does not pick compact on those.
EAGER_ONLY = (
    "verifies ragged layouts only eagerly (the plugin plans FlashInfer's ragged verify from "
    "host bounds without CUDA graphs for the verify forward, which whole blocks replay), so "
    "auto keeps fixed; set ADAFLASH_VERIFY_MODE=compact to use it, or pass "
    "--attention-backend fa3 (Hopper, Ampere, Ada) or triton"
)
#: Backends known not to, and what goes wrong.
NO_RAGGED_VERIFY = {
    "torch_native": "has no ragged verify path",
    "flex_attention": "has no ragged verify path",
    "flashmla": "has no ragged verify path",
}


#: SGLang 0.5.23's automatic backend choice gives trtllm_mha on SM100 only to algorithms it
#: recognises by name (DFLASH among them), so ADAFLASH gets flashinfer there.
BLACKWELL_HINT = (
    " (on Blackwell GPUs SGLang picks flashinfer for ADAFLASH when no backend is given, where it "
    "picks trtllm_mha for DFLASH: pass --attention-backend trtllm_mha)"
)


def verify_attention_backend(cfg) -> str | None:
    """The backend that runs TARGET_VERIFY: the decode backend when speculative_attention_mode
    is 'decode', else the prefill backend (HybridAttnBackend's routing); None = auto."""
    if getattr(cfg, "speculative_attention_mode", "prefill") == "decode":
        specific = getattr(cfg, "decode_attention_backend", None)
    else:
        specific = getattr(cfg, "prefill_attention_backend", None)
    return specific or getattr(cfg, "attention_backend", None)


def compact_blockers(cfg, explicit: bool = False) -> list[str]:
    """Reasons the compact ragged verify cannot run with these arguments ([] = it can);
    ``explicit``: the user asked for compact (then an eager-only backend is allowed)."""
    reasons = []
    backend = verify_attention_backend(cfg)
    if backend in EAGER_RAGGED_VERIFY_BACKENDS:
        if not explicit:
            reasons.append(f"attention backend {backend!r} {EAGER_ONLY}" + BLACKWELL_HINT)
    elif backend is None:
        reasons.append(
            "the target attention backend is chosen automatically; pass --attention-backend "
            "fa3 (Hopper), fa4 or trtllm_mha (Blackwell) or triton (any GPU) to enable compact "
            "verification"
        )
    elif backend not in RAGGED_VERIFY_BACKENDS:
        why = NO_RAGGED_VERIFY.get(backend, "is not known to support ragged verify")
        reasons.append(
            f"attention backend {backend!r} {why}; use one of "
            f"{', '.join(sorted(RAGGED_VERIFY_BACKENDS))}"
        )
    if getattr(cfg, "enable_two_batch_overlap", False):
        reasons.append("--enable-two-batch-overlap is on (compact verify graphs refuse it)")
    if getattr(cfg, "enable_lora", False) or getattr(cfg, "lora_paths", None):
        reasons.append("LoRA is on (compact verify graphs refuse it)")
    if getattr(cfg, "disable_cuda_graph_padding", False):
        reasons.append("--disable-cuda-graph-padding is on (compact verify graphs refuse it)")
    if (getattr(cfg, "dp_size", 1) or 1) > 1 and getattr(cfg, "enable_dp_attention", False):
        reasons.append("DP attention is on (ADAFLASH's compact path is TP-only)")
    return reasons


def resolve_verify_mode(opts: AdaFlashOptions, cfg, env=None) -> tuple[str, str]:
    """(mode, start-up message) for these options and arguments; raises OptionError when the
    user asked for something impossible."""
    env = os.environ if env is None else env
    requested = opts.verify_mode
    if requested == VERIFY_FIXED:
        return VERIFY_FIXED, "ADAFLASH: fixed-length verification (ADAFLASH_VERIFY_MODE=fixed)"
    if not opts.use_length_head:
        if requested in (VERIFY_COMPACT, VERIFY_CAP):
            raise OptionError(
                f"ADAFLASH_VERIFY_MODE={requested} needs the drafter's length head, but "
                f"{'it is switched off (ADAFLASH_LENGTH_HEAD=off)' if opts.length_head_in_config else 'the drafter has none (dflash_config.use_thresh_head_two_model is not true)'}; "
                "use a drafter trained with the length head or ADAFLASH_VERIFY_MODE=fixed"
            )
        return VERIFY_FIXED, (
            "ADAFLASH: the drafter has no length head enabled; falling back to fixed-length "
            "DFlash verification"
        )
    if requested == VERIFY_CAP:
        return VERIFY_CAP, (
            "ADAFLASH: cap mode: whole blocks are verified and acceptance is capped at the "
            "length head's lengths (no target compute is saved)"
        )
    ragged_env = env.get("SGLANG_RAGGED_VERIFY_MODE", "").strip()
    blockers = compact_blockers(cfg, explicit=requested == VERIFY_COMPACT)
    if ragged_env and ragged_env != "compact":
        blockers.append(
            f"SGLANG_RAGGED_VERIFY_MODE={ragged_env!r} is set; unset it or set it to 'compact'"
        )
    if not blockers:
        backend = verify_attention_backend(cfg)
        eager = backend in EAGER_RAGGED_VERIFY_BACKENDS
        return VERIFY_COMPACT, (
            f"ADAFLASH: verify mode compact on target attention backend {backend!r}: the "
            "target computes only the verify lengths the length head and batch budget choose"
            + (" (eager verify forward: no CUDA graphs for it on this backend)" if eager else "")
        )
    if requested == VERIFY_COMPACT:
        raise OptionError(
            "ADAFLASH_VERIFY_MODE=compact cannot run: "
            + "; ".join(blockers)
            + ". Fix these or set ADAFLASH_VERIFY_MODE=auto to fall back to fixed length"
        )
    assert requested == VERIFY_AUTO
    return VERIFY_FIXED, (
        f"ADAFLASH: verify mode fixed on target attention backend "
        f"{verify_attention_backend(cfg) or 'auto'!r}: falling back to fixed-length DFlash "
        "verification because " + "; ".join(blockers)
    )


def validate_server_args(server_args) -> None:
    """Registered as ``validate_server_args``: cheap checks before any resolution."""
    cfg = server_args
    try:
        AdaFlashOptions.resolve(getattr(cfg, "speculative_draft_model_path", None))
    except OptionError as e:
        raise ValueError(str(e)) from None


def handle_server_args(server_args) -> None:
    """DFLASH's handler, then ADAFLASH's checks; records the verify mode in the environment."""
    from sglang.srt.arg_groups.speculative_hook import _handle_dflash

    _handle_dflash(server_args)
    cfg = server_args
    try:
        opts = AdaFlashOptions.resolve(cfg.speculative_draft_model_path)
        block = int(cfg.speculative_num_draft_tokens)
        if opts.block_size is not None and block != opts.block_size:
            raise OptionError(
                f"--speculative-num-draft-tokens {block} differs from the drafter's block_size "
                f"{opts.block_size}; the length head was trained on {opts.block_size}-token "
                "blocks: drop the flag or set it to the drafter's block size"
            )
        if opts.min_len > block:
            raise OptionError(
                f"ADAFLASH_LENGTH_MIN={opts.min_len} exceeds the block size {block}; use 1..{block}"
            )
        mode, message = resolve_verify_mode(opts, cfg)
    except OptionError as e:
        raise ValueError(str(e)) from None
    os.environ[RESOLVED_MODE_ENV] = mode
    if mode == VERIFY_COMPACT:
        os.environ["SGLANG_RAGGED_VERIFY_MODE"] = "compact"
    logger.warning("%s", message)
