"""Stop strings found as tokens arrive, without re-decoding the whole output every token.

A match that earlier tokens did not complete ends in the text the new token adds, so it
starts at most len(longest stop string) - 1 characters before that text: only that window is
searched. The new text comes from decoding just the tokens since the last whole character
(one, unless a multi-byte character is split across tokens), after those committed before
them: decoders treat a text's first token specially (SentencePiece drops its leading
space), so the new text is what decoding both adds to decoding the committed ones alone.

tokenizers' DecodeStream does the decoding part, but it holds back the text of a token that
ends in half a character, where the whole-output decode shows U+FFFD and so may already
contain a stop string (a space before the character, say): this module searches that text
too, so it stops on the same token as the whole-output check.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


class StopStringWatch:
    """One generated sequence's stop-string check: add() each new token id; True when the
    text so far first contains one of `stops` (non-empty strings), as
    `any(s in decode(ids) for s in stops)` would say."""

    def __init__(self, decode: Callable[[list[int]], str], stops: Sequence[str]):
        self._decode = decode
        self._stops = list(stops)
        self._keep = max(map(len, self._stops)) - 1
        self._tail = ""  # the last _keep characters of the committed text
        self._context: list[int] = []  # the last committed tokens, and their text alone
        self._context_text = ""
        self._pending: list[int] = []  # tokens since the last whole character

    def add(self, token_id: int) -> bool:
        self._pending.append(token_id)
        new = self._decode(self._context + self._pending)[len(self._context_text):]
        window = self._tail + new
        found = any(s in window for s in self._stops)
        if not new.endswith("\ufffd"):  # whole characters: commit them
            self._tail = window[-self._keep:] if self._keep else ""
            self._context, self._context_text = self._pending, self._decode(self._pending)
            self._pending = []
        return found
