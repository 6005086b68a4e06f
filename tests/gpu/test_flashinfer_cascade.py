"""FlashInfer's cascade tree attention agrees with the masked torch path (CUDA + flashinfer only)."""

import pytest
import torch

from sglang_adaflash.d2sd import cascade
from sglang_adaflash.d2sd.tree import Branch, build_row, flatten
from sglang_adaflash.d2sd.tree_target import tree_forward
from sglang_adaflash.target.hf_target import HFTarget, TargetBatch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not (torch.cuda.is_available() and cascade.flashinfer_available("cuda", torch.bfloat16)),
        reason="needs a CUDA GPU and the flashinfer package (FlashInfer has no CPU kernels)",
    ),
]


def _target(dtype) -> HFTarget:
    """A small random Qwen3 with a head size FlashInfer's kernels are built for (64)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(3)
    cfg = Qwen3Config(hidden_size=256, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=64, intermediate_size=512, vocab_size=128, max_position_embeddings=512)
    return HFTarget(Qwen3ForCausalLM(cfg).to(device="cuda", dtype=dtype).eval())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_flashinfer_tree_forward_matches_the_masked_path(dtype):
    target = _target(dtype)
    target.capture_layer_ids = [0, 2]
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6] * 9, [9, 2, 6, 5, 3, 5, 8], [2, 7]]  # contexts of 72, 7, 2
    rows = [build_row(7, [11, 12, 13, 14], [Branch(1, [21, 22, 23]), Branch(3, [31, 32])]),
            build_row(5, [40], [Branch(1, [41])]), build_row(9, [], [])]
    flat = flatten(rows, "cuda")
    outs, kvs = [], []
    for backend in ("masked", "flashinfer"):
        cache = target.new_cache(len(prompts), 128)
        target.forward(TargetBatch.from_lists(prompts, [0] * len(prompts), device="cuda"), cache)
        starts = torch.tensor([len(p) for p in prompts], device="cuda")
        outs.append(tree_forward(target, cache, flat, starts, cascade.make(backend, "cuda")))
        kvs.append(outs[-1].nodes_kv(cache, starts))  # the masked path keeps them in the cache
    masked, fi = outs
    masked_logits, fi_logits = masked.logits, fi.logits  # computed from the final states on each read
    for b, row in enumerate(rows):  # padding nodes are not compared
        torch.testing.assert_close(fi_logits[b, : row.size].float(), masked_logits[b, : row.size].float(),
                                   rtol=3e-2, atol=3e-2)
        for (km, vm), (kf, vf) in zip(*kvs):  # the layers' inputs agree too
            torch.testing.assert_close(kf[b, :, : row.size].float(), km[b, :, : row.size].float(), rtol=3e-2, atol=3e-2)
            torch.testing.assert_close(vf[b, :, : row.size].float(), vm[b, :, : row.size].float(), rtol=3e-2, atol=3e-2)
    assert (fi_logits[0, :9].argmax(-1) == masked_logits[0, :9].argmax(-1)).float().mean() > 0.9
