"""GGUF files with a SentencePiece vocabulary (tokenizer model 'llama': Llama 2, Mistral,
TinyLlama, Vicuna, Zephyr) tokenize, detokenize and generate as llama.cpp does.

The vocabularies are real SentencePiece BPE models trained here on the repo's sample data
(llmdb.samples: Amazon reviews, HumanEval prompts) the way Llama's was (byte fallback, digits
split, no whitespace folding), with user-defined and control symbols, and written into GGUF
files as llama.cpp's converter writes them: a piece, score and type per token. References:
sentencepiece's own encoder; llama.cpp on the same file (llama-cpp-python, when installed);
transformers for the model.
"""

from __future__ import annotations

import ctypes
import random
from pathlib import Path

import gguf
import pytest
import torch

from llmdb.engine.detokenize import TextStream
from llmdb.engine.engine import LLMEngine, without_partial_char
from llmdb.engine.models.gguf_file import read_gguf_metadata
from llmdb.engine.params import SamplingParams
from llmdb.samples import SAMPLES

from .helpers import assert_same_tokens
from .model_builders import LOGIT_RTOL, ref_logits, write_gguf_file
from .test_gguf_loader import CONTEXT, SMALL, _gguf_tensors, _hf_llama, _max_err, _rms_err

spm = pytest.importorskip("sentencepiece", reason="sentencepiece is not installed (pip install "
                          "'.[test]'): it trains the vocabularies and is their reference")

