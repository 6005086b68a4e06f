"""Traffic records of served requests, written off the engine thread.

Every finished request becomes one record in the project's format (docs/contracts.md,
"Traffic record") through :class:`~sglang_adaflash.serving.traffic.TrafficWriter`, under
``$ADAFLASH_HOME/traffic/<writer>/``: the on-policy data the distillation job learns from.
Records hold token ids only; text is added only when the operator of the server opted in
(``--log-text``). Token ids are as sensitive as text, since the shipped tokenizer decodes
them; a request that sets ``metadata.adaflash_no_log`` (or the ``x-adaflash-no-log`` header)
leaves no record at all.

Writing goes through a queue to one writer thread: a shard rotation fsyncs, and neither the
engine loop nor the event loop may wait for a disk.
"""

from __future__ import annotations

import copy
import logging
import queue
import threading

from ..engine.request import RequestOutput
from ..serving.traffic import TrafficRecord, TrafficWriter

logger = logging.getLogger(__name__)

_CLOSE = object()


class TrafficRecorder:
    def __init__(self, writer: TrafficWriter, *, model: str, tokenizer=None,
                 target_digest: str | None = None):
        self.writer = writer
        self.model = model
        self.target_digest = target_digest
        # Text is decoded here, on this thread: a private tokenizer copy, since Hugging Face
        # fast tokenizers are not safe to share with the event loop's thread.
        self._tokenizer = copy.deepcopy(tokenizer) if writer.include_text and tokenizer else None
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self.written = 0
        self.skipped = 0
        self.failed = 0
        self._thread = threading.Thread(target=self._run, name="adaflash-traffic", daemon=True)
        self._thread.start()

    def record(self, job, out: RequestOutput, version: str | None) -> None:
        """Queue a finished request's record (called on the engine thread: must not block)."""
        if job.no_log or out.finish_reason == "error":
            self.skipped += 1
            return
        finish = job.finish_as if out.finish_reason == "abort" and job.finish_as else out.finish_reason
        sp = job.request.sampling
        sampling = {"temperature": sp.temperature, "top_p": sp.top_p, "top_k": sp.top_k}
        self._queue.put((out, version, finish, sampling))

    def close(self, timeout: float = 30.0) -> None:
        """Write what is queued, then close the open shard."""
        self._queue.put(_CLOSE)
        self._thread.join(timeout)
        self.writer.close()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is _CLOSE:
                return
            out, version, finish, sampling = item
            try:
                self.writer.write(self._build(out, version, finish, sampling))
                self.written += 1
            except Exception:  # a full disk loses records, never requests
                self.failed += 1
                logger.exception("adaflash serve: writing the traffic record of %s failed",
                                 out.request_id)

    def _build(self, out: RequestOutput, version: str | None, finish: str,
               sampling: dict) -> TrafficRecord:
        s = out.stats
        record = TrafficRecord(
            id=out.request_id,
            model=self.model,
            drafter_version=version,
            prompt_ids=list(out.prompt_ids),
            output_ids=list(out.output_ids),
            sampling=sampling,
            accept_lens=list(s.accept_lens),
            finish_reason=finish,
            domain=out.domain,
            target_digest=self.target_digest,
        )
        if self._tokenizer is not None:
            record.prompt_text = self._tokenizer.decode(out.prompt_ids, skip_special_tokens=False)
            record.output_text = self._tokenizer.decode(out.output_ids, skip_special_tokens=True)
        return record
