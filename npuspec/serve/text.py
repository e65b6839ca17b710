"""Streaming a request's text: incremental detokenisation and stop strings.

Text is decoded from the request's whole output each time (so multi-token characters and
byte-level merges come out right) and only the part no later token can change is sent: a
trailing U+FFFD (half of a UTF-8 character) is held back, and so are the last
len(longest stop) - 1 characters, so a stop string split across two steps never leaks.
"""
from __future__ import annotations

from typing import Optional


class TextStream:
    def __init__(self, tokenizer, stop: list[str]):
        self.tok = tokenizer
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.ids: list[int] = []
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
        self.text = self._decode(self.ids)
        cut = self._find_stop(self.text)
        if cut is not None:
            self.stopped = True
            self.text = self.text[:cut]
            self.num_tokens = self._tokens_to_stop(start)
            final = True
        end = len(self.text)
        if not final:
            end -= self.hold
            while end > self.sent and self.text[end - 1] == "\ufffd":
                end -= 1
        if end <= self.sent:
            return ""
        out = self.text[self.sent:end]
        self.sent = end
        return out

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
