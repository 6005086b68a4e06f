"""Column-major projection weights for a float32 target (and its drafter) on a CPU: the same
values, a faster GEMM.

An `nn.Linear` computes x @ W.T with W stored [out, in], row-major. On the CPU measured here,
MKL's single-precision GEMM for the few rows a decode step has (one token per
request, or a verify block) runs faster when W.T is the contiguous operand, that is, when W is
stored column-major. Measured on the embedded target (whose LM head is tied to its embedding,
so only the per-layer projections are relaid out) over 120 cached tokens, one torch thread, two
cores of an AMD EPYC with AVX2 kernels (benchmarks/target_layout/): at one request a plain step
4% faster and a 2-16 token verify 5-11%; at eight requests 1-7%. The logits were equal at
verify lengths 4-16 and within 8e-6 at 1-2 (a different kernel's rounding; both layouts are
float32 GEMMs over the same values).

The weights keep their shape, values and Parameter objects (`weight.data` gets a transposed
copy's transpose), so the module, its state_dict and anything holding the Parameter see the
same tensor; only the strides change. A weight that is also an embedding's (tied word
embeddings) is left as it is: an embedding reads rows, and a column-major table would make
every lookup a strided gather across the whole table. Only float32 weights on a CPU are
relaid out: that is the case measured; a GPU, and half types on a CPU, keep the layout they
were loaded with.

A tied LM head is where the layout matters most, and it cannot be relaid out in place: its
table is the embedding's. On an Intel Xeon with AVX-512 kernels MKL's row-major GEMM for the
embedded target's head (4096 x 256) took 298 us at 4 rows and 441 at 8 against 152 at one,
while the column-major one took 163 and 187 (benchmarks/target_layout/results_xeon.json,
`lm_head_gemm`): every verify of a few tokens, and every drafter step's proposals (the drafter
borrows the head), paid twice a plain step's head or more.
`column_major_tied_head` therefore gives such a head its own column-major copy, leaving the
embedding its row-major table; the copy costs the table's memory again, so only tables up to
TIED_HEAD_COPY_MAX_BYTES get one. The decode-time drafter's projections are relaid out the same
way (engine.proposer.DFlashProposer): its block forward multiplies 16 rows and its MLP the few
slots read.
"""

from __future__ import annotations

import torch
from torch import nn

# the largest tied LM head given its own column-major copy: 256 MiB (the embedded target's is 4 MiB;
# a 152k x 1024 vocabulary's, 622 MiB, stays tied and row-major)
TIED_HEAD_COPY_MAX_BYTES = 256 << 20


def column_major_linears(model: nn.Module) -> int:
    """Relay out `model`'s float32 CPU `nn.Linear` weights column-major, in place; returns how
    many were relaid out (weights already column-major, shared with an embedding, on another
    device or of another dtype are skipped)."""
    embedded = {m.weight.data_ptr() for m in model.modules() if isinstance(m, nn.Embedding)}
    done = 0
    for module in model.modules():
        if not isinstance(module, nn.Linear):
            continue
        w = module.weight
        if not _relaid_here(w) or w.data_ptr() in embedded:
            continue
        if not w.is_contiguous() or w.shape[0] == 1 or w.shape[1] == 1:
            continue  # already relaid out, or a vector, whose layout cannot change
        with torch.no_grad():
            w.data = _column_major(w.data)
        done += 1
    return done


def column_major_tied_head(lm_head: nn.Module, embedding: nn.Module) -> bool:
    """Give a float32 CPU LM head whose weight is `embedding`'s table its own column-major copy
    (the same values; the embedding keeps the table, row-major). Returns whether it did: a head
    not tied, on another device, of another dtype, or over TIED_HEAD_COPY_MAX_BYTES is left.
    The head's Parameter is replaced, so the model's two weights are no longer one tensor:
    nothing serving trains the target, and a copy of frozen weights stays equal to the table."""
    w = getattr(lm_head, "weight", None)
    table = getattr(embedding, "weight", None)
    if w is None or table is None or w.data_ptr() != table.data_ptr() or not _relaid_here(w):
        return False
    if w.numel() * w.element_size() > TIED_HEAD_COPY_MAX_BYTES:
        return False
    with torch.no_grad():
        lm_head.weight = nn.Parameter(_column_major(w.detach()), requires_grad=False)
    return True


def _relaid_here(w: torch.Tensor) -> bool:
    """A weight of the case measured: a float32 matrix on a CPU."""
    return w.device.type == "cpu" and w.dtype == torch.float32 and w.dim() == 2


def _column_major(w: torch.Tensor) -> torch.Tensor:
    """The same values, shape and dtype, stored column-major (a transposed copy's transpose)."""
    return w.t().contiguous().t()
