"""Tokenizer and chat template, whatever file format the model came from."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jinja2
import jinja2.sandbox
from tokenizers import Tokenizer


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


@dataclass
class ModelTokenizer:
    tokenizer: Tokenizer
    chat_template: str | None
    bos_token: str | None = None
    eos_token: str | None = None
    add_bos: bool = False

    def __post_init__(self) -> None:
        # Chat templates come from model files: render them sandboxed.
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise_exception
        self._template = env.from_string(self.chat_template) if self.chat_template else None

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special: bool = False) -> list[int]:
        """Token ids of `text`; special-token strings in it are parsed as special tokens."""
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        if add_special and self.add_bos and self.bos_token is not None:
            ids = [self.tokenizer.token_to_id(self.bos_token), *ids]
        return ids

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special)

    def token_id(self, token: str) -> int | None:
        return self.tokenizer.token_to_id(token)

    def single_token_variants(self, word: str) -> list[int]:
        """Ids of the one-token spellings of `word` (yes, Yes, " yes", ...) in this vocabulary.

        Multi-token spellings are left out: their first token also starts other words."""
        forms = {word, word.lower(), word.capitalize(), word.upper()}
        ids = {self.encode(p + f)[0] for f in forms for p in ("", " ")
               if len(self.encode(p + f)) == 1}
        return sorted(ids)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True
    ) -> str:
        if self._template is None:
            raise ValueError("this model has no chat template; pass a plain prompt instead")
        return self._template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
        )
