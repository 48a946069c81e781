"""Streamed text that is always a prefix of the final answer.

Text is sent as tokens complete whole characters (a multi-byte character split across
tokens waits for its last byte), less the last len(longest stop string) - 1 characters,
which may be the start of a stop string the final answer will not contain; the end settles
them. Each token is decoded once (engine/detokenize.py), not the whole output every token.
"""

from __future__ import annotations

from collections.abc import Sequence

from llmdb.engine.detokenize import TextStream
from llmdb.engine.outputs import RequestResult


class IncrementalText:
    def __init__(self, tokenizer, stops: Sequence[str]):
        self.stream = TextStream(tokenizer.decode)
        self.stops = list(stops)
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.unsent = ""  # whole text not sent yet
        self.sent = 0  # characters sent
        self.stopped = False

    def push(self, token: int) -> str:
        """The new text that is safe to send after the next generated token."""
        if self.stopped:
            return ""
        new, whole = self.stream.add(token)
        if whole:
            self.unsent += new
        # A stop string starting in the text already sent would have ended within the
        # held-back characters, and been found then: only the unsent text is searched.
        text = self.unsent
        cut = min((text.find(s) for s in self.stops if s in text), default=None)
        self.stopped = cut is not None
        safe = cut if self.stopped else max(0, len(text) - self.hold)
        piece, self.unsent = text[:safe], text[safe:]
        self.sent += len(piece)
        return piece

    def flush(self, result: RequestResult) -> str:
        """The rest of the final answer."""
        piece = result.text[self.sent :]
        self.sent = len(result.text)
        return piece
