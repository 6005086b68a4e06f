"""Engines sized to the device, and the small checks every entry point makes before one."""

from __future__ import annotations

import os

import torch

from ..errors import CLIError
from .loading import LoadedPair


def available_memory(device: str | torch.device) -> int | None:
    """Bytes free for new tensors on `device`; None when it cannot be told."""
    dev = torch.device(device)
    if dev.type == "cuda":
        try:
            return int(torch.cuda.mem_get_info(dev)[0])
        except Exception:  # no driver, bad index: allocation itself will say
            return None
    if dev.type != "cpu":
        return None
    free: list[int] = []
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    free.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        try:
            free.append(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
        except (OSError, ValueError, AttributeError):
            pass
    try:  # a container's own limit (cgroup v2) is often far below the host's memory
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        if limit != "max":
            with open("/sys/fs/cgroup/memory.current") as f:
                free.append(max(int(limit) - int(f.read().strip()), 0))
    except (OSError, ValueError):
        pass
    return min(free) if free else None


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def make_engine(
    pair: LoadedPair,
    mode: str,
    max_batch_size: int,
    max_seq_len: int,
    seed: int,
    *,
    num_requests: int | None = None,
    batch_flag: str = "--max-batch-size",
    lengths_from: str | None = None,
):
    """An engine whose caches fit: slots for at most the requests there are, and a clear refusal
    (CLIError) when even those would not fit in the device's free memory."""
    from ..engine.engine import SpecEngine
    from ..engine.sizing import kv_cache_bytes

    limit = getattr(pair.target.config, "max_position_embeddings", None)
    if limit:
        max_seq_len = min(max_seq_len, int(limit))
    max_seq_len = max(max_seq_len, 2)
    slots = max_batch_size if num_requests is None else min(max_batch_size, num_requests)
    slots = max(slots, 1)
    drafter = pair.drafter if mode != "ar" else None
    need = kv_cache_bytes(pair.target, drafter, mode=mode, max_batch_size=slots, max_seq_len=max_seq_len)
    if mode == "d2sd":  # the recovery drafter keeps a context cache as large as the first drafter's
        need += need - kv_cache_bytes(pair.target, None, mode="ar", max_batch_size=slots, max_seq_len=max_seq_len)
    free = available_memory(pair.target.device)
    if free is not None and need > free:
        raise CLIError(
            f"the KV caches for {slots} concurrent request(s) of up to {max_seq_len} tokens need {_gib(need)}, "
            f"more than the {_gib(free)} free on {pair.target.device}; lower {batch_flag}, --max-new-tokens "
            "or the prompts' length"
        )
    try:
        if mode == "d2sd":
            from ..d2sd.cli import make_d2sd_engine

            return make_d2sd_engine(pair, slots, max_seq_len, seed)
        extra = {} if lengths_from is None else {"lengths_from": lengths_from}
        return SpecEngine(
            pair.target,
            drafter,
            mode=mode,
            max_batch_size=slots,
            max_seq_len=max_seq_len,
            seed=seed,
            **extra,
        )
    except ValueError as e:
        raise CLIError(" ".join(str(e).split())) from None
    except (RuntimeError, MemoryError) as e:  # torch.OutOfMemoryError is a RuntimeError
        raise CLIError(
            f"cannot allocate the KV caches ({_gib(need)} for {slots} request(s) of up to {max_seq_len} tokens): "
            f"{' '.join(str(e).split())[:200]}; lower {batch_flag} or --max-new-tokens"
        ) from None


#: Most engine slots a command line may ask for. Slot-indexed state (caches, the calibration
#: posterior, the pending-feature buffer) is sized by it, and no CPU or single GPU decodes more
#: requests at once with the reference engine; a larger number is a typo, refused before loading.
MAX_BATCH_SIZE = 4096


def check_batch_size(value: int, flag: str = "--max-batch-size") -> None:
    if not 1 <= value <= MAX_BATCH_SIZE:
        raise CLIError(f"{flag} must be in 1..{MAX_BATCH_SIZE}, got {value}")


def check_seed(seed: int) -> None:
    try:
        torch.Generator().manual_seed(seed)
    except (ValueError, RuntimeError, OverflowError):
        raise CLIError(f"--seed must be an integer in [0, 2**64), got {seed}") from None


def quiet_transformers() -> None:
    """Our own progress bars only: hide transformers' weight-loading bars."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def model_dir_arg(which: str):
    """`embedded` names the pair bundled in the package, so an installed copy needs no path to it
    (a local directory of that name is `./embedded`)."""

    def convert(text: str) -> str:
        if text == "embedded":
            from ..assets import DRAFTER_DIR, TARGET_DIR

            return str(TARGET_DIR if which == "target" else DRAFTER_DIR)
        return text

    return convert
