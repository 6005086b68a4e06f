"""Admission: waiting requests join the running batch (prefill), and a prefill that raises is
blamed on the requests it admitted, never on the batch.

A prefill touches only what it admits: their prompts go through the target, their first token
is sampled with their own parameters, and their free cache slots are written. So when it
raises, it is undone (the requests leave the running list, their slots are released, a seeded
request's generator is rewound) and the engine goes on with the requests already running:

- several requests joined: each is admitted again, alone, one per step, so the one that fails
  is found;
- one request joined: the engine admits a known-good probe request (a few token-0 ids, greedy,
  one token). If the probe goes through, the failure belongs to that request: it finishes with
  ``finish_reason="error"`` and ``fault=True`` and a message naming the exception. If the probe
  fails too, the engine itself is broken, not the request, and :class:`EngineFailure` is
  raised: an error nobody can be blamed for, which stops a server (its supervisor restarts it).

A decode step runs every running request through shared forwards and commits them together; a
decode step that raises leaves caches and drafter context half written and is not caught here.
"""

from __future__ import annotations

import logging

from ..core.sampling import SamplingParams
from .request import Request, RequestOutput, RequestStats
from .step_state import _Seq

logger = logging.getLogger(__name__)

PROBE_ID = "adaflash-admission-probe"
PROBE_PROMPT_LEN = 4


class EngineFailure(RuntimeError):
    """The engine failed in a way no request can be blamed for; its state is not to be trusted."""


def admit_waiting(engine) -> list[RequestOutput]:
    """Prefill the waiting requests that fit (one at a time while a failed group is retried);
    returns the requests that finished at once, failed ones included."""
    room = engine.max_batch_size - len(engine.running)
    if engine.solo_admissions:
        room = min(room, 1)
    joined = [engine.waiting.popleft() for _ in range(min(room, len(engine.waiting)))]
    if not joined:
        return []
    if engine.solo_admissions:
        engine.solo_admissions -= 1
    error = _prefill_or_undo(engine, joined)
    if error is None:
        return engine._retire()  # e.g. max_new_tokens 1, or a stop token first
    if len(joined) > 1:  # find the one to blame: each again, alone, ahead of the others
        engine.waiting.extendleft(reversed(joined))
        engine.solo_admissions += len(joined)
        logger.warning("adaflash engine: the prefill of %d requests failed (%s); admitting them one by one",
                       len(joined), _describe(error))
        return []
    probe_error, finished = _probe(engine)
    if probe_error is not None:
        raise EngineFailure(
            f"the engine cannot prefill even a probe request ({_describe(probe_error)}); the request it was "
            f"admitting failed with {_describe(error)}") from probe_error
    (seq,) = joined
    logger.error("adaflash engine: request %s failed at admission and was dropped (the engine serves the "
                 "others)", seq.req.request_id, exc_info=error)
    return finished + [RequestOutput(
        seq.req.request_id, list(seq.req.prompt_ids), [], "error", seq.stats,
        f"the engine failed on this request ({_describe(error)}); it was dropped, the other requests "
        "were not affected", seq.req.domain, fault=True)]


def _prefill_or_undo(engine, joined) -> BaseException | None:
    """engine._prefill(joined); if it raises, undo it and return the exception."""
    offset = len(engine.running)
    rewind = [(s.generator, s.generator.get_state()) for s in joined if s.generator is not None]
    try:
        engine._prefill(joined)
    except Exception as e:
        del engine.running[offset:]
        if engine.proposer is not None:
            for slot in range(offset, offset + len(joined)):
                engine.proposer.release(slot)
        for generator, state in rewind:
            generator.set_state(state)
        for seq in joined:
            seq.output.clear()
            seq.cache_len, seq.pending, seq.finish, seq.prompt_feats = 0, 0, None, None
        return e
    return None


def _probe(engine) -> tuple[BaseException | None, list[RequestOutput]]:
    """Admit and retire a tiny greedy request: (its exception or None, the other requests that
    retiring it returned: none, since finished requests are retired at the end of each step)."""
    probe = _Seq(req=Request([0] * PROBE_PROMPT_LEN, SamplingParams(max_new_tokens=1), PROBE_ID),
                 index=-1, stats=RequestStats(engine.block_size))
    error = _prefill_or_undo(engine, [probe])
    if error is not None:
        return error, []
    probe.finish = probe.finish or "abort"  # one token is its whole budget; retiring frees the slot
    return None, [out for out in engine._retire() if out.request_id != PROBE_ID]


def _describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
