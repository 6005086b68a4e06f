"""The top-k window fast path of `filtered_probs` keeps exactly the set the full sort keeps."""

from __future__ import annotations

import pytest
import torch

from sglang_adaflash.core import sampling as S

V = 2048


def _reference(logits, temperature, top_k, top_p):
    return S._filtered_sorted(logits.float() / temperature.float()[:, None], top_k, top_p)


def _same_set(ref, got):
    """Equal kept sets, up to float32 crumbs: the full sort's cumulative sum reaches 1.0 in
    rounding a little before the true end, so with top_p = 1 it may drop tail tokens of
    negligible total mass."""
    assert torch.equal(ref > 1e-6, got > 1e-6)
    assert float(torch.where(ref == 0, got, torch.zeros_like(got)).sum(-1).max()) < 1e-6


def _case(seed: int):
    g = torch.Generator().manual_seed(seed)
    n = 24
    scale = torch.linspace(0.05, 8.0, n)  # from nearly flat (nucleus past any window) to peaked
    logits = torch.randn(n, V, generator=g) * scale[:, None]
    temperature = torch.rand(n, generator=g) + 0.3
    top_k = torch.tensor([0, 0, 7, 300, 0, 64] * 4)
    top_p = torch.tensor([0.95, 1.0, 0.9, 0.99, 0.5, 1.0] * 4)
    return logits, temperature, top_k, top_p


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_window_path_equals_full_sort(seed):
    args = _case(seed)
    ref, got = _reference(*args), S.filtered_probs(*args)
    _same_set(ref, got)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-7)


def test_peaked_rows_take_the_window_and_flat_rows_fall_back(monkeypatch):
    logits, temperature, top_k, top_p = _case(0)
    calls = []
    real = S._filtered_sorted
    monkeypatch.setattr(S, "_filtered_sorted", lambda *a: calls.append(1) or real(*a))
    peaked = logits[-6:] * 4  # nucleus well inside the best 256
    peaked[1] = logits[0]  # the row with no filter at all is nearly flat: its softmax has a real tail
    got = S.filtered_probs(peaked, temperature[-6:], top_k[-6:], top_p[-6:])
    assert calls == []
    assert top_k[-6:][1] == 0 and top_p[-6:][1] == 1
    ref = real(peaked / temperature[-6:, None], top_k[-6:], top_p[-6:])
    _same_set(ref, got)  # includes a row with no filter: its whole softmax
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-7)
    flat = torch.zeros(1, V)  # the 0.95 nucleus of a uniform row is 95% of the vocabulary
    p = S.filtered_probs(flat, torch.ones(1), torch.zeros(1, dtype=torch.long), torch.tensor([0.95]))
    assert calls == [1]
    assert int((p > 0).sum()) == int(torch.ceil(torch.tensor(0.95 * V)))


def test_no_filter_is_plain_softmax():
    logits = torch.randn(3, V)
    t = torch.full((3,), 0.7)
    p = S.filtered_probs(logits, t, torch.zeros(3, dtype=torch.long), torch.ones(3))
    torch.testing.assert_close(p, (logits / 0.7).softmax(-1))
