"""Prompts of the backends that hold the model's tokenizer (local, vllm): chat messages for a
model with a chat template; for a base model (none), llm_complete's prompt as the token ids
it continues, and the functions that ask chat questions refused naming the model."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from .base import Exchange, Prompt, chat_messages

if TYPE_CHECKING:  # (the engine's tokenizer; these backends load the engine anyway)
    from llmdb.engine.models.tokenizer import ModelTokenizer


def _base_model(name: str) -> str:
    return f"{name} is a base model (no chat template)"


def chat_prompt(tokenizer: ModelTokenizer, name: str, user: str, system: str | None,
                before: Sequence[Exchange] = ()) -> list[dict[str, str]]:
    """The chat messages; the model's side encodes them with the template, row text as
    text."""
    if not tokenizer.has_chat_template:
        raise ValueError(f"{_base_model(name)}: llm_filter and llm_classify ask it chat "
                         f"questions, which need an instruction-tuned model (llm_complete "
                         f"continues plain text on it)")
    return chat_messages(user, system, before)


def completion_prompt(tokenizer: ModelTokenizer, name: str, prompt: str,
                      system: str | None) -> Prompt:
    """The chat; for a base model the prompt's own token ids, which it continues as a
    completions endpoint would (the text encoded as data, so a marker string in a row stays
    text)."""
    if tokenizer.has_chat_template:
        return chat_messages(prompt, system)
    if system is not None:
        raise ValueError(f"{_base_model(name)}: it takes no system prompt (put the "
                         f"instruction in the prompt)")
    return tokenizer.encode_plain_prompt(prompt)
