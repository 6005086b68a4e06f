"""Which CPU a benchmark ran on, recorded beside its figures.

Ratios to plain decoding move with the machine, not only with the code: the same engine and pair
read `dflash` at 1.14x `ar` and adaflash at 1.16x in the in-domain c=1 cell of benchmarks/adaptive/
on one machine of this project's kind, and at about 0.9x and 1.0x on another whose plain decoding
ran twice as fast (an AMD EPYC on which torch dispatches AVX-512 kernels). A result that does not
say which CPU it came from cannot be compared with another.
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