USER_DEFINED = ["<think>", "</think>"]
CONTROL = ["<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Llama 2's trainer settings that change what an encoder must do: byte fallback, digits one by
# one, runs of spaces kept (as pieces of their own), no Unicode normalization.
TRAINER = dict(model_type="bpe", byte_fallback=True, split_digits=True,
               allow_whitespace_only_pieces=True, remove_extra_whitespaces=False,
               normalization_rule_name="identity", character_coverage=0.9995,
               user_defined_symbols=USER_DEFINED, control_symbols=CONTROL, minloglevel=2)
# name -> trainer settings. add_dummy_prefix=False is what a file's add_space_prefix=false
# says (llama.cpp's converter writes the one from the other).
VOCABS = {
    "small": dict(vocab_size=600),
    "large": dict(vocab_size=3000),
    "no-prefix": dict(vocab_size=1000, add_dummy_prefix=False),
}

TEXTS = [
    "", " ", "  ", "hello world", " leading space", "trailing space ", "two  spaces   three",
    "line\nbreak\n\n", "\ttab\tseparated\t", "\r\nwindows line", "digits 1234567890 3.14 -42",
    "punctuation!?.,;:'\"()[]{}<>@#$%^&*-_=+/\\|`~", "naïve café résumé Ünïcödé",
    "東京 日本語のテキスト", "emoji 🙂🎉👍🏽 mixed", "Ω≈ç√∫˜µ≤≥÷ ß",
    "\u00a0nbsp and zero\u200bwidth",
    "SELECT count(*) FROM orders WHERE id > 1234;", "def f(x):\n    return x ** 2\n",
]
LITERAL_SPACE_MARK = "a ▁ literal ▁▁ U+2581"  # encoded as spaces are: no round trip
# Special-token strings in text: control ones (and <unk>) are tokens when special tokens are
# parsed, text otherwise; user-defined ones are tokens either way.
SPECIAL_TEXTS = [
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
    "<think>step one</think> answer", "<s>bos in text</s>", "x<unk>y", " <|im_end|> ",
    "<think><think>", "<|im_start|>", "a<|im_end|>",
]


def _sample_texts() -> list[str]:
    """Review and tweet text the vocabularies were not trained on."""
    reviews = SAMPLES["reviews"]().column("review").to_pylist()[3000:3300]
    tweets = SAMPLES["tweets"]().column("text").to_pylist()[:300]
    return [str(t) for t in reviews + tweets]


@pytest.fixture(scope="module")
def sample_texts() -> list[str]:
    return _sample_texts()


def _train(settings: dict) -> spm.SentencePieceProcessor:
    reviews = SAMPLES["reviews"]().column("review").to_pylist()[:3000]
    prompts = SAMPLES["humaneval"]().column("prompt").to_pylist()
    model = bytearray()

    class Sink:  # sentencepiece writes the trained model to a file-like object
        def write(self, data: bytes) -> None:
            model.extend(data)

    spm.SentencePieceTrainer.train(sentence_iterator=iter(map(str, reviews + prompts)),
                                   model_writer=Sink(), **TRAINER, **settings)
    return spm.SentencePieceProcessor(model_proto=bytes(model))


def _vocab(sp: spm.SentencePieceProcessor) -> tuple[list[str], list[float], list[int]]:
    """tokenizer.ggml.tokens, .scores and .token_type (GGUF's numbering is SentencePiece's)."""
    def kind(i: int) -> gguf.TokenType:
        if sp.IsUnknown(i):
            return gguf.TokenType.UNKNOWN
        if sp.IsControl(i):
            return gguf.TokenType.CONTROL
        if sp.IsByte(i):
            return gguf.TokenType.BYTE
        if sp.IdToPiece(i) in USER_DEFINED:  # (the Python API cannot ask)
            return gguf.TokenType.USER_DEFINED
        return gguf.TokenType.NORMAL

    n = sp.GetPieceSize()
    return ([sp.IdToPiece(i) for i in range(n)], [sp.GetScore(i) for i in range(n)],
            [int(kind(i)) for i in range(n)])


def _write_spm_gguf(path: Path, sp: spm.SentencePieceProcessor, *,
                    space_prefix: bool | None = True,
                    model=None, special_ids: bool = True, add_eos: bool = False,
                    order: list[int] | None = None) -> Path:
    """A Llama GGUF with `sp`'s vocabulary; tensors of `model` (else tiny placeholder
    hyperparameters and none). special_ids=False and space_prefix=None leave out keys
    llama.cpp has defaults for (BOS/EOS/UNK ids, add_bos; add_space_prefix). order: the
    piece each id holds (a permutation of sp's ids)."""
    cfg = model.config if model is not None else None
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(CONTEXT)
    w.add_embedding_length(cfg.hidden_size if cfg else 64)
    w.add_block_count(cfg.num_hidden_layers if cfg else 1)
    w.add_feed_forward_length(cfg.intermediate_size if cfg else 128)
    w.add_head_count(cfg.num_attention_heads if cfg else 4)
    w.add_head_count_kv(cfg.num_key_value_heads if cfg else 2)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps if cfg else 1e-5)
    if cfg:
        w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
        w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    tokens, scores, types = _vocab(sp)
    if order is not None:
        tokens, scores, types = ([xs[i] for i in order] for xs in (tokens, scores, types))
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    if special_ids:
        w.add_bos_token_id(sp.bos_id())
        w.add_eos_token_id(sp.eos_id())
        w.add_unk_token_id(sp.unk_id())
        w.add_add_bos_token(True)
    w.add_add_eos_token(add_eos)
    if space_prefix is not None:
        w.add_add_space_prefix(space_prefix)
    w.add_chat_template(CHATML)
    if model is not None:
        for name, arr in _gguf_tensors(model).items():
            w.add_tensor(name, arr)
    write_gguf_file(w)
    return path


@pytest.fixture(scope="module")
def vocabs(tmp_path_factory) -> dict[str, tuple[spm.SentencePieceProcessor, Path]]:
    """name -> (the trained model, a tensor-less GGUF file of its vocabulary)."""
    out = tmp_path_factory.mktemp("spm")
    models = {name: _train(settings) for name, settings in VOCABS.items()}
    return {name: (sp, _write_spm_gguf(out / f"{name}.gguf", sp,
                                      space_prefix=VOCABS[name].get("add_dummy_prefix", True)))
            for name, sp in models.items()}


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMDB_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("LLMDB_CONFIG_DIR", str(tmp_path / "config"))


