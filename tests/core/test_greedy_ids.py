"""core.sampling.greedy_ids: the argmax a greedy step commits, by a faster CPU reduction, with
argmax's own answer on ties and NaNs (T=0 output must not move)."""

import torch

from sglang_adaflash.core.sampling import greedy_ids


def test_greedy_ids_equal_argmax_on_ties_nans_and_random_logits():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 6, 97, generator=g)
    logits[0, 0, [5, 40, 90]] = 50.0  # a three-way tie: the first wins
    logits[0, 1, [0, 96]] = 50.0  # tied at both ends
    logits[1, 2, [7, 9]] = float("nan")  # NaN: the first NaN, as argmax reports it
    logits[2, 3] = 1.0  # a constant row
    got = greedy_ids(logits)
    assert torch.equal(got, logits.argmax(-1))
    assert got[0, 0] == 5 and got[0, 1] == 0 and got[1, 2] == 7 and got[2, 3] == 0
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        rows = torch.randn(64, 4096, generator=g).to(dtype)
        rows[::3, 100] = rows[::3, 50] = rows.float().max() + 1  # ties in a third of the rows
        assert torch.equal(greedy_ids(rows), rows.argmax(-1)), dtype
