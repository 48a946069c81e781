"""The text of a growing token sequence, decoded as tokens arrive without re-decoding it all.

Each token's text is what decoding the tokens since the last whole character (one, unless a
multi-byte character is split across tokens) adds to decoding the ones committed before them
alone: decoders treat a text's first token specially (SentencePiece drops its leading space),
so the new text is the difference of two decodes that start at the same token.

tokenizers' DecodeStream does the same, but it returns nothing for a token that ends in half a
character, where the whole-sequence decode shows U+FFFD and may already contain a stop string
(a space before the character, say): the stop-string check needs that text, so it is returned
here, marked not whole.
"""

from __future__ import annotations

from collections.abc import Callable


class TextStream:
    def __init__(self, decode: Callable[[list[int]], str]):
        self._decode = decode
        self._context: list[int] = []  # the last committed tokens, and their text alone
        self._context_text = ""
        self._pending: list[int] = []  # tokens since the last whole character

    def add(self, token_id: int) -> tuple[str, bool]:
        """The text the tokens since the last whole character add, and whether it is whole
        (it ends in no half character). Whole text is committed: the next call returns the
        text after it."""
        self._pending.append(token_id)
        new = self._decode(self._context + self._pending)[len(self._context_text):]
        whole = not new.endswith("\ufffd")
        if whole:
            text = self._decode(self._pending)
            if text or not self._context_text:
                self._context, self._context_text = self._pending, text
            else:  # no text of their own (a special token, skipped; a lone "▁"): the
                # text before them stays the anchor, or the next token would be decoded as a
                # text's first
                self._context = self._context + self._pending
                self._context_text = self._decode(self._context)
            self._pending = []
        return new, whole