@pytest.fixture(scope="module")
def llama_cpp():
    return pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed: it is "
                               "the reference for tokenization and logits")


def _llama_cpp_vocab(llama_cpp, path: Path):
    # verbose=True: verbose=False crashes llama-cpp-python on this machine.
    return llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=True)


def _llama_cpp_detokenize(llama_cpp, llm, ids: list[int], unparse_special: bool) -> str:
    """llama.cpp's own detokenize (llama-cpp-python's Llama.detokenize is its own code)."""
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    arr = (llama_cpp.llama_token * max(1, len(ids)))(*ids)
    size = 64
    while True:
        buf = ctypes.create_string_buffer(size)
        n = llama_cpp.llama_detokenize(vocab, arr, len(ids), buf, size, False, unparse_special)
        if n >= 0:
            return buf.raw[:n].decode("utf-8", errors="replace")
        size = -n


# ---- tokenization --------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(VOCABS))
def test_encode_matches_sentencepiece(name, vocabs, sample_texts):
    """SentencePiece's own encoder: the same ids on plain text, and on text holding control
    tokens' strings when those are text (encode_plain; SentencePiece never parses them)."""
    sp, path = vocabs[name]
    _, tok = read_gguf_metadata(path)
    assert tok.vocab_size == sp.GetPieceSize()
    for text in [*TEXTS, LITERAL_SPACE_MARK, *sample_texts]:
        assert tok.encode(text) == sp.encode(text), f"{name}: {text!r}"
    for text in SPECIAL_TEXTS:
        if not any(u in text for u in USER_DEFINED):  # (see the llama.cpp test)
            assert tok.encode_plain(text) == sp.encode(text), f"{name}: {text!r}"
    # The texts reach byte fallback, and the space-only pieces.
    ids = [i for text in TEXTS for i in tok.encode(text)]
    assert any(sp.IsByte(i) for i in ids)
    assert any(set(sp.IdToPiece(i)) == {"▁"} and len(sp.IdToPiece(i)) > 1 for i in ids)


@pytest.mark.parametrize("name", list(VOCABS))
def test_encode_matches_llama_cpp(name, vocabs, sample_texts, llama_cpp):
    """llama.cpp on the same file, special tokens parsed or not, with BOS, and chat turns.
    Where llama.cpp differs from SentencePiece (a space prefix after every special token:
    "<think>x" is <think> ▁x), the file's reader follows llama.cpp."""
    sp, path = vocabs[name]
    _, tok = read_gguf_metadata(path)
    llm = _llama_cpp_vocab(llama_cpp, path)
    for text in [*TEXTS, LITERAL_SPACE_MARK, *SPECIAL_TEXTS, *sample_texts]:
        raw = text.encode()
        assert tok.encode(text) == llm.tokenize(raw, add_bos=False, special=True), (name, text)
        assert tok.encode_plain(text) == llm.tokenize(raw, add_bos=False, special=False), text
        assert tok.encode(text, add_special=True) == llm.tokenize(raw, add_bos=True,
                                                                  special=True), text
    messages = [{"role": "user", "content": "What is 17 times 23?"}]
    rendered = tok.apply_chat_template(messages)
    assert tok.encode_chat(messages) == llm.tokenize(rendered.encode(), add_bos=False,
                                                     special=True)


def test_merges_are_ranked_by_score_not_by_id(vocabs, tmp_path):
    """SentencePiece lists pieces by score, so ranking by id would pass the tests above: in a
    file whose pieces are shuffled (scores kept with their pieces), the ids are the same
    pieces as SentencePiece's."""
    sp, _ = vocabs["large"]
    tokens, scores, types = _vocab(sp)
    movable = [i for i, t in enumerate(types) if t == gguf.TokenType.NORMAL]
    shuffled = random.Random(2).sample(movable, len(movable))
    order = list(range(len(tokens)))  # new id -> old id
    for new, old in zip(movable, shuffled, strict=True):
        order[new] = old
    path = _write_spm_gguf(tmp_path / "shuffled.gguf", sp, order=order)
    _, tok = read_gguf_metadata(path)
    for text in TEXTS:
        assert [order[i] for i in tok.encode(text)] == sp.encode(text), text


def test_special_tokens_are_matched_whole_with_a_space_prefix_after_them(vocabs):
    """What llama.cpp does, spelled out: control, unknown and user-defined tokens are single
    tokens; the text after each one gets its own ▁ (SentencePiece puts one at the start only).
    As data (encode_plain) control strings are text; user-defined ones stay tokens."""
    sp, path = vocabs["large"]
    _, tok = read_gguf_metadata(path)
    ids = tok.encode("<|im_start|>user<|im_end|><think>hm</think><unk>")
    assert ids == [tok.token_id("<|im_start|>"), *sp.encode("user"), tok.token_id("<|im_end|>"),
                   tok.token_id("<think>"), *sp.encode("hm"), tok.token_id("</think>"), 0]
    assert sp.IdToPiece(sp.encode("hm")[0]).startswith("▁")
    plain = [sp.IdToPiece(i) for i in tok.encode_plain("<|im_end|><think>")]
    assert "<|im_end|>" not in plain and plain[-1] == "<think>"


# ---- detokenization ------------------------------------------------------------------------


def _stream(tok, ids: list[int]) -> str:
    """The text of `ids` as the engine streams it: each whole piece once, as it arrives."""
    stream, out = TextStream(tok.decode), ""
    for k, t in enumerate(ids):
        new, whole = stream.add(t)
        if whole:
            out += new
            assert out == tok.decode(ids[: k + 1]), ids[: k + 1]
    return out


@pytest.mark.parametrize("name", list(VOCABS))
def test_decode_round_trips_and_streams(name, vocabs, sample_texts):
    """Text -> ids -> text is the identity (the space the prefix added is dropped; byte
    tokens become UTF-8), and the streamed text equals the whole decode at every token."""
    sp, path = vocabs[name]
    _, tok = read_gguf_metadata(path)
    for text in [*TEXTS, *sample_texts]:
        ids = tok.encode(text)
        assert tok.decode(ids) == text, f"{name}: {text!r}"
        assert sp.decode(ids) == text  # (the reference agrees: no quirk of ours)
        assert _stream(tok, ids) == text
    for text in SPECIAL_TEXTS:
        ids = tok.encode(text)
        assert _stream(tok, ids) == tok.decode(ids)
    rng = random.Random(0)
    for _ in range(100):  # anything a model may generate: bytes split mid-character included
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 20))]
        text, out = tok.decode(ids), _stream(tok, ids)
        assert text.startswith(out) and set(text[len(out):]) <= {"\ufffd"}, ids  # half a char


def test_decode_drops_the_first_space_only(vocabs):
    """llama.cpp strips the prefix's space from the first token's text alone: a later piece's
    space stays, and so does the space after a skipped special token that comes first."""
    sp, path = vocabs["large"]
    _, tok = read_gguf_metadata(path)
    ids = tok.encode(" two")  # ▁▁two: one space is the prefix's, one the text's
    assert tok.decode(ids) == " two"
    start, end = tok.token_id("<|im_start|>"), tok.token_id("<|im_end|>")
    hi = tok.encode("hi")  # ▁hi
    assert tok.decode([start, *hi, end]) == " hi"
    assert tok.decode([start, *hi, end], skip_special=False) == "<|im_start|> hi<|im_end|>"
    assert tok.decode([*hi, end, *hi]) == "hi hi"


def test_a_tokens_text_keeps_the_space_it_reads_with(vocabs):
    """token_text (a logprobs entry's token): a piece's space stays, though decoding it
    alone drops it as the start of a text; the first token as the text starts and the rest
    by token_text join into the text."""
    _, path = vocabs["large"]
    _, tok = read_gguf_metadata(path)
    first = tok.encode("hi")[0]  # ▁h
    piece = tok.tokenizer.id_to_token(first)
    assert piece.startswith("\u2581") and len(piece) > 1
    assert tok.decode([first]) == piece[1:] and tok.token_text(first) == " " + piece[1:]
    ids = tok.encode("two hi, 3 hi")
    assert tok.decode(ids[:1]) + "".join(map(tok.token_text, ids[1:])) == "two hi, 3 hi"
    end = tok.token_id("<|im_end|>")
    assert tok.token_text(end) == "<|im_end|>"


@pytest.mark.parametrize("name", list(VOCABS))
def test_decode_matches_llama_cpp(name, vocabs, sample_texts, llama_cpp):
    """llama.cpp's detokenize, special tokens printed or not, on encoded text and on random
    ids (control, byte, user-defined tokens anywhere, the first place included)."""
    _, path = vocabs[name]
    _, tok = read_gguf_metadata(path)
    llm = _llama_cpp_vocab(llama_cpp, path)
    rng = random.Random(1)
    sequences = [tok.encode(t) for t in [*TEXTS, *SPECIAL_TEXTS, *sample_texts[:100]]]
    sequences += [[rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 12))]
                  for _ in range(300)]
    for ids in sequences:
        for skip in (True, False):
            theirs = _llama_cpp_detokenize(llama_cpp, llm, ids, unparse_special=not skip)
            assert tok.decode(ids, skip_special=skip) == theirs, (name, ids, skip)


# ---- metadata ------------------------------------------------------------------------------


def test_special_token_defaults_and_flags(vocabs, tmp_path):
    """Without the keys, llama.cpp's defaults for SentencePiece files: <unk> 0, <s> 1, </s> 2,
    BOS added. add_eos appends EOS to a prompt's ids; add_space_prefix defaults to true."""
    sp, _ = vocabs["small"]
    path = _write_spm_gguf(tmp_path / "defaults.gguf", sp, special_ids=False, add_eos=True)
    config, tok = read_gguf_metadata(path)
    assert (tok.bos_token, tok.eos_token, tok.add_bos, tok.add_eos) == ("<s>", "</s>", True, True)
    assert config.bos_token_id == 1 and config.eos_token_ids[0] == 2
    assert tok.encode("hi", add_special=True) == [1, *sp.encode("hi"), 2]
    assert tok.token_id("<unk>") == 0 and tok.encode("<unk>") == [0]


def test_add_space_prefix_defaults_to_true(vocabs, tmp_path):
    sp, _ = vocabs["small"]
    path = _write_spm_gguf(tmp_path / "no-key.gguf", sp, space_prefix=None)
    assert "tokenizer.ggml.add_space_prefix" not in gguf.GGUFReader(str(path)).fields
    _, tok = read_gguf_metadata(path)
    assert tok.spm_space_prefix
    assert tok.encode("hello there") == sp.encode("hello there")
    assert tok.decode(tok.encode("hello there")) == "hello there"


# ---- the model -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def spm_model(vocabs, tmp_path_factory):
    """A random tiny Llama over the "large" vocabulary, as an F32 GGUF, and the HF model."""
    sp, _ = vocabs["large"]
    model = _hf_llama(sp.GetPieceSize(), **SMALL, tie=False, theta=10000.0, eps=1e-5, seed=7)
    path = _write_spm_gguf(tmp_path_factory.mktemp("spm-model") / "model.gguf", sp, model=model)
    return sp, model, path


@torch.inference_mode()
def test_a_sentencepiece_gguf_generates(spm_model):
    """Prompt text becomes SentencePiece's ids after BOS; the logits are transformers' on
    them; greedy generation is transformers' and its text is the decode of its tokens."""
    sp, model, path = spm_model
    engine = LLMEngine(model=str(path), dtype="fp32", kv_cache_bytes=16 << 20, threads=1)
    prompt = "The quick brown fox, naïve 東京 🙂"
    ids = engine.encode_prompt(prompt)
    assert ids == [sp.bos_id(), *sp.encode(prompt)]
    err = _max_err(engine.logits(ids), ref_logits(model, ids))
    assert err <= LOGIT_RTOL, f"relative error {err:.3g}"
    want = list(ids)
    for _ in range(12):  # greedy decoding, step by step in transformers
        want.append(int(ref_logits(model, want)[-1].argmax()))
    want = want[len(ids):]
    [result] = engine.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True))
    assert_same_tokens(engine, ids, want, result.token_ids)
    assert result.text == without_partial_char(engine.tokenizer.decode(result.token_ids))
    chat = engine.encode_prompt([{"role": "user", "content": "hi <|im_end|>"}])
    assert chat.count(engine.tokenizer.token_id("<|im_end|>")) == 1  # the content's is text


def test_the_servers_logprobs_tokens_join_into_the_answer(spm_model):
    """The OpenAI server's logprobs entries on a SentencePiece model: the tokens' texts join
    into the answer's text (streamed in chunks or whole), and each alternative is written as
    it would read there, its space kept."""
    from llmdb.server.app import _ChatRender, _CompletionRender

    _, _, path = spm_model
    engine = LLMEngine(model=str(path), dtype="fp32", kv_cache_bytes=16 << 20, threads=1)
    tok = engine.tokenizer
    ids = tok.encode("two hi, 3 hi")
    entries = [(t, (-1.0, {t: -1.0})) for t in ids]
    whole = _CompletionRender("m", engine, 1)._logprobs_of(entries, 0)
    assert "".join(whole["tokens"]) == tok.decode(ids) == "two hi, 3 hi"
    assert [list(top) for top in whole["top_logprobs"][1:]] == [[w] for w in whole["tokens"][1:]]
    streamed = _ChatRender("m", engine, 1)
    # The second chunk starts with a piece that has a space: the answer's own first does not.
    cut = next(k for k, t in enumerate(ids) if k and tok.tokenizer.id_to_token(t)[0] == "\u2581")
    chunks = [streamed._logprobs_of(entries[:cut]), streamed._logprobs_of(entries[cut:])]
    texts = [e["token"] for chunk in chunks for e in chunk["content"]]
    assert texts == whole["tokens"]


def test_llama_cpp_agrees_on_a_sentencepiece_model(spm_model, llama_cpp):
    """llama.cpp reads the same model from the file: its logits on our prompt ids."""
    from .test_gguf_loader import _llama_cpp_logits

    sp, _, path = spm_model
    engine = LLMEngine(model=str(path), dtype="fp32", kv_cache_bytes=16 << 20, threads=1)
    ids = engine.encode_prompt("SELECT count(*) FROM orders; -- naïve 🙂")
    assert _rms_err(engine.logits(ids), _llama_cpp_logits(llama_cpp, path, ids)) <= 1e-5


def test_exported_hf_tokenizer_is_the_same(spm_model, tmp_path):
    """The benchmark's peers read our export: transformers encodes the file's text as we
    do and decodes it back (its decoder drops the prefix's space too)."""
    import transformers

    from llmdb.engine.models import load_model
    from llmdb.engine.models.export import export_hf

    sp, _, path = spm_model
    loaded = load_model(path)
    hf_tok = transformers.AutoTokenizer.from_pretrained(
        export_hf(loaded, tmp_path / "hf", dtype=torch.float32))
    for text in [*TEXTS, *SPECIAL_TEXTS]:
        ids = hf_tok(text, add_special_tokens=False)["input_ids"]
        assert ids == loaded.tokenizer.encode(text), text
        if text in TEXTS:
            assert hf_tok.decode(ids) == text


def test_the_weight_cache_keeps_the_tokenizer(spm_model):
    """A second load reads the tokenizer from the cache entry: decoded the same way."""
    from llmdb.engine.models import load_model

    _, _, path = spm_model
    first, second = load_model(path).tokenizer, load_model(path).tokenizer
    assert (second.spm_space_prefix, second.add_bos, second.add_eos) == (True, True, False)
    ids = first.encode(" two 🙂")
    assert second.encode(" two 🙂") == ids and second.decode(ids) == first.decode(ids) == " two 🙂"
