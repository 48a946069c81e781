"""The standard 400-row workload the engine and its peers are measured on."""

from __future__ import annotations


def review_messages(rows: int = 400) -> list[list[dict]]:
    """Row i: a review that is positive for odd i and negative for even i."""
    out = []
    for i in range(rows):
        good = i % 2 == 1
        review = (f"Product number {i} was {'great' if good else 'terrible'} "
                  f"and I {'loved' if good else 'hated'} it.")
        text = f"Classify the sentiment of this review as positive or negative: '{review}'"
        out.append([{"role": "user", "content": text}])
    return out
