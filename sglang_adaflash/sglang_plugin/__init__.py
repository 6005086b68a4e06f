"""SGLang plugin: the ADAFLASH speculative algorithm on stock ``sglang==0.5.23``.

Installed with ``pip install 'sglang-adaflash[sglang]'``; SGLang loads it through the
``sglang.srt.plugins`` entry point in every process it starts, after which
``--speculative-algorithm ADAFLASH`` works. See ``docs/sglang.md``.

This package imports nothing heavy at import time: SGLang, torch and the worker load only when
:func:`register` runs (SGLang's plugin loader) or when SGLang builds the worker.
"""

from __future__ import annotations


def register() -> None:
    """Entry point of the ``sglang.srt.plugins`` group (idempotent)."""
    from .registration import register as _register

    _register()


__all__ = ["register"]
