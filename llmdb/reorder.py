"""Field and row order that maximize shared prompt prefixes (GGR, Liu et al. 2024).

When a prompt is an instruction followed by several "field: value" lines and the user allows
the fields in any order, the order decides how much of each prompt the engine's prefix cache
can reuse. Greedy Group Recursion: pick the (field, value) whose rows gain the most from
sharing it (value length squared times the rows that would reuse it), put that field first
for those rows and keep them together, then recurse on their remaining fields and,
separately, on the other rows. Exact optimization is NP-hard; GGR is the paper's heuristic.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

MAX_DEPTH = 8  # deeper recursion buys little: later fields are short tails


def ggr(rows: Sequence[dict[str, str]], fields: Sequence[str]) -> list[tuple[int, list[str]]]:
    """(row index, field order) for every row, in the order to submit them."""
    return _ggr(list(range(len(rows))), rows, list(fields), 0)


def _ggr(idx: list[int], rows: Sequence[dict[str, str]], fields: list[str],
         depth: int) -> list[tuple[int, list[str]]]:
    if not idx:
        return []
    if len(idx) == 1 or not fields or depth >= MAX_DEPTH:
        return [(i, _by_sharing(idx, rows, fields)) for i in idx]
    best, best_score = None, 0
    for f in fields:
        counts = Counter(rows[i][f] for i in idx)
        for value, count in counts.items():
            score = len(value) ** 2 * (count - 1)
            if score > best_score:
                best, best_score = (f, value), score
    if best is None:  # every value is unique: nothing to share
        return [(i, _by_sharing(idx, rows, fields)) for i in idx]
    f, value = best
    group = [i for i in idx if rows[i][f] == value]
    rest = [i for i in idx if rows[i][f] != value]
    inner = _ggr(group, rows, [g for g in fields if g != f], depth + 1)
    return [(i, [f, *order]) for i, order in inner] + _ggr(rest, rows, fields, depth + 1)


def _by_sharing(idx: list[int], rows: Sequence[dict[str, str]], fields: list[str]) -> list[str]:
    """Fields with fewer distinct values first (a stable default for leftover rows)."""
    return sorted(fields, key=lambda f: len({rows[i][f] for i in idx}))


def render(instruction: str, row: dict[str, str], order: Sequence[str]) -> str:
    return instruction + "\n\n" + "\n".join(f"{f}: {row[f]}" for f in order)


def shared_prefix_chars(prompts: Sequence[str]) -> int:
    """Characters each prompt shares with the one before it (what a prefix cache can reuse)."""
    total = 0
    for a, b in zip(prompts, prompts[1:], strict=False):
        n = 0
        for x, y in zip(a, b, strict=False):
            if x != y:
                break
            n += 1
        total += n
    return total
