"""Streamed text that is always a prefix of the final answer.

Decoding a growing list of ids can end in half a multi-byte character (U+FFFD) and can end in
the first characters of a stop string that the final answer will not contain; both are held
back until the next token or the end settles them.
"""

from __future__ import annotations

from collections.abc import Sequence

from llmdb.engine.outputs import RequestResult


class IncrementalText:
    def __init__(self, tokenizer, stops: Sequence[str]):
        self.tokenizer = tokenizer
        self.stops = list(stops)
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.sent = 0

    def push(self, ids: list[int]) -> str:
        """The new text that is safe to send after `ids` (all generated ids so far)."""
        text = self.tokenizer.decode(ids)
        cut = min((text.find(s) for s in self.stops if s in text), default=len(text))
        safe = min(cut, len(text) - self.hold)
        while safe > self.sent and text[safe - 1] == "\ufffd":
            safe -= 1
        if safe <= self.sent:
            return ""
        piece, self.sent = text[self.sent : safe], safe
        return piece

    def flush(self, result: RequestResult) -> str:
        """The rest of the final answer."""
        piece = result.text[self.sent :]
        self.sent = len(result.text)
        return piece
