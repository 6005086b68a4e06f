"""The drafter forward that reads some block slots only (what a recovery branch uses) against
the same rows of the full forward, with one and with two layers."""

import pytest
import torch

from sglang_adaflash.testing.fixtures import tiny_drafter


@pytest.mark.parametrize("layers", [1, 2])
def test_read_rows_equal_the_full_forward(layers):
    d = tiny_drafter(seed=4, layers=layers)
    cfg = d.config
    gen = torch.Generator().manual_seed(0)
    n, b, c = 3, cfg.block_size, 5
    x = torch.randn(n, b, cfg.hidden_size, generator=gen, dtype=torch.float64)
    positions = torch.tensor([[c + k for k in range(b)]] * n)
    ctx = torch.randn(n, c, cfg.hidden_size, generator=gen, dtype=torch.float64)
    ctx_kv = d.context_kv(ctx, torch.arange(c)[None].expand(n, -1))
    # a different mask row per query slot, so reading the wrong mask row shows
    mask = torch.rand(n, 1, b, c + b, generator=gen) < 0.6
    mask[..., c:] |= torch.eye(b, dtype=torch.bool)
    full = d(x, positions, ctx_kv, mask)
    read = torch.tensor([[1, 2, 3], [4, 5, 6], [7, 7, 0]])  # repeats and any order allowed
    part = d(x, positions, ctx_kv, mask, read)
    assert part.shape == (n, 3, cfg.hidden_size)
    want = full.gather(1, read[..., None].expand(-1, -1, cfg.hidden_size))
    torch.testing.assert_close(part, want, rtol=1e-10, atol=1e-10)
    # the rows read are not interchangeable: a wrong slot would not match
    assert not torch.allclose(part[0, 0], full[0, 2])
