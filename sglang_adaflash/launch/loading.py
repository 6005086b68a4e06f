"""Load a target directory, its tokenizer and a drafter checkpoint, checked against each other.

Every failure becomes a CLIError whose one-line message says what is wrong and what to do; the
CLI prints it and exits with code 2 (no traceback).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from .prompts import CLIError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


@dataclass
class LoadedPair:
    target: object  # HFTarget
    drafter: object | None  # DFlashDrafter
    tokenizer: object | None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    recovery: object | None = None  # mode d2sd: the recovery drafter (sglang_adaflash.d2sd.cli)
    d2sd: object | None = None  # mode d2sd: its D2SDOptions

    @property
    def pad_token_id(self) -> int:
        tok = self.tokenizer
        if tok is not None and tok.pad_token_id is not None:
            return int(tok.pad_token_id)
        pad = getattr(self.target.config, "pad_token_id", None)
        return int(pad) if pad is not None else 0


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def load_tokenizer(target_dir: str | Path):
    """The target directory's tokenizer, or None when it has none."""
    from transformers import AutoTokenizer

    d = Path(target_dir)
    if not any((d / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")):
        return None
    try:
        return AutoTokenizer.from_pretrained(str(d), local_files_only=True)
    except Exception as e:  # transformers raises many types for a broken tokenizer
        raise CLIError(f"target {d}: its tokenizer files cannot be loaded ({_one_line(e)})") from None


def stop_token_ids(tokenizer, target_config) -> tuple[int, ...]:
    """End-of-response tokens: the chat format's stop tokens the tokenizer knows, plus EOS."""
    from ..assets.chat_format import STOP_TOKENS

    ids: set[int] = set()
    if tokenizer is not None:
        vocab = tokenizer.get_vocab()
        ids.update(vocab[t] for t in STOP_TOKENS if t in vocab)
        if tokenizer.eos_token_id is not None:
            ids.add(int(tokenizer.eos_token_id))
    eos = getattr(target_config, "eos_token_id", None)
    if isinstance(eos, int):
        ids.add(eos)
    elif isinstance(eos, (list, tuple)):
        ids.update(int(t) for t in eos)
    return tuple(sorted(ids))


def load_pair(
    target_dir: str | Path,
    drafter_dir: str | Path | None,
    *,
    dtype: str | None = None,
    device: str = "cpu",
    need_drafter: bool = True,
) -> LoadedPair:
    """Target + tokenizer + (optionally) drafter, compatibility-checked. Raises CLIError."""
    from ..drafter.checkpoint import CheckpointError, load_drafter
    from ..target.compat import CompatibilityError, check_compatibility
    from ..target.hf_target import HFTarget, TargetError

    if dtype is not None and dtype not in DTYPES:
        raise CLIError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    torch_dtype = DTYPES[dtype] if dtype else None
    target_dir = Path(target_dir)
    if not target_dir.is_dir():
        raise CLIError(f"target directory {target_dir} does not exist")
    if need_drafter and drafter_dir is None:
        raise CLIError("speculative modes (dflash, adaflash) need a drafter: pass --drafter DIR, or decode without one in mode ar")
    try:
        target = HFTarget.from_pretrained(target_dir, dtype=torch_dtype, device=device)
    except TargetError as e:
        raise CLIError(_one_line(e)) from None
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        raise CLIError(f"target {target_dir} cannot be loaded: {_one_line(e)}") from None
    tokenizer = load_tokenizer(target_dir)
    drafter = None
    if drafter_dir is not None:
        if not Path(drafter_dir).is_dir():
            raise CLIError(f"drafter directory {drafter_dir} does not exist: pass a DFlash checkpoint directory")
        try:
            drafter = load_drafter(drafter_dir, dtype=target.dtype, device=device)
            raw_dtype = DTYPES.get(drafter.config.torch_dtype or "", None)  # as saved
            check_compatibility(
                drafter.config,
                target,
                drafter_dtype=raw_dtype,
                drafter_path=drafter_dir,
                allow_dtype_cast=dtype is not None,
            )
        except (CheckpointError, CompatibilityError) as e:
            raise CLIError(_one_line(e)) from None
        except (OSError, RuntimeError, ValueError) as e:
            raise CLIError(f"drafter {drafter_dir} cannot be loaded: {_one_line(e)}") from None
    return LoadedPair(target, drafter, tokenizer, stop_token_ids(tokenizer, target.config))
