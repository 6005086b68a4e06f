"""ADAFLASH answers every predicate SGLang calls exactly as DFLASH does (one documented exception)."""

from __future__ import annotations

import inspect

import pytest

pytestmark = pytest.mark.sglang
pytest.importorskip("sglang")

from sglang.srt.speculative.spec_info import SpeculativeAlgorithm  # noqa: E402

from sglang_adaflash.sglang_plugin.options import RESOLVED_MODE_ENV  # noqa: E402
from sglang_adaflash.sglang_plugin.spec import (  # noqa: E402
    DFLASH_DELEGATED,
    DFLASH_PARITY,
    OWN_ANSWERS,
    PREDICATE_PREFIXES,
    AdaFlashSpecAlgo,
    unmapped_predicates,
)

PREFIXES = PREDICATE_PREFIXES
#: Deliberate differences, with the test that covers each.
EXCEPTIONS = set(OWN_ANSWERS)


def _predicates():
    return sorted(n for n in vars(SpeculativeAlgorithm) if n.startswith(PREFIXES))


@pytest.fixture
def algo():
    return AdaFlashSpecAlgo("ADAFLASH", lambda args: None, supports_overlap=True)


def test_every_predicate_is_mapped_with_a_reason():
    unmapped = sorted(set(_predicates()) - set(DFLASH_PARITY) - EXCEPTIONS)
    assert not unmapped, (
        f"SpeculativeAlgorithm has predicates {unmapped} that spec.DFLASH_PARITY does not "
        "cover: decide how ADAFLASH must answer and add them with a reason"
    )
    assert all(DFLASH_PARITY[n] for n in DFLASH_PARITY)


@pytest.mark.parametrize("name", [n for n in _predicates() if n not in EXCEPTIONS])
def test_predicate_matches_dflash(algo, name):
    ours = getattr(algo, name)()
    theirs = getattr(SpeculativeAlgorithm.DFLASH, name)()
    assert ours == theirs, f"{name}: ADAFLASH says {ours}, DFLASH says {theirs}"


def test_the_values_that_matter(algo):
    assert algo.is_dflash() and algo.is_dflash_family() and not algo.is_dspark()
    assert algo.supports_target_verify_for_draft() and algo.supports_mixed_chunk()
    assert not algo.need_topk() and not algo.carries_draft_hidden_states()


def test_ragged_verify_only_in_compact_mode(algo, monkeypatch):
    monkeypatch.delenv(RESOLVED_MODE_ENV, raising=False)
    assert not algo.supports_ragged_verify()
    for mode, want in [("fixed", False), ("cap", False), ("compact", True)]:
        monkeypatch.setenv(RESOLVED_MODE_ENV, mode)
        assert algo.supports_ragged_verify() is want


def test_methods_missing_from_custom_spec_algo_are_provided(algo):
    from sglang.srt.speculative.spec_registry import CustomSpecAlgo

    # Instance methods of the enum (members and classmethods like from_string excluded).
    enum_methods = {
        n
        for n, v in vars(SpeculativeAlgorithm).items()
        if inspect.isfunction(v) and not n.startswith("_")
    }
    for name in sorted(enum_methods):
        assert callable(getattr(algo, name)), name
    missing_upstream = sorted(n for n in enum_methods if not hasattr(CustomSpecAlgo, n))
    # each is defined on our class itself: mapped to DFLASH with a reason, or overridden
    assert set(missing_upstream) <= set(vars(AdaFlashSpecAlgo)), missing_upstream


def test_delegated_non_predicates(algo):
    assert algo.get_num_tokens_per_req_for_target_verify(16, False) == 16
    assert algo.get_num_tokens_per_req_for_target_verify(16, True) == 16
    assert algo.get_platform_worker_cls() is None


def test_a_predicate_without_a_decided_answer_stops_registration(algo, monkeypatch, sglang_registry):
    """A newer SGLang's new predicate must not be answered silently (as DFLASH, or as
    CustomSpecAlgo's generic default): ADAFLASH refuses to register until it is mapped."""
    from sglang_adaflash.sglang_plugin import register

    sglang_registry.pop("ADAFLASH", None)
    monkeypatch.setattr(SpeculativeAlgorithm, "is_future_feature", lambda self: True, raising=False)
    assert unmapped_predicates() == ["is_future_feature"]
    with pytest.raises(RuntimeError, match="is_future_feature"):
        register()
    assert "ADAFLASH" not in sglang_registry
    with pytest.raises(AttributeError):
        algo.is_future_feature  # noqa: B018
    monkeypatch.delattr(SpeculativeAlgorithm, "is_future_feature")
    assert unmapped_predicates() == []
    register()
    assert isinstance(sglang_registry["ADAFLASH"], AdaFlashSpecAlgo)


def test_delegated_methods_have_reasons_and_exist_on_dflash():
    for name, why in DFLASH_DELEGATED.items():
        assert why and callable(getattr(SpeculativeAlgorithm.DFLASH, name)), name
