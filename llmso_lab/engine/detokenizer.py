"""Incremental detokenization with stop strings, as vLLM's output processor does it.

A streamed answer is text, but the engine emits token ids. Each new token may change how the previous ones decode
(a multi-byte character split over two tokens, a leading space merged into a word), so the text is decoded from all
output ids each time and only what is settled is sent: text that ends in an incomplete character (U+FFFD) waits for
the next token, and so does a tail that could still grow into a stop string (an answer cut by max_tokens inside a
character ends before it, as vLLM's). When a stop string appears, once `min_tokens` tokens are out, the text before it
is the answer (the stop string itself is left out, vLLM's default) and the request is done."""
from __future__ import annotations

from typing import Callable


class IncrementalDetokenizer:
    """One sample's text so far. `decode(ids) -> str`; `stop`: strings that end the answer."""

    def __init__(self, decode: Callable[[list[int]], str], stop: list[str] | None = None, min_tokens: int = 0) -> None:
        self.decode = decode
        self.stop = [s for s in (stop or []) if s]
        self.min_tokens = min_tokens   # vLLM: no stop string ends the answer before min_tokens tokens are out
        self.holdback = max((len(s) for s in self.stop), default=1) - 1   # a tail that may be a stop string's start
        self.ids: list[int] = []
        self.sent = 0                # characters of the text already handed out
        self.stopped_at: str | None = None   # the stop string that ended the answer

    def add(self, token_ids: list[int], final: bool = False) -> str:
        """Take the sample's new tokens; return the text now safe to send (`final`: no more tokens follow)."""
        if self.stopped_at is not None:
            return ""
        self.ids += token_ids
        text = self.decode(self.ids)
        cut = self._first_stop(text) if len(self.ids) >= self.min_tokens else None
        if cut is not None:
            return self._emit(text[:cut])
        if final:   # the last token may end inside a character (a max_tokens cut): that half is not text
            end = len(text)
            while end > self.sent and text[end - 1] == "\ufffd":
                end -= 1
            return self._emit(text[:end])
        settled = len(text) - self.holdback
        while settled > self.sent and text[settled - 1] == "\ufffd":   # an incomplete character: wait
            settled -= 1
        return self._emit(text[:settled])

    def _first_stop(self, text: str) -> int | None:
        """Where the earliest stop string starts (searched from just before the text already sent)."""
        start = max(0, self.sent - self.holdback)
        hits = [(i, s) for s in self.stop if (i := text.find(s, start)) >= 0]
        if not hits:
            return None
        i, s = min(hits)
        self.stopped_at = s
        return i

    def _emit(self, upto: str) -> str:
        out = upto[self.sent:]
        self.sent = max(self.sent, len(upto))
        return out

    @property
    def text(self) -> str:
        """Everything handed out so far."""
        full = self.decode(self.ids)
        return full[:self.sent]
