"""FlashInfer's sampling kernels agree with the torch reference (runs only on CUDA + flashinfer)."""

import pytest
import torch
from scipy.stats import chi2_contingency

from sglang_adaflash.core import flashinfer_sampling
from sglang_adaflash.core.rejection import verify_sampling

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not flashinfer_sampling.available("cuda") if torch.cuda.is_available() else True,
        reason="needs a CUDA GPU and the flashinfer package (FlashInfer has no CPU kernels)",
    ),
]


def _same_distribution(a: torch.Tensor, b: torch.Tensor, vocab: int) -> float:
    table = torch.stack([torch.bincount(a, minlength=vocab), torch.bincount(b, minlength=vocab)])
    table = table[:, table.sum(0) > 0]
    return chi2_contingency(table.cpu().numpy()).pvalue


def test_chain_speculative_sampling_matches_torch():
    torch.manual_seed(0)
    n, k, vocab = 100_000, 3, 7
    q = torch.softmax(torch.randn(1, k, vocab, device="cuda"), -1).expand(n, -1, -1).contiguous()
    p = torch.softmax(torch.randn(1, k + 1, vocab, device="cuda"), -1).expand(n, -1, -1).contiguous()
    g = torch.Generator(device="cuda").manual_seed(1)
    d = torch.multinomial(q.view(-1, vocab), 1, generator=g).view(n, k)
    ref = verify_sampling(d, q, p, torch.full((n,), k, device="cuda"), g)
    fi = flashinfer_sampling.verify_sampling_uniform(d, q, p, k, g)
    assert _same_distribution(ref.tokens[:, 0], fi.tokens[:, 0], vocab) > 1e-3
    assert _same_distribution(ref.num_accepted, fi.num_accepted, k + 1) > 1e-3


def test_plain_sampling_matches_torch():
    probs = torch.softmax(torch.randn(1, 11, device="cuda"), -1).expand(100_000, -1).contiguous()
    g = torch.Generator(device="cuda").manual_seed(2)
    a = torch.multinomial(probs, 1, generator=g).squeeze(1)
    b = flashinfer_sampling.sample(probs, g)
    assert _same_distribution(a, b, 11) > 1e-3
