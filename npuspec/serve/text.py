"""Streaming a request's text: incremental detokenisation and stop strings.

Text is decoded incrementally, as vLLM's detokenizer does: each step decodes a short window
(from `prefix` on) with and without the new tokens and takes the difference, so the
decoder's context (a leading-space rule, a byte-level merge) is the same as in a whole
decode, at constant cost per step. New text ending in U+FFFD (half of a UTF-8 character)
waits for the next token. Of the text, the last len(longest stop) - 1 characters are held
back, so a stop string split across two steps never leaks.
"""
from __future__ import annotations

from typing import Optional


class TextStream:
    def __init__(self, tokenizer, stop: list[str]):
        self.tok = tokenizer
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.ids: list[int] = []
        self.prefix = self.read = 0  # the decode window: ids[prefix:read] are in self.text
        self.text = ""          # decoded so far (cut at a stop string once one is found)
        self.sent = 0           # characters of self.text already returned
        self.stopped = False    # a stop string was found
        self.num_tokens = 0     # tokens up to and including the one completing the stop

    def _decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True) if self.tok is not None else ""

    def add(self, new_ids: list[int], final: bool = False) -> str:
        """Take a step's tokens; return the text now safe to send."""
        if self.stopped:
            return ""
        start = len(self.ids)
        self.ids += new_ids
        self.num_tokens = len(self.ids)
        self._extend(final)
        cut = self._find_stop(self.text)
        if cut is not None:
            self.stopped = True
            self.text = self.text[:cut]
            self.num_tokens = self._tokens_to_stop(start)
            final = True
        end = len(self.text) if final else len(self.text) - self.hold
        if end <= self.sent:
            return ""
        out = self.text[self.sent:end]
        self.sent = end
        return out

    def _extend(self, final: bool) -> None:
        seen = self._decode(self.ids[self.prefix:self.read])
        full = self._decode(self.ids[self.prefix:])
        if len(full) > len(seen) and (final or not full.endswith("\ufffd")):
            self.text += full[len(seen):]
            self.prefix, self.read = self.read, len(self.ids)

    def _find_stop(self, text: str) -> Optional[int]:
        # a stop can only start where the unsent tail (plus the hold) begins
        lo = max(0, self.sent - self.hold)
        hits = [i for i in (text.find(s, lo) for s in self.stop) if i >= 0]
        return min(hits) if hits else None

    def _tokens_to_stop(self, start: int) -> int:
        for n in range(start + 1, len(self.ids) + 1):
            if self._find_stop(self._decode(self.ids[:n])) is not None:
                return n
        return len(self.ids)
