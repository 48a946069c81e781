"""SentencePiece BPE vocabularies (GGUF tokenizer model "llama": Llama 2, Mistral, TinyLlama,
Vicuna, Zephyr) as a `tokenizers.Tokenizer` that tokenizes as llama.cpp's llm_tokenizer_spm.

llama.cpp (SentencePiece's own BPE encoder, ported) writes spaces as U+2581 ("▁") and puts
one before each run of text between special tokens (add_space_prefix); every UTF-8 character
starts as a symbol; it then repeatedly merges, of all adjacent pairs whose concatenation is a
piece of the vocabulary, the pair whose piece scores highest (the leftmost of equal scores);
a symbol left that is no piece is written as its <0xXX> byte tokens.

A BPE model does the same when its merges are every split of a piece into two pieces, ranked
by the piece's score (highest first), with byte fallback:
- BPE merges a pair when the pair is a merge; SPM when its concatenation is a piece. A symbol
  is a piece or a single character, so the two agree wherever the characters are pieces. A
  character that is no piece is written as bytes by BPE at once, where SPM could still merge
  it into a piece; SentencePiece builds every piece from characters it keeps as pieces, so
  trained vocabularies never hold such a piece.
- BPE takes the lowest rank, then the leftmost pair: SPM's order, except between candidates
  of equal score that are different merges: two pieces of one score, or two splits of one
  piece that overlap in the text ("aba" as "ab"+"a" and "a"+"ba" in "ababa"), which BPE
  orders by rank (here the piece's id, then its left part) rather than position. SentencePiece's
  trainer gives every merged piece a score of its own (minus its merge order), and pieces
  are merged from the bottom up, so on trained vocabularies this has not been seen to
  matter: Llama 2's and Phi-3's vocabularies tokenize as in llama.cpp on sample texts and on
  strings built to overlap such splits.
Pieces typed control, unknown or byte are never merge results here: llama.cpp could merge
data text into a control token (<s> from "<s" and ">"), which would let text forge one.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from tokenizers import Tokenizer, decoders, models, normalizers

SPACE = "\u2581"
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6  # GGUF token types


def merges_by_score(tokens: Sequence[str], scores: Sequence[float], types: Sequence[int]
                    ) -> list[tuple[str, str]]:
    """Every split of a piece into two pieces, the splits of higher-scored pieces first."""
    ids = {t: i for i, t in enumerate(tokens)}  # the last of duplicates, as llama.cpp
    ranked = []
    for piece, i in ids.items():
        if types[i] in (UNKNOWN, CONTROL, BYTE):
            continue
        for k in range(1, len(piece)):  # code points: SPM's symbols are UTF-8 characters
            left, right = piece[:k], piece[k:]
            if left in ids and right in ids:
                ranked.append((-scores[i], i, left, right))
    ranked.sort()
    return [(left, right) for _, _, left, right in ranked]


def spm_tokenizer(tokens: Sequence[str], scores: Sequence[float], types: Sequence[int],
                  unk_token: str | None, add_space_prefix: bool) -> Tokenizer:
    """The tokenizer without its special tokens (added by the caller, as for BPE files)."""
    tok = Tokenizer(models.BPE(
        vocab={t: i for i, t in enumerate(tokens)},
        merges=merges_by_score(tokens, scores, types),
        unk_token=unk_token,
        byte_fallback=True,
        # SentencePiece writes a run of characters it has no piece for as one unknown token
        # (reached only in vocabularies without byte tokens; llama.cpp refuses those).
        fuse_unk=True,
    ))
    # No pre-tokenizer: SPM merges across spaces (Llama 2 has "▁▁▁▁" pieces). The normalizer
    # runs on each run of text between added tokens, so a prefix follows every special token,
    # as in llama.cpp.
    escape = normalizers.Replace(" ", SPACE)
    tok.normalizer = (normalizers.Sequence([normalizers.Prepend(SPACE), escape])
                      if add_space_prefix else escape)
    # What a Hugging Face copy decodes with (export.py); ModelTokenizer.decode uses
    # PieceDecoder, which is exactly llama.cpp's.
    tok.decoder = decoders.Sequence(
        [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    return tok


_BYTE = re.compile(r"<0x[0-9A-Fa-f]{2}>")


class PieceDecoder:
    """llama.cpp's detokenize for SentencePiece vocabularies: the bytes of each token's piece
    (▁ as a space, <0xXX> as its byte, added tokens as written, special ones left out when
    skipped) joined, then read as UTF-8; with a space prefix, the first token's leading space
    dropped, unless the first token is a skipped special one.

    Not tokenizers' ByteFallback decoder: it writes every byte of a run of byte tokens that
    is not valid UTF-8 as U+FFFD (Llama 2's newline is <0x0A>: half a character before it
    would take the newline along), and then decoding more tokens can change text already
    decoded, which streaming (detokenize.TextStream) relies on not happening."""

    def __init__(self, tokenizer: Tokenizer, space_prefix: bool):
        added = tokenizer.get_added_tokens_decoder()
        self._pieces: list[bytes] = []
        for i in range(tokenizer.get_vocab_size(with_added_tokens=True)):
            token = tokenizer.id_to_token(i) or ""
            if i in added:  # control, unknown and user-defined tokens: their text as is
                self._pieces.append(token.encode())
            elif _BYTE.fullmatch(token):
                self._pieces.append(bytes([int(token[3:5], 16)]))
            else:
                self._pieces.append(token.replace(SPACE, " ").encode())
        self._skipped = frozenset(i for i, t in added.items() if t.special)
        self._space_prefix = space_prefix

    def decode(self, ids: Sequence[int], skip_special: bool) -> str:
        n = len(self._pieces)
        kept = [i for i in ids if 0 <= i < n and not (skip_special and i in self._skipped)]
        pieces = [self._pieces[i] for i in kept]
        # llama.cpp strips the first token's piece, whatever it is: a skipped special token
        # (no piece) takes the strip with it.
        if self._space_prefix and pieces and kept[0] == ids[0]:
            pieces[0] = pieces[0].removeprefix(b" ")
        return b"".join(pieces).decode("utf-8", errors="replace")
