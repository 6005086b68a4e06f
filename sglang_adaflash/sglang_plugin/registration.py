"""The ``sglang.srt.plugins`` entry point: registers ADAFLASH with SGLang, once per process.

SGLang calls every general plugin in every process it starts (launcher, schedulers, detokenizer,
data-parallel controller) and only logs a plugin's exceptions, so :func:`register` must be cheap,
idempotent, and loud about real failures.
"""

from __future__ import annotations

import logging
import threading

logger = logging.getLogger(__name__)
_lock = threading.Lock()


def _worker_factory(server_args):
    from .worker import AdaFlashWorkerV2

    return AdaFlashWorkerV2


def is_registered() -> bool:
    from sglang.srt.speculative.spec_registry import get_spec

    from .spec import NAME, AdaFlashSpecAlgo

    return isinstance(get_spec(NAME), AdaFlashSpecAlgo)


def register() -> None:
    """Register ADAFLASH with ``SpeculativeAlgorithm``; a second call does nothing."""
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    from sglang.srt.speculative.spec_registry import get_spec

    from .server_args import validate_server_args
    from .spec import NAME, AdaFlashSpecAlgo, unmapped_predicates

    unmapped = unmapped_predicates()
    if unmapped:
        raise RuntimeError(
            f"sglang-adaflash does not know how {NAME} must answer SpeculativeAlgorithm."
            f"{', '.join(unmapped)} of this SGLang (it supports sglang==0.5.23); install "
            "sglang==0.5.23, or a sglang-adaflash release that maps them in "
            "sglang_plugin/spec.py"
        )
    with _lock:
        existing = get_spec(NAME)
        if existing is not None:
            if not isinstance(existing, AdaFlashSpecAlgo):
                raise RuntimeError(
                    f"speculative algorithm {NAME} is already registered by another plugin "
                    f"({type(existing).__module__}.{type(existing).__name__}); uninstall it or "
                    "restrict plugins with SGLANG_PLUGINS"
                )
            return
        SpeculativeAlgorithm.register(
            NAME,
            # The DFlash V2 worker drives both overlap and synchronous scheduling.
            supports_overlap=True,
            validate_server_args=validate_server_args,
            spec_class=AdaFlashSpecAlgo,
        )(_worker_factory)
    _maybe_add_http_routes()
    _install_backends()
    logger.info("sglang-adaflash: registered speculative algorithm %s", NAME)


def _install_backends() -> None:
    """The ragged-verify backend extensions, where compact mode was resolved (an SGLang
    subprocess inherits the launcher's resolution; the worker installs them again)."""
    try:
        from .backends import install_ragged_backends

        install_ragged_backends()
    except Exception:
        logger.exception("sglang-adaflash: could not install the ragged-verify backends")


def _maybe_add_http_routes() -> None:
    """Add ``/adaflash/v1/drafter`` to SGLang's HTTP app in the launcher process only."""
    import multiprocessing

    if multiprocessing.parent_process() is not None:
        return  # a spawned SGLang subprocess: no HTTP server here
    try:
        from .http import install_routes_when_server_starts

        install_routes_when_server_starts()
    except Exception:  # the endpoint is a convenience; never block serving on it
        logger.exception("sglang-adaflash: could not add the /adaflash/v1/drafter endpoint")
