"""Tokenizer and chat template, whatever file format the model came from.

Chat turns are encoded so that message text can never forge the template's structure: only
the markers the template itself writes (<|im_start|>, <|eot_id|>, its BOS, ...) become
special tokens; the same strings inside a message's content are encoded as plain text.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import jinja2
import jinja2.sandbox
from tokenizers import Tokenizer

from .spm import PieceDecoder


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


@dataclass
class ModelTokenizer:
    tokenizer: Tokenizer
    chat_template: str | None
    bos_token: str | None = None
    eos_token: str | None = None
    add_bos: bool = False
    add_eos: bool = False
    # A SentencePiece vocabulary (a GGUF's tokenizer model 'llama'), decoded as llama.cpp
    # does (spm.PieceDecoder): whether its encoding puts a space before the text, which
    # decoding drops. None: another vocabulary, decoded by `tokenizer`'s decoder.
    spm_space_prefix: bool | None = None

    def __post_init__(self) -> None:
        # Chat templates come from model files: render them sandboxed.
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise_exception
        self._template = env.from_string(self.chat_template) if self.chat_template else None

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special: bool = False) -> list[int]:
        """Token ids of `text`; special-token strings in it are parsed as special tokens.

        For prompts their author wrote whole; text from data goes through encode_plain."""
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        if add_special and self.add_bos and self.bos_token is not None:
            ids = [self.tokenizer.token_to_id(self.bos_token), *ids]
        if add_special and self.add_eos and self.eos_token is not None:
            ids = [*ids, self.tokenizer.token_to_id(self.eos_token)]
        return ids

    def encode_plain(self, text: str) -> list[int]:
        """Token ids of `text` as data: a marker string in it (<|im_end|>) stays text."""
        return self._plain.encode(text, add_special_tokens=False).ids

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    def encode_plain_prompt(self, text: str) -> list[int]:
        """A prompt of data alone, for a base model (no chat template) to continue: its BOS
        token where it starts with one, then the text as data (encode_plain)."""
        bos = self.tokenizer.token_to_id(self.bos_token) if self.bos_token is not None else None
        return [*([bos] if self.add_bos and bos is not None else []), *self.encode_plain(text)]

    @cached_property
    def marker_ids(self) -> frozenset[int]:
        """Tokens that structure a chat: every special added token but the unknown token,
        and every other added token the chat template writes or names as BOS or EOS (some
        models ship their turn markers as non-special)."""
        template = self.chat_template or ""
        named = {self.bos_token, self.eos_token}
        return frozenset(
            i for i, t in self.tokenizer.get_added_tokens_decoder().items()
            if t.content in template or t.content in named
            or (t.special and i != self._unk_id))

    @cached_property
    def _unk_id(self) -> int | None:
        """The token a vocabulary without byte fallback encodes what it lacks as: special
        in tokenizer.json, but data's own (an emoji, a rare script), not a marker unless the
        template writes it or it is the BOS or EOS too (as some vocabularies have it)."""
        model = json.loads(self.tokenizer.to_str())["model"]
        if isinstance(model.get("unk_id"), int):  # (Unigram names it by id)
            return model["unk_id"]
        unk = model.get("unk_token")
        return self.tokenizer.token_to_id(unk) if isinstance(unk, str) else None

    @cached_property
    def _plain(self) -> Tokenizer:
        # A copy in which every marker is special, with special-token matching off: the
        # tokenizers library then encodes marker strings like any other text.
        spec = json.loads(self.tokenizer.to_str())
        for entry in spec.get("added_tokens", []):
            if entry["id"] in self.marker_ids:
                entry["special"] = True
        plain = Tokenizer.from_str(json.dumps(spec))
        plain.encode_special_tokens = True
        return plain

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    continue_final: bool = False,
                    template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
        """Token ids of the chat: the template's markers are special tokens, message
        contents are plain text. Identical to encoding the rendered string whenever the
        contents hold no marker strings.

        continue_final: the last message is an assistant's answer to go on with, so the chat
        ends with its text (no end-of-turn after it, no generation prompt). template_kwargs:
        more variables for the template (enable_thinking=True, say)."""
        if continue_final and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both "
                             "be true")
        if continue_final and (messages[-1].get("role") != "assistant"
                               or not isinstance(messages[-1].get("content"), str)):
            raise ValueError("continue_final_message needs an assistant message last")
        text, spans = self._render_with_spans(messages, add_generation_prompt,
                                              template_kwargs)
        if continue_final:  # cut after the last message's text: its turn stays open
            ends = [e for _, e, i in spans if i == len(messages) - 1]
            if not ends:
                raise ValueError("this model's chat template does not write the final "
                                 "assistant message, so it cannot be continued")
            text = text[:ends[-1]]
        enc = self.tokenizer.encode(text, add_special_tokens=False)
        forged = [(s, e) for tid, (s, e) in zip(enc.ids, enc.offsets, strict=True)
                  if tid in self.marker_ids and _overlaps(s, e, spans)]
        if not forged:
            return list(enc.ids)
        # Keep the markers that lie in template text; re-encode the text between them plain.
        ids, pos = [], 0
        for tid, (s, e) in zip(enc.ids, enc.offsets, strict=True):
            if tid in self.marker_ids and not _overlaps(s, e, spans):
                ids += self._encode_run(text[pos:s])
                ids.append(tid)
                pos = e
        return ids + self._encode_run(text[pos:])

    def _encode_run(self, text: str) -> list[int]:
        """Plain ids of text between two of the template's markers."""
        ids = self.encode_plain(text) if text else []
        # A vocabulary that lists a marker as a plain word (word-level tokenizers) still
        # yields it: refuse rather than let data end a turn.
        forged = [t for t in ids if t in self.marker_ids]
        if forged:
            raise ValueError(
                f"the text contains {self.tokenizer.id_to_token(forged[0])!r}, a chat marker "
                f"that this model's tokenizer cannot encode as plain text")
        return ids

    def _render_with_spans(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
                           template_kwargs: Mapping[str, Any] | None
                           ) -> tuple[str, list[tuple[int, int, int]]]:
        """The rendered chat, and where message contents lie in it: (start, end, index of
        the message) for each place the template writes one.

        The template is rendered once with unguessable placeholders for the contents, which
        shows where it puts each one, and once with the contents themselves."""
        opening = f"\ue000{secrets.token_hex(8)}:"
        masked = [{**m, "content": f"{opening}{i}\ue001"}
                  if isinstance(m.get("content"), str) else m for i, m in enumerate(messages)]
        # [text, index, text, index, ..., text]. (Not re.split on a pattern holding the
        # nonce: each call compiled one into the process-wide regex cache, 512 entries that
        # every library's re calls share, and pushed theirs out.)
        first, *rest = self.apply_chat_template(masked, add_generation_prompt,
                                                template_kwargs).split(opening)
        pieces = [first]
        for part in rest:
            index, _, after = part.partition("\ue001")
            pieces += [index, after]
        text = self.apply_chat_template(messages, add_generation_prompt, template_kwargs)
        # Templates write a content as is or trimmed (Llama 3's `| trim`).
        for transform in _CONTENT_TRANSFORMS:
            spans, pos, out = [], 0, []
            for k, piece in enumerate(pieces):
                if k % 2:
                    index = int(piece)
                    piece = transform(messages[index]["content"])
                    spans.append((pos, pos + len(piece), index))
                out.append(piece)
                pos += len(piece)
            if "".join(out) == text:
                return text, spans
        raise ValueError("this model's chat template rewrites message text, so its own markers "
                         "cannot be told apart from the text's: use a plain prompt")

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
        if self._pieces is not None:
            return self._pieces.decode(ids, skip_special)
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special)

    def token_text(self, token: int) -> str:
        """The text `token` adds after other text, special tokens written out (a logprobs
        entry's token). Decoded alone, a SentencePiece token (and a Hugging Face Llama
        tokenizer's) loses its leading space, which only the start of a text drops: " Paris"
        would read "Paris". So it is decoded after an anchor token, whose text is taken off."""
        anchor, skip = self._anchor
        return self.decode([anchor, token], skip_special=False)[skip:]

    @cached_property
    def _anchor(self) -> tuple[int, int]:
        """A plain token (the last of "a.") and the length of its text."""
        anchor = self.encode_plain("a.")[-1]
        return anchor, len(self.decode([anchor], skip_special=False))

    @cached_property
    def _pieces(self) -> PieceDecoder | None:
        if self.spm_space_prefix is None:
            return None
        return PieceDecoder(self.tokenizer, self.spm_space_prefix)

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
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """The rendered chat. template_kwargs: more template variables, or enable_thinking."""
        template_kwargs = template_kwargs or {}
        if self._template is None:
            # (llm_filter and llm_classify send chat messages; llm_complete sends a base
            # model its prompt's own tokens: llmdb/backends/local.py)
            raise ValueError("this model has no chat template (a base model?), so chat "
                             "messages cannot be encoded: use an instruction-tuned model, or "
                             "give the engine a plain prompt (text or token ids)")
        taken = sorted(_TEMPLATE_OWN & template_kwargs.keys())
        if taken:
            raise ValueError(f"chat template variable {taken[0]!r} is set by the server, not "
                             f"by chat_template_kwargs")
        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                # Reasoning models' templates (Qwen3's) open a <think> block unless told
                # not to: hundreds of tokens a row that a row's answer does not want, whose
                # text would land in the answer, and a label scored after the prompt would
                # follow an unfinished thought. Other templates ignore the variable.
                **{"enable_thinking": False, **template_kwargs},
            )
        except jinja2.TemplateError as e:  # (raise_exception: "roles must alternate", ...)
            raise ValueError(f"the model's chat template refused these messages: {e}") from e


# The variables apply_chat_template sets itself (add_generation_prompt has its own option).
_TEMPLATE_OWN = frozenset({"messages", "add_generation_prompt", "bos_token", "eos_token"})


_CONTENT_TRANSFORMS: tuple[Callable[[str], str], ...] = (str, str.strip)


def _overlaps(start: int, end: int, spans: list[tuple[int, int, int]]) -> bool:
    return any(start < e and end > s for s, e, _ in spans)
