"""Stop strings found as tokens arrive, without re-decoding the whole output every token.

A match that earlier tokens did not complete ends in the text the new token adds, so it
starts at most len(longest stop string) - 1 characters before that text: only that window is
searched. The new text comes from detokenize.TextStream, half characters included, so a stop
string that the whole-output decode shows before a U+FFFD stops on the same token.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from .detokenize import TextStream


class StopStringWatch:
    """One generated sequence's stop-string check: add() each new token id; True when the
    text so far first contains one of `stops` (non-empty strings), as
    `any(s in decode(ids) for s in stops)` would say."""

    def __init__(self, decode: Callable[[list[int]], str], stops: Sequence[str]):
        self._text = TextStream(decode)
        self._stops = list(stops)
        self._keep = max(map(len, self._stops)) - 1
        self._tail = ""  # the last _keep characters of the committed text

    def add(self, token_id: int) -> bool:
        new, whole = self._text.add(token_id)
        window = self._tail + new
        if whole:
            self._tail = window[-self._keep:] if self._keep else ""
        return any(s in window for s in self._stops)
