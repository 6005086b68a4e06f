"""How SGLang sees ADAFLASH: a DFlash-family algorithm with its own name and worker.

SGLang dispatches on capability predicates (``is_dflash()``, ``supports_*()``), not on the
name, almost everywhere. ADAFLASH runs SGLang's DFlash machinery (draft model class, draft KV
materialisation from target hidden states, TARGET_VERIFY graphs), so every predicate must answer
as DFLASH does, with one deliberate exception (``supports_ragged_verify``). All of that lives in
:data:`DFLASH_PARITY` below, one line per predicate with the reason, and nowhere else.

Places that compare the *name* (``speculative_algorithm == "DFLASH"``) do not see ADAFLASH as
DFLASH; ``docs/sglang.md`` lists them and what they mean for users.
"""

from __future__ import annotations

from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
from sglang.srt.speculative.spec_registry import CustomSpecAlgo

from .options import VERIFY_COMPACT, resolved_verify_mode

NAME = "ADAFLASH"

#: Predicates answered exactly as SpeculativeAlgorithm.DFLASH answers them, and why.
DFLASH_PARITY: dict[str, str] = {
    "is_some": "generic 'speculation on' checks",
    "is_none": "generic 'speculation off' checks",
    "is_speculative": "generic 'speculation on' checks",
    "is_eagle": "False: EAGLE-only branches (tree drafts, topk) must stay off",
    "is_eagle3": "False, as for DFLASH",
    "is_frozen_kv_mtp": "False, as for DFLASH",
    "is_uno": "False, as for DFLASH",
    "is_standalone": "False, as for DFLASH",
    "is_ngram": "False, as for DFLASH",
    "is_dspark": "False: DSpark's planner, confidence relay and draft-width rules are not ours",
    "is_dflash": "True: loads the DFlash draft model, sizes the draft KV pool, captures target "
    "aux hidden states (model_runner, kv_cache_configurator, decode_cuda_graph_runner)",
    "is_dflash_family": "True: scheduler and memory paths shared by DFlash and DSpark",
    "supports_target_verify_for_draft": "True: the draft graph runner raises otherwise "
    "(decode_cuda_graph_runner: draft TARGET_VERIFY capture)",
    "supports_prefill_shared_read_done": "True: DFlash's draft KV write happens before the "
    "target forward's shared-buffer reads end",
    "supports_mixed_chunk": "True: otherwise the validation hook disables mixed chunked prefill",
    "supports_grammar_overlap": "True: the DFlash worker advances grammars inside verify()",
    "has_draft_kv": "True: sizes the KV reserve for the draft's context KV",
    "carries_draft_hidden_states": "False, as for DFLASH (disaggregation transfer); missing on "
    "CustomSpecAlgo, the scheduler calls it at start",
    "need_topk": "False, as for DFLASH; missing on CustomSpecAlgo, called by overlap_utils",
}

#: Methods that are not predicates but are delegated to DFLASH, and why.
DFLASH_DELEGATED: dict[str, str] = {
    "create_future_map": "missing on CustomSpecAlgo; the scheduler builds the overlap future map",
    "build_disagg_draft_input": "PD disaggregation: the decode side builds DFlash draft input",
    "resolve_max_speculative_num_draft_tokens": "same block-width bound as DFLASH",
    "get_num_tokens_per_req_for_target_verify": "a whole block per request, as DFLASH",
}


def _delegate(name: str):
    def method(self, *args, **kwargs):
        return getattr(SpeculativeAlgorithm.DFLASH, name)(*args, **kwargs)

    method.__name__ = name
    method.__doc__ = (
        f"As SpeculativeAlgorithm.DFLASH: {DFLASH_PARITY.get(name) or DFLASH_DELEGATED[name]}"
    )
    return method


class AdaFlashSpecAlgo(CustomSpecAlgo):
    """The registered ADAFLASH algorithm (see the module docstring)."""

    def supports_ragged_verify(self) -> bool:
        """The one deliberate difference from DFLASH: True only when the server-arg hook resolved
        the compact verify mode, so the target's decode graphs are keyed by token buckets."""
        return resolved_verify_mode() == VERIFY_COMPACT

    def get_platform_worker_cls(self):
        """None: ADAFLASH runs only on CUDA, with its own worker, never a platform's DFLASH one."""
        return None

    def handle_server_args(self, server_args) -> None:
        from .server_args import handle_server_args

        handle_server_args(server_args)


for _name in (*DFLASH_PARITY, *DFLASH_DELEGATED):
    setattr(AdaFlashSpecAlgo, _name, _delegate(_name))
del _name

#: Predicates ADAFLASH answers itself (methods of AdaFlashSpecAlgo above).
OWN_ANSWERS = frozenset({"supports_ragged_verify"})
PREDICATE_PREFIXES = ("is_", "supports_", "has_", "need_", "carries_")


def unmapped_predicates() -> list[str]:
    """Predicates of this SGLang's SpeculativeAlgorithm that ADAFLASH has no decided answer for.

    A newer SGLang may add one; answering it as DFLASH (or as CustomSpecAlgo's generic default)
    without a decision could be silently wrong, so registration refuses instead.
    """
    return sorted(
        name
        for name in vars(SpeculativeAlgorithm)
        if name.startswith(PREDICATE_PREFIXES)
        and callable(getattr(SpeculativeAlgorithm, name, None))
        and name not in DFLASH_PARITY
        and name not in OWN_ANSWERS
    )
