"""Shared test helpers: chat prompts and the 'same tokens' rule of the engine issue."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

CHAT_QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about databases.",
    "Explain what a B-tree is in two sentences.",
    "List three prime numbers greater than 50.",
    "Translate 'good morning' into Spanish and German.",
    "Why is the sky blue?",
    "Give me a SQL query that counts rows in a table named orders.",
    "Summarize the plot of Romeo and Juliet in one sentence.",
    "What is 17 times 23?",
    "Name a famous painting by Vincent van Gogh.",
    "How do I reverse a list in Python?",
    "Classify the sentiment of this review as positive or negative: 'The battery died in a day.'",
]


def chat(question: str) -> list[dict]:
    return [{"role": "user", "content": question}]


def assert_same_tokens(engine, prompt_ids: list[int], ref: list[int], got: list[int]) -> None:
    """Identical, or at the first difference a float near-tie in the reference.

    Near-tie: the reference's top-2 logit margin there is below 1e-4 (teacher-forced through
    the same engine, whose logits at that point are what both runs saw up to float noise)."""
    if ref == got:
        return
    i = next((k for k, (a, b) in enumerate(zip(ref, got, strict=False)) if a != b), None)
    if i is None:  # one is a prefix of the other: only a stop at a near-tie explains it
        i = min(len(ref), len(got))
        if i == len(ref) == len(got):
            return
    logits = engine.logits(prompt_ids + ref[:i])[-1]
    top2 = logits.topk(2).values
    margin = float(top2[0] - top2[1])
    assert margin < 1e-4, (
        f"tokens differ at generated position {i}: ref {ref[i:i+3]} got {got[i:i+3]}, "
        f"reference top-2 margin {margin:.3g} is not a near-tie"
    )


def as_windowed_mistral(src: Path, dst: Path, window: int) -> Path:
    """A copy of a Llama model directory (bench/random_model.py's) as a MistralForCausalLM
    whose every layer has a sliding window: the same weights and names."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(architectures=["MistralForCausalLM"], model_type="mistral",
               sliding_window=window)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst
