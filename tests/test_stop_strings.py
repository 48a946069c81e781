"""Stop strings found incrementally (engine/stop_strings.py) stop where decoding the whole
output after every token would: across token boundaries, inside multi-byte characters,
among special tokens."""

from __future__ import annotations

import random

import pytest

from llmdb.engine.params import SamplingParams
from llmdb.engine.stop_strings import StopStringWatch

TEXT = "Café naïve — “quoted” 日本語 and 🙂🙂, then: 1, 2, 3;\n\tdef f(x): return x ** 2  # ok"


def first_stop_by_full_decode(decode, ids: list[int], stops: list[str]) -> int | None:
    """The reference: the first token after which the whole output's text holds a stop."""
    return next((k for k in range(len(ids))
                 if any(s in decode(ids[: k + 1]) for s in stops)), None)


def first_stop_by_watch(decode, ids: list[int], stops: list[str]) -> int | None:
    watch = StopStringWatch(decode, stops)
    return next((k for k, t in enumerate(ids) if watch.add(t)), None)


@pytest.fixture(scope="module")
def tokenizer(engine_fp32):
    return engine_fp32.tokenizer


def test_matches_the_full_decode_on_text_with_multibyte_characters(tokenizer):
    ids = tokenizer.encode(TEXT)
    assert any(tokenizer.decode([t]).count("\ufffd") for t in ids)  # split characters
    rng = random.Random(0)
    for _ in range(300):  # stop strings cut anywhere in the text, over token boundaries
        start = rng.randrange(len(TEXT))
        stops = [TEXT[start : start + rng.randint(1, 12)], "never in the text"]
        want = first_stop_by_full_decode(tokenizer.decode, ids, stops)
        assert want is not None
        assert first_stop_by_watch(tokenizer.decode, ids, stops) == want, stops


def test_matches_the_full_decode_on_random_tokens(tokenizer):
    rng = random.Random(1)
    for _ in range(40):  # any ids, special tokens and stray UTF-8 bytes included
        ids = [rng.randrange(tokenizer.vocab_size) for _ in range(30)]
        text = tokenizer.decode(ids)
        start = rng.randrange(max(1, len(text) - 3))
        stops = [text[start : start + rng.randint(2, 6)] or "x"]
        want = first_stop_by_full_decode(tokenizer.decode, ids, stops)
        assert first_stop_by_watch(tokenizer.decode, ids, stops) == want, (ids, stops)


def test_no_stop_string_never_stops(tokenizer):
    assert first_stop_by_watch(tokenizer.decode, tokenizer.encode(TEXT), ["§§"]) is None


def test_empty_stop_strings_are_refused():
    with pytest.raises(ValueError, match="stop strings must be non-empty"):
        SamplingParams(stop=["ok", ""]).validate()


def test_matches_the_full_decode_with_a_sentencepiece_decoder():
    """Metaspace (Llama-2's tokenizer.json) drops the leading space of a text's first token:
    the new text of a token must not be decoded as a text's first."""
    from tokenizers import Tokenizer, decoders, models

    pieces = ["<unk>", "▁the", "▁cat", "s", "▁", "at", "é", "▁sat", ".", "▁on", "n"]
    tok = Tokenizer(models.BPE({p: i for i, p in enumerate(pieces)}, [], unk_token="<unk>"))
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")

    assert tok.decode([1, 2, 3]) == "the cats" and tok.decode([2, 3]) == "cats"
    rng = random.Random(2)
    for _ in range(200):
        ids = [rng.randrange(1, len(pieces)) for _ in range(12)]
        text = tok.decode(ids)
        start = rng.randrange(len(text))
        stops = [text[start : start + rng.randint(1, 5)]]
        want = first_stop_by_full_decode(tok.decode, ids, stops)
        assert first_stop_by_watch(tok.decode, ids, stops) == want, (ids, stops)


def test_matches_the_full_decode_across_skipped_special_tokens():
    """A special token (skipped in the text) between two words: the word after it is not a
    text's first, so its leading space stays (a stop string spanning it was missed)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models

    pieces = ["<unk>", "</s>", "▁the", "▁cat", "▁sat"]
    tok = Tokenizer(models.BPE({p: i for i, p in enumerate(pieces)}, [], unk_token="<unk>"))
    tok.add_special_tokens([AddedToken("</s>", special=True)])
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")

    def decode(ids):
        return tok.decode(ids, skip_special_tokens=True)

    assert decode([2, 3, 1, 4]) == "the cat sat"
    rng = random.Random(3)
    for ids in [[2, 3, 1, 4], [1, 3, 1, 1, 4], *([rng.randrange(1, 5) for _ in range(10)]
                                               for _ in range(200))]:
        text = decode(ids)
        for start in range(len(text)):
            stops = [text[start : start + 7]]
            want = first_stop_by_full_decode(decode, ids, stops)
            assert first_stop_by_watch(decode, ids, stops) == want, (ids, stops)


def test_streamed_text_is_a_prefix_of_the_answer_and_adds_up_to_it(tokenizer):
    """llmdb serve's stream (server/text.py), decoding each token once: what it has sent is
    always a prefix of the final answer (the whole output's decode, cut at the first stop
    string), and the end's flush adds the rest."""
    from types import SimpleNamespace

    from llmdb.server.text import IncrementalText

    rng = random.Random(2)
    text_ids = tokenizer.encode(TEXT)
    for trial in range(60):
        ids = (text_ids if trial % 2 else
               [rng.randrange(tokenizer.vocab_size) for _ in range(40)])
        full = tokenizer.decode(ids)
        start = rng.randrange(max(1, len(full) - 3))
        stops = [] if trial % 3 == 0 else [full[start : start + rng.randint(1, 6)] or "x"]
        k = first_stop_by_full_decode(tokenizer.decode, ids, stops)
        answer = tokenizer.decode(ids if k is None else ids[: k + 1])
        answer = answer[: min((answer.find(s) for s in stops if s in answer),
                              default=len(answer))]
        stream = IncrementalText(tokenizer, stops)
        sent = ""
        for token in ids if k is None else ids[: k + 1]:
            sent += stream.push(token)
            assert answer.startswith(sent), (ids, stops)
        sent += stream.flush(SimpleNamespace(text=answer))
        assert sent == answer
