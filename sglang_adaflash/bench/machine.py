"""Which CPU a benchmark ran on, recorded beside its figures.

Ratios to plain decoding move with the machine, not only with the code: the same engine and pair
read adaflash at 1.16x `ar` in the in-domain c=1 cell of benchmarks/adaptive/ on one machine of
this project's kind and at 0.98-1.08x on another, whose plain decoding ran about twice as fast
(an AMD EPYC on which torch dispatches AVX-512 kernels; benchmarks/adaptive/README.md). A result
that does not say which CPU it came from cannot be compared with another.
"""

from __future__ import annotations

from pathlib import Path

import torch


def cpu_description(cpuinfo: str | Path = "/proc/cpuinfo") -> dict:
    """{"model": the first "model name" of cpuinfo (None where unreadable), "torch_capability":
    the vector kernels torch dispatches to here (e.g. "AVX512", "AVX2", "DEFAULT")}."""
    model = None
    try:
        for line in Path(cpuinfo).read_text(errors="replace").splitlines():
            key, sep, value = line.partition(":")
            if sep and key.strip() == "model name":
                model = value.strip() or None
                break
    except OSError:
        pass
    return {"model": model, "torch_capability": torch.backends.cpu.get_cpu_capability()}
