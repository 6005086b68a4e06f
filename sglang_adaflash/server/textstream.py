"""Token ids to text, incrementally, with OpenAI stop strings.

Streamed chunks must join to exactly the text a non-streamed request gets, so both paths run
this one class: a non-streamed request simply feeds every id at once. Text is always decoded
from the whole output (tokenizers merge bytes and spaces across tokens, so per-token pieces do
not add up), and a chunk is released only when later tokens cannot change it:

- a trailing U+FFFD may be the first bytes of a character whose rest is still to come;
- the last ``len(longest stop) - 1`` characters may be the start of a stop string, which must
  never reach the client.

At a stop string the text ends just before it, and the caller aborts the request in the engine.
"""

from __future__ import annotations

REPLACEMENT = "\ufffd"


class TextStream:
    def __init__(self, tokenizer, stops: list[str] | None = None):
        self.tokenizer = tokenizer
        self.stops = [s for s in (stops or []) if s]
        self._hold = max((len(s) for s in self.stops), default=1) - 1
        self.text = ""  # released so far
        self.stopped = False  # a stop string matched: the text is final
        self._full = ""

    def _decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:  # a target without a tokenizer: ids only, no text
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def update(self, ids: list[int]) -> str:
        """Feed the whole output so far; returns the newly released text (maybe empty)."""
        if self.stopped:
            return ""
        full = self._full = self._decode(ids)
        if self.stops:
            # Released text never holds the start of a stop: it ended `hold` characters early.
            hits = [at for at in (full.find(s, len(self.text)) for s in self.stops) if at != -1]
            if hits:
                self.stopped = True
                return self._release(full, min(hits))
        end = len(full) - self._hold
        while end > len(self.text) and full[end - 1] == REPLACEMENT:
            end -= 1
        return self._release(full, end)

    def finish(self) -> str:
        """The output is complete: release everything still held back."""
        if self.stopped:
            return ""
        return self._release(self._full, len(self._full))

    def _release(self, full: str, end: int) -> str:
        if end <= len(self.text) or not full.startswith(self.text):
            # Nothing new, or an earlier release is no longer a prefix (a decoder that rewrites
            # the past): never send text twice, wait for the output to settle instead.
            return ""
        piece = full[len(self.text):end]
        self.text += piece
        return piece
