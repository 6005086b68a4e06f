"""A fix for one defect of Triton's interpreter (``TRITON_INTERPRET=1``) that the CPU runs of
SGLang's attention kernels depend on.

Triton 3.8's interpreter keeps a bfloat16 tensor as its raw 16-bit pattern (numpy has no
bfloat16) and its ``tl.dot`` multiplies operands with ``np.matmul`` after converting only 8-bit
float operands. So a ``tl.dot`` of two bfloat16 tiles multiplies bit patterns as integers and
returns values around 1e9-1e10 (upstream: triton-lang/triton#11584; Triton's debugging guide
says the interpreter does not support bfloat16 arithmetic). Loads, stores and casts of bfloat16
are right, and float16 and float32 dots are right.

Every attention kernel of SGLang's Triton backend multiplies bfloat16 q, k, p and v tiles with
``tl.dot``, so an interpreted run of a bfloat16 model through that backend gets meaningless
attention: the target's very first token already differs from torch-native attention's, and a
drafter on that backend accepts nothing. :func:`fix_bf16_dot` converts bfloat16 ``tl.dot``
operands to float32 before the product, which is what the GPU's tensor cores compute (bfloat16
inputs, float32 accumulation).
"""

from __future__ import annotations

_FIXED = "_adaflash_bf16_dot"


def fix_bf16_dot() -> bool:
    """Patch the interpreter's ``create_dot`` (idempotent); True if it was patched now."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if getattr(builder.create_dot, _FIXED, False):
        return False
    stock = builder.create_dot

    def as_float32(handle):
        if handle.dtype != tl.bfloat16:
            return handle
        data = interpreter._convert_float(handle.data, tl.bfloat16, tl.float32, None)
        return interpreter.TensorHandle(data.view(np.float32), tl.float32)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return stock(self, as_float32(a), as_float32(b), d, input_precision, max_num_imprecise_acc)

    setattr(create_dot, _FIXED, True)
    builder.create_dot = create_dot
    return True


def extend_attention_error(seed: int = 0) -> float:
    """Largest |SGLang's Triton extend attention - a float32 torch reference| on a bfloat16
    GQA batch with a cached prefix (the verify/prefill kernel of SGLang's Triton backend)."""
    import torch
    from sglang.kernels.ops.attention.extend_attention import extend_attention_fwd

    g = torch.Generator().manual_seed(seed)
    hq, hkv, d, prefix, ext = 8, 4, 32, 20, 16  # the embedded target's head geometry
    n = prefix + ext
    q = torch.randn(ext, hq, d, generator=g).bfloat16()
    k = torch.randn(n, hkv, d, generator=g).bfloat16()
    v = torch.randn(n, hkv, d, generator=g).bfloat16()
    o = torch.empty_like(q)
    extend_attention_fwd(
        q, k[prefix:].contiguous(), v[prefix:].contiguous(), o, k, v,
        torch.tensor([0, ext], dtype=torch.int32), torch.tensor([0, prefix], dtype=torch.int32),
        torch.arange(prefix), None, True, None, ext, 1.0, 1.0, d**-0.5,
    )  # fmt: skip
    kk, vv = (t.float().repeat_interleave(hq // hkv, 1) for t in (k, v))
    scores = torch.einsum("qhd,khd->hqk", q.float(), kk) * d**-0.5
    causal = torch.ones(ext, n, dtype=torch.bool).tril(prefix)
    ref = torch.einsum("hqk,khd->qhd", scores.masked_fill(~causal, float("-inf")).softmax(-1), vv)
    return float((o.float() - ref).abs().max())


if __name__ == "__main__":  # TRITON_INTERPRET=1 python -m tests.sglang_plugin.triton_interpreter
    import json

    stock = extend_attention_error()
    fix_bf16_dot()
    print(json.dumps({"stock": stock, "fixed": extend_attention_error()}))
