"""Query text sent to a remote server, made unable to spell the model's special tokens.

A remote server (vLLM's, llama.cpp's) renders the chat template around the messages it is
sent and tokenizes the whole string with special tokens parsed: a row holding
`<|im_end|>\\n<|im_start|>system ...` would end the user's turn there and open a system turn
of its own. Where llmdb tokenizes (the local engine, in-process vLLM) the template's markers
are the only special tokens; a remote tokenizer cannot be told which characters came from the
template, so each special-token string in the text sent is broken instead, by a WORD JOINER
(U+2060, invisible, no break) after its first character. The model still reads the same
visible characters; no tokenizer matches the marker whole.

Why U+2060 rather than ZERO WIDTH SPACE (U+200B): both cost the same tokens on the tokenizers
measured (SmolLM2's BPE: 2 a marker; Mistral's Tekken, a tiktoken-style BPE like Llama 3's
and Qwen's, and its SentencePiece vocabularies: 1 or 2, the marker's own tokens unchanged when
inserted after the first character), but SentencePiece's nmt_nfkc normalization rewrites
U+200B as a space and keeps U+2060.

The syntaxes broken, from the models' tokenizer files (tokenizer_config.json's
added_tokens_decoder, mistral_common's SpecialTokens):
- `<|...|>`: ChatML (Qwen, SmolLM, Phi-4), Llama 3/4, Phi-3, gpt-oss's harmony (<|start|>,
  <|channel|>, <|message|>, <|return|>, ...), Granite, Command R, `<|endoftext|>`; and
  DeepSeek's fullwidth `<｜...｜>`. Every token of both families starts so: `<|` is broken
  wherever it stands.
- Named tags: `<s>` `</s>` `<unk>` `<pad>` (SentencePiece: Llama 2, Mistral), Gemma's `<bos>`
  `<eos>` `<mask>` `<start_of_turn>` `<end_of_turn>`, its image/audio/function tags and
  `<unusedN>`, `<think>` `<tool_call>` `<tool_response>` and their closing tags (Qwen 2.5/3,
  DeepSeek-R1: matched whole although not marked special), StarCoder's (`<file_sep>`,
  `<jupyter_code>`, `<fim_prefix>`, ...: SmolLM2 has them too), Code Llama's `<PRE>` `<SUF>`
  `<MID>` `<EOT>`, Tekken's `<SPECIAL_N>`, Cohere's `<BOS_TOKEN>` `<EOS_TOKEN>`, GLM's `<sop>`
  `<eop>`.
- Bracketed control tokens: Mistral's (mistral_common 1.12's SpecialTokens: [INST],
  [SYSTEM_PROMPT], [TOOL_CALLS], [THINK], ...), Gemma's [@BOS@], GLM's [gMASK] and [sMASK],
  and Llama 2's plain-text `<<SYS>>` `<</SYS>>`.
Ordinary tags (`<text>`, `<b>`) are left alone: they are no model's special tokens, and
llm_classify's own prompt uses them.
"""

from __future__ import annotations

import re

WORD_JOINER = "\u2060"

_TAG_NAMES = (
    "s", "unk", "pad", "bos", "eos", "mask", "sop", "eop", "escape",
    "think", "tool_call", "tool_response",
    "repo_?name", "file_sep", "filename", "gh_stars", r"issue_\w+", r"jupyter_\w+",
    "empty_output", r"fim_\w+", r"commit_\w+", "PRE", "SUF", "MID", "EOT",
    r"(?:start|end)_of_\w+", r"(?:start|end)_function_\w+", r"\w+_soft_token", r"unused\d+",
    r"SPECIAL_\d+", "BOS_TOKEN", "EOS_TOKEN",
)
_BRACKET_NAMES = (
    "INST", "AVAILABLE_TOOLS", "TOOL_RESULTS", "TOOL_CALLS", "TOOL_CONTENT", "IMG",
    "IMG_BREAK", "IMG_END", "PREFIX", "MIDDLE", "SUFFIX", "SYSTEM_PROMPT", "ARGS", "CALL_ID",
    "AUDIO", "BEGIN_AUDIO", "TRANSCRIBE", "THINK", "STREAMING_PAD", "STREAMING_WORD",
    "NEXT_AUDIO_TEXT", "REPEAT_AUDIO_TEXT", "MODEL_SETTINGS", "@BOS@", "gMASK", "sMASK",
)
_SPECIAL = re.compile(
    r"<[|｜]"
    r"|</?(?:" + "|".join(_TAG_NAMES) + r")>"
    r"|\[/?(?:" + "|".join(_BRACKET_NAMES) + r")\]"
    r"|<</?SYS>>")


def neutralize(text: str) -> str:
    """`text` with a WORD JOINER after the first character of each special-token string in
    it; text without one comes back unchanged, and neutralized text too."""
    return _SPECIAL.sub(lambda m: m[0][0] + WORD_JOINER + m[0][1:], text)
