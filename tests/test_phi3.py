"""Phi-3 (Phi-3-mini, Phi-3.5-mini, Phi-4-mini: Hugging Face Phi3ForCausalLM; GGUF
architecture phi3) against transformers and llama.cpp, on tiny random models built here.

Phi-3 is Llama's decoder with Q, K and V fused into one qkv_proj and gate and up into one
gate_up_proj (llama.cpp: attn_qkv and a double-height ffn_up), and, for 128k contexts,
LongRoPE: short and long divisors per rotary frequency and a factor on cos and sin. An engine
serves one set (models/rope.py says why): the short one within the pretrained context, its
default, where every row gets transformers' numbers; the long one when asked for more
(max_context), where a sequence past the pretrained context gets transformers' numbers and
every sequence llama.cpp's with an n_ctx that long.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer

from llmdb.engine.engine import LLMEngine
from llmdb.engine.models import ModelLoadError, load_model
from llmdb.engine.params import SamplingParams

from .model_builders import (
    WORDS,
    add_bpe_vocab,
    add_gguf_shape,
    assert_close,
    assert_greedy_matches,
    assert_logits_match,
    assert_triton_path_matches,
    cached_engines,
    copy_dir,
    edit_config,
    gguf_tensor_name,
    randomize,
    ref_logits,
    reference_models,
    word_level_tokenizer,
    write_gguf_file,
)
from .test_gguf_loader import _train_bpe
from .test_gguf_loader import _vocab as _bpe_vocab

CONTEXT = 256
ORIGINAL = 64  # the LongRoPE models' pretrained context
# LongRoPE's factors as Phi-3.5-mini's look: short ones near 1, long ones growing to the
# low frequencies.
SHORT = [1.0, 1.02, 1.05, 1.1, 1.15, 1.2, 1.25, 1.3]
LONG = [round(1.5**i, 3) for i in range(8)]
SPECIALS = ["<unk>", "<s>", "</s>", "<|endoftext|>", "<|assistant|>", "<|end|>", "<|user|>",
            "<|system|>"]
ENDOFTEXT, ASSISTANT, END = 3, 4, 5
VOCAB = {t: i for i, t in enumerate(SPECIALS + sorted(set(WORDS) - {""}))}
VOCAB_SIZE = len(VOCAB)
# Phi-3-mini-instruct's chat format; without a generation prompt the text ends in EOS.
PHI3_CHAT = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + '<|end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}"
)


def _rope(theta: float, longrope: bool, partial: float) -> dict:
    rope = {"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": partial}
    if not longrope:
        return rope
    pairs = int(16 * partial) // 2  # (heads 16 wide)
    return {**rope, "rope_type": "longrope", "short_factor": SHORT[:pairs],
            "long_factor": LONG[:pairs]}


def _phi3_config(vocab_size: int, *, kv_heads: int, tie: bool, theta: float = 10000.0,
                 longrope: bool = False, partial: float = 1.0, window: int | None = None,
                 context: int = CONTEXT, original: int = ORIGINAL) -> transformers.Phi3Config:
    return transformers.Phi3Config(
        vocab_size=vocab_size, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=kv_heads, intermediate_size=96, max_position_embeddings=context,
        original_max_position_embeddings=original if longrope else context,
        rms_norm_eps=1e-5, rope_parameters=_rope(theta, longrope, partial),
        tie_word_embeddings=tie, sliding_window=window, bos_token_id=1, eos_token_id=ENDOFTEXT,
        pad_token_id=0,
    )


def _phi3(vocab_size: int, seed: int, **kw) -> transformers.Phi3ForCausalLM:
    torch.manual_seed(seed)
    model = transformers.Phi3ForCausalLM(_phi3_config(vocab_size, **kw))
    randomize(model, seed)
    model.config._attn_implementation = "eager"
    return model.eval()


# name -> the model's shape. Phi-3-mini and Phi-3.5-mini are MHA (32 heads of 96 = hidden);
# Phi-3-mini-4k slides a window of 2,047 over its 4,096 positions (here 16 of 256);
# Phi-3-medium has GQA; Phi-4-mini has GQA, ties its embeddings and rotates 96 of each head's
# 128 dimensions (here 12 of 16).
VARIANTS = {
    "phi3": dict(kv_heads=4, tie=False),
    "phi3-window": dict(kv_heads=4, tie=False, window=16),
    "phi3-gqa-tied": dict(kv_heads=2, tie=True, theta=250000.0),
    "phi3-longrope": dict(kv_heads=4, tie=False, longrope=True),
    "phi4-mini-like": dict(kv_heads=2, tie=True, theta=250000.0, longrope=True, partial=0.75),
}


def _modes(name: str) -> list[tuple[int | None, list[int]]]:
    """(the engine's max_context, prompt lengths to compare): a LongRoPE model served by
    default (its pretrained context: short set) on sequences within it, and with the whole
    context (long set) on sequences past it, where transformers uses the long set too."""
    if VARIANTS[name].get("longrope"):
        return [(None, [1, 9, 40, ORIGINAL]), (CONTEXT, [ORIGINAL + 1, 130, 240])]
    return [(None, [1, 9, 53, 240])]


def _ids(n: int, seed: int, vocab_size: int = VOCAB_SIZE) -> list[int]:
    rng = random.Random(seed * 1000 + n)
    return [rng.randrange(vocab_size) for _ in range(n)]


def _tokenizer() -> Tokenizer:
    return word_level_tokenizer(VOCAB, SPECIALS, unk="<unk>")


def _save(model, path: Path) -> Path:
    model.save_pretrained(path, safe_serialization=True)
    # Phi-3's generation config stops at <|endoftext|>, <|assistant|> and <|end|>.
    (path / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 1, "eos_token_id": [ENDOFTEXT, ASSISTANT, END], "pad_token_id": 0}))
    _tokenizer().save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>",
        "eos_token": "<|endoftext|>", "unk_token": "<unk>", "pad_token": "<unk>",
        "add_bos_token": False, "chat_template": PHI3_CHAT, "model_max_length": CONTEXT}))
    return path


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("phi3")
    return {name: _save(_phi3(VOCAB_SIZE, seed, **kw), root / name)
            for seed, (name, kw) in enumerate(VARIANTS.items())}


@pytest.fixture(scope="module")
def hf_ref(hf_dirs):
    """name -> transformers' model reloaded from the directory (eager, fp32, no EOS)."""
    return reference_models(hf_dirs)


@pytest.fixture(scope="module")
def engines(hf_dirs):
    """(name, max_context, attention, **options) -> an engine on the directory."""
    get = cached_engines(hf_dirs, kv_cache_bytes=4 << 20)
    return lambda name, max_context=None, attention="cpu", **options: get(
        name, attention, max_context=max_context, **options)


# ---- Hugging Face directories against transformers -------------------------------------------


@pytest.mark.parametrize("attention", ["reference", "cpu"])
@pytest.mark.parametrize("name", list(VARIANTS))
def test_logits_match_transformers(name, attention, hf_ref, engines):
    for max_context, lengths in _modes(name):
        engine = engines(name, max_context, attention)
        assert_logits_match(engine, hf_ref(name), [_ids(n, seed=1) for n in lengths],
                            f"{name}/{attention} ctx {max_context}")
        assert engine.pool.num_free == engine.pool.num_blocks


def test_longrope_serves_one_set_by_context(hf_dirs, hf_ref, engines):
    """The config holds both sets and transformers' factor on cos and sin; the default
    engine serves the pretrained context; the sets differ enough that serving the wrong one
    fails the comparisons above by far."""
    ref_model = hf_ref("phi3-longrope")
    c = load_model(hf_dirs["phi3-longrope"]).config
    assert (c.rope_divisors, c.rope_long_divisors) == (tuple(SHORT), tuple(LONG))
    assert (c.max_context, c.rope_original_context) == (CONTEXT, ORIGINAL)
    assert c.rope_attention_factor == pytest.approx(ref_model.model.rotary_emb.attention_scaling)
    assert c.rope_attention_factor > 1.1
    assert engines("phi3-longrope").config.max_context == ORIGINAL
    ids = _ids(40, seed=2)
    long_logits = engines("phi3-longrope", CONTEXT).logits(ids)
    assert float((long_logits - ref_logits(ref_model, ids)).abs().max()) > 0.1


@pytest.mark.parametrize("name", list(VARIANTS))
def test_chunked_prefill_logits_match_transformers(name, hf_ref, engines):
    """Prompts split over 24-token steps attend to cached K/V at offset positions."""
    for max_context, lengths in _modes(name):
        engine = engines(name, max_context, max_num_batched_tokens=24)
        ids = _ids(lengths[-1], seed=3)
        assert_close(engine.logits(ids), ref_logits(hf_ref(name), ids), f"{name} chunked")


@pytest.mark.parametrize("attention", ["reference", "cpu"])
@pytest.mark.parametrize("name", list(VARIANTS))
def test_greedy_generation_matches_transformers(name, attention, hf_ref, engines):
    for max_context, _ in _modes(name):
        # Within the pretrained context even after 10 tokens, or past it from the start.
        prompts = [_ids(n, seed=4) for n in ((1, 6, 21) if max_context is None
                                             else (ORIGINAL + 1, 100))]
        assert_greedy_matches(engines(name, max_context, attention), hf_ref(name), prompts,
                              10, pad_token_id=0)


@pytest.mark.parametrize("name", ["phi3", "phi3-window", "phi3-longrope", "phi4-mini-like"])
def test_triton_path_matches_transformers(name, hf_dirs, hf_ref):
    """The GPU kernels (RoPE from the scaled cos/sin table, fused with the K/V write), under
    Triton's interpreter in CI: transformers' logits, whole and chunked, and the CPU path's
    greedy tokens. (The default context only: the long set changes the table, built for
    both paths alike, and the interpreter takes seconds a step.)"""
    assert_triton_path_matches(hf_dirs[name], hf_ref(name), [_ids(40, seed=5)],
                               [_ids(n, seed=6) for n in (1, 9)], max_tokens=4,
                               kv_cache_bytes=4 << 20, what=f"{name}/triton")


def _serve(engine: LLMEngine, prompts: list[list[int]], cache_types: list[str],
           max_tokens: int) -> list[tuple[list[int], list[float]]]:
    """Greedy tokens and their logprobs, each request kept in the given cache type."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    ids = [engine.add_request(p, params) for p in prompts]
    for i, kind in zip(ids, cache_types, strict=True):
        engine._requests[i].cache_type = kind
    while engine.has_unfinished:
        engine.step()
    assert engine.pool.num_free == engine.pool.num_blocks
    return [(r.token_ids, [lp for lp, _ in r.logprobs]) for r in map(engine.wait, ids)]


def _assert_same_answers(got, want) -> None:
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(got, want, strict=True):
        assert tokens == want_tokens
        assert logprobs == pytest.approx(want_logprobs, abs=1e-4)


@pytest.mark.parametrize("name, max_context", [
    ("phi3-longrope", None), ("phi3-longrope", CONTEXT), ("phi3-window", None)],
    ids=["short-set", "long-set", "window"])
def test_hidden_cache_gives_the_kv_answers(name, max_context, hf_dirs):
    """Phi-3 is MHA (Phi-3-mini: 32 heads of 96 = hidden), so the hidden cache (Apt-Serve) is
    on: K/V re-projected from hidden states (the fused weight's K/V rows, rotated by the
    scaled table; within the window) give the KV cache's tokens and logprobs, alone and
    beside KV requests."""
    eng = LLMEngine(str(hf_dirs[name]), dtype="fp32", kv_cache_bytes=1 << 21,
                    block_size=4, threads=2, max_context=max_context)
    assert eng.describe()["hidden_cache"]["enabled"]
    prompts = [_ids(n, seed=12) for n in ((3, 17, 30) if max_context is None else (70, 80, 90))]
    want = _serve(eng, prompts, ["kv"] * 3, 12)
    _assert_same_answers(_serve(eng, prompts, ["hidden"] * 3, 12), want)
    _assert_same_answers(_serve(eng, prompts, ["kv", "hidden", "hidden"], 12), want)


def test_triton_path_serves_hidden_mode(hf_dirs):
    """The same under the GPU kernels (the re-projected K rotated inside rope_and_write_kv)."""
    pytest.importorskip("triton", reason="triton is not installed")
    eng = LLMEngine(str(hf_dirs["phi3-longrope"]), dtype="fp32", kv_cache_bytes=1 << 21,
                    block_size=4, attention="triton", cuda_graphs=False,
                    device="cuda" if torch.cuda.is_available() else "cpu")
    prompts = [_ids(n, seed=13) for n in (3, 11)]
    _assert_same_answers(_serve(eng, prompts, ["kv", "hidden"], 4),
                         _serve(eng, prompts, ["kv", "kv"], 4))


def test_metadata_tokenizer_and_chat_template(hf_dirs):
    """Config numbers, EOS ids (generation_config's list) and the chat format as
    transformers reads them."""
    loaded = load_model(hf_dirs["phi3-gqa-tied"])
    cfg, ours = loaded.config, loaded.tokenizer
    hf_cfg = transformers.AutoConfig.from_pretrained(hf_dirs["phi3-gqa-tied"])
    assert (cfg.arch, cfg.vocab_size, cfg.hidden_size, cfg.num_layers, cfg.ffn_size) == (
        "llama", VOCAB_SIZE, hf_cfg.hidden_size, hf_cfg.num_hidden_layers,
        hf_cfg.intermediate_size)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (4, 2, 16)
    assert cfg.tie_embeddings and cfg.rope_theta == 250000.0
    assert (cfg.rope_divisors, cfg.rope_long_divisors, cfg.rope_attention_factor) == ((), (), 1.0)
    assert cfg.eos_token_ids == (ENDOFTEXT, ASSISTANT, END)
    assert cfg.layer_windows == ()
    assert load_model(hf_dirs["phi3-window"]).config.layer_windows == (16,) * 3
    hf_tok = transformers.PreTrainedTokenizerFast.from_pretrained(hf_dirs["phi3-gqa-tied"])
    messages = [{"role": "system", "content": "be good"},
                {"role": "user", "content": "select count from table"}]
    rendered = ours.apply_chat_template(messages)
    assert rendered == hf_tok.apply_chat_template(messages, tokenize=False,
                                                  add_generation_prompt=True)
    assert rendered == ("<|system|>\nbe good<|end|>\n<|user|>\nselect count from table<|end|>\n"
                        "<|assistant|>\n")
    ids = ours.encode(rendered)
    assert ids == hf_tok(rendered, add_special_tokens=False)["input_ids"]
    assert ids.count(END) == 2 and ids[-1] == ASSISTANT


def test_generation_stops_at_end_of_turn(hf_dirs, tmp_path):
    """<|end|> ends an answer where transformers' generate (with Phi-3's generation config)
    ends it. The model is made to say <|end|> a few tokens in: its output row is a scaled
    copy of the row of the token greedy decoding picks third."""
    prompt = _ids(12, seed=7)
    src = hf_dirs["phi3"]
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    free = model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False,
                          eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    d = copy_dir(src, tmp_path / "ends")
    weights = load_file(str(d / "model.safetensors"))
    weights["lm_head.weight"][END] = 1.3 * weights["lm_head.weight"][free[2]]
    save_file(weights, str(d / "model.safetensors"), metadata={"format": "pt"})
    model = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    ref = model.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False,
                         pad_token_id=0)[0, len(prompt):].tolist()
    assert ref[-1] == END and len(ref) > 1, ref
    engine = LLMEngine(model=str(d), dtype="fp32", kv_cache_bytes=4 << 20, threads=2)
    res = engine.generate([prompt], SamplingParams(max_tokens=20))[0]
    assert (res.token_ids, res.finish_reason) == (ref, "stop")


# ---- refusals and the served context ---------------------------------------------------------


def test_legacy_su_config_is_read(hf_dirs, tmp_path):
    """Phi-3-mini-128k's first configs: rope_scaling {"type": "su", ...} beside top-level
    rope_theta and original_max_position_embeddings."""
    def legacy(cfg):
        rope = cfg.pop("rope_parameters")
        cfg["rope_theta"] = rope["rope_theta"]
        cfg["rope_scaling"] = {"type": "su", "short_factor": rope["short_factor"],
                               "long_factor": rope["long_factor"]}

    d = edit_config(hf_dirs["phi3-longrope"], tmp_path / "su", legacy)
    assert load_model(d).config == load_model(hf_dirs["phi3-longrope"]).config


@pytest.mark.parametrize("edit, pattern", [
    (lambda c: c["rope_parameters"].pop("long_factor"), "'longrope' lacks 'long_factor'"),
    (lambda c: c["rope_parameters"].update(short_factor=SHORT[:6]),
     "short_factor has 6 values for 8 rotary frequencies"),
], ids=["no-long-factor", "short-factor-count"])
def test_what_we_do_not_run_is_refused_by_name(hf_dirs, tmp_path, edit, pattern):
    d = edit_config(hf_dirs["phi3-longrope"], tmp_path / "bad", edit)
    with pytest.raises(ModelLoadError, match=pattern):
        load_model(d)


def test_the_served_context(hf_dirs, engines):
    """A prompt past the served context is refused, saying how to serve more; no engine
    serves more than the model's context."""
    with pytest.raises(ValueError, match=r"longer than the context of 64 served \(LLMEngine"
                                         r"\(max_context=\.\.\.\) serves up to the model's 256"):
        engines("phi3-longrope").add_request(_ids(70, seed=8))
    assert engines("phi3", 100).config.max_context == 100
    with pytest.raises(ValueError, match="max_context 257 is not within the model's context"):
        LLMEngine(model=str(hf_dirs["phi3"]), dtype="fp32", kv_cache_bytes=4 << 20,
                  max_context=CONTEXT + 1)


# ---- GGUF files (llama.cpp's phi3 architecture) ----------------------------------------------

# llama.cpp rounds its context up to a multiple of 256 before it compares it with the
# pretrained one: the pretrained context here is 256 (Phi-3's is 4,096).
GGUF_CONTEXT, GGUF_ORIGINAL = 512, 256
# Phi-3's turn markers, control tokens after the byte-level vocabulary.
CHAT_TOKENS = ["<|end|>", "<|user|>", "<|assistant|>", "<|system|>"]
# Hugging Face names -> llama.cpp's for phi3: Q/K/V as one attn_qkv; gate and up as one
# ffn_up, twice as tall.
GGUF_NAMES = {
    "input_layernorm": "attn_norm", "self_attn.qkv_proj": "attn_qkv",
    "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
    "mlp.gate_up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}


@pytest.fixture(scope="module")
def vocab() -> tuple[list[str], list[int], list[str]]:
    """tokenizer.ggml.tokens, .token_type and .merges: a byte-level BPE (Phi-4-mini's kind;
    Phi-3's is SentencePiece, tests/test_gguf_spm.py) with Phi-3's turn markers."""
    tokens, types, merges = _bpe_vocab(_train_bpe())
    return tokens + CHAT_TOKENS, types + [3] * len(CHAT_TOKENS), merges


def _write_phi3_gguf(path: Path, model, vocab, arch: str = "phi3") -> Path:
    """As llama.cpp's converter writes a Phi-3: its metadata (the pretrained context and
    LongRoPE's factor on cos and sin, the sliding window, the rotated part of a head),
    tensors unpermuted, LongRoPE's factors as two tensors."""
    cfg, rope = model.config, model.config.rope_parameters
    w = gguf.GGUFWriter(str(path), arch)
    add_gguf_shape(w, cfg)
    w.add_rope_scaling_orig_ctx_len(cfg.original_max_position_embeddings)
    w.add_rope_dimension_count(int(rope["partial_rotary_factor"] * cfg.hidden_size)
                               // cfg.num_attention_heads)
    w.add_rope_freq_base(float(rope["rope_theta"]))
    w.add_sliding_window(cfg.sliding_window or 0)  # (0: none, as the converter writes it)
    w.add_file_type(int(gguf.LlamaFileType.ALL_F32))
    add_bpe_vocab(w, *vocab)
    w.add_bos_token_id(0)
    w.add_eos_token_id(0)  # <|endoftext|>, as Phi-3's eos
    w.add_add_bos_token(False)
    w.add_chat_template(PHI3_CHAT)
    for name, p in model.state_dict().items():
        if not (name == "lm_head.weight" and cfg.tie_word_embeddings):
            w.add_tensor(gguf_tensor_name(name, GGUF_NAMES),
                         p.detach().float().numpy().copy())
    if rope["rope_type"] == "longrope":
        w.add_rope_scaling_attn_factors(model.model.rotary_emb.attention_scaling)
        w.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], np.float32))
        w.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], np.float32))
    write_gguf_file(w)
    return path


GGUF_VARIANTS = {name: VARIANTS[name] for name in ("phi3-gqa-tied", "phi3-longrope",
                                                   "phi4-mini-like")}


@pytest.fixture(scope="module")
def gguf_models(vocab, tmp_path_factory):
    """name -> (the transformers model, its GGUF file)."""
    root = tmp_path_factory.mktemp("phi3-gguf")
    out = {}
    for seed, (name, kw) in enumerate(GGUF_VARIANTS.items(), start=10):
        model = _phi3(len(vocab[0]), seed, context=GGUF_CONTEXT, original=GGUF_ORIGINAL, **kw)
        out[name] = model, _write_phi3_gguf(root / f"{name}.gguf", model, vocab)
    return out


@pytest.fixture(autouse=True)
def _own_cache_dir(tmp_path, monkeypatch):
    """Dequantized GGUF weights are cached per test."""
    monkeypatch.setenv("LLMDB_CACHE_DIR", str(tmp_path / "cache"))


def _gguf_engine(path: Path, max_context: int | None = None) -> LLMEngine:
    return LLMEngine(model=str(path), dtype="fp32", kv_cache_bytes=4 << 20, threads=2,
                     max_context=max_context)


def _gguf_modes(name: str) -> list[tuple[int | None, list[int]]]:
    """(max_context, prompt lengths) as _modes says."""
    if VARIANTS[name].get("longrope"):
        return [(None, [1, 9, GGUF_ORIGINAL - 6]), (GGUF_CONTEXT, [GGUF_ORIGINAL + 1, 300])]
    return [(None, [1, 9, 300])]


@pytest.mark.parametrize("name", list(GGUF_VARIANTS))
def test_gguf_logits_match_transformers(name, gguf_models, vocab):
    model, path = gguf_models[name]
    for max_context, lengths in _gguf_modes(name):
        engine = _gguf_engine(path, max_context)
        for ids in (_ids(n, seed=9, vocab_size=len(vocab[0])) for n in lengths):
            assert_close(engine.logits(ids), ref_logits(model, ids), f"{name} len {len(ids)}")


@pytest.mark.parametrize("name", list(GGUF_VARIANTS))
def test_gguf_metadata_becomes_model_config(name, gguf_models):
    model, path = gguf_models[name]
    cfg, hf = load_model(path).config, model.config
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_layers, cfg.ffn_size) == (
        hf.vocab_size, hf.hidden_size, hf.num_hidden_layers, hf.intermediate_size)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (4, hf.num_key_value_heads, 16)
    assert cfg.tie_embeddings == hf.tie_word_embeddings
    assert cfg.max_context == GGUF_CONTEXT
    partial = hf.rope_parameters["partial_rotary_factor"]
    assert cfg.rotary_dim == (0 if partial == 1.0 else 12)
    longrope = "longrope" in hf.rope_parameters["rope_type"]
    pairs = int(16 * partial) // 2
    # (As float32, as the file stores them.)
    assert cfg.rope_divisors == pytest.approx(tuple(SHORT[:pairs]) if longrope else ())
    assert cfg.rope_long_divisors == pytest.approx(tuple(LONG[:pairs]) if longrope else ())
    assert cfg.rope_original_context == (GGUF_ORIGINAL if longrope else 0)
    assert cfg.rope_attention_factor == pytest.approx(model.model.rotary_emb.attention_scaling)


def test_gguf_chat_template_and_end_of_turn(gguf_models, vocab):
    """The file's template renders Phi-3's turns; <|end|> is a single token and, with
    <|endoftext|>, ends generation."""
    tok = load_model(gguf_models["phi3-longrope"][1]).tokenizer
    rendered = tok.apply_chat_template([{"role": "user", "content": "What is 17 times 23?"}])
    assert rendered == "<|user|>\nWhat is 17 times 23?<|end|>\n<|assistant|>\n"
    end, assistant = tok.token_id("<|end|>"), tok.token_id("<|assistant|>")
    ids = tok.encode(rendered)
    assert ids.count(end) == 1 and ids[-2:] == [assistant, tok.encode("\n")[0]]
    eos = load_model(gguf_models["phi3-longrope"][1]).config.eos_token_ids
    assert eos[0] == vocab[0].index("<|endoftext|>") and end in eos


def test_partial_rotary_llama_gguf_is_refused_by_name(gguf_models, vocab, tmp_path):
    """llama.cpp's converter permutes a Llama's Q/K rows for its own rotation of whole heads:
    a llama file that rotates part of a head is refused."""
    model, _ = gguf_models["phi4-mini-like"]
    path = _write_phi3_gguf(tmp_path / "partial.gguf", model, vocab, arch="llama")
    with pytest.raises(ModelLoadError, match="GGUF llama RoPE over 12 of 16 head dimensions "
                                             "is not supported"):
        load_model(path)


@torch.inference_mode()
@pytest.mark.parametrize("name", list(GGUF_VARIANTS))
def test_exported_phi3_runs_in_transformers(name, gguf_models, tmp_path):
    """export_hf writes a Phi3ForCausalLM directory (fused tensors, LongRoPE) that
    transformers reads as the same model."""
    from llmdb.engine.models.export import export_hf

    model, path = gguf_models[name]
    out = export_hf(load_model(path), tmp_path / "hf", dtype=torch.float32)
    exported = transformers.AutoModelForCausalLM.from_pretrained(
        out, dtype=torch.float32, attn_implementation="eager").eval()
    assert type(exported).__name__ == "Phi3ForCausalLM"
    for max_context, lengths in _gguf_modes(name):
        ids = _ids(lengths[-1], seed=10, vocab_size=model.config.vocab_size)
        assert_close(_gguf_engine(path, max_context).logits(ids), ref_logits(exported, ids),
                     f"{name} exported, len {len(ids)}")


@torch.inference_mode()
def test_exported_phi3_window_runs_in_transformers(hf_dirs, engines, tmp_path):
    """export_hf writes Phi-3's sliding window (it wrote none, so transformers ran the
    export over the whole context): over 240 tokens, 15 windows of 16, the same logits."""
    from llmdb.engine.models.export import export_hf

    out = export_hf(load_model(hf_dirs["phi3-window"]), tmp_path / "hf", dtype=torch.float32)
    exported = transformers.AutoModelForCausalLM.from_pretrained(
        out, dtype=torch.float32, attn_implementation="eager").eval()
    assert exported.config.sliding_window == 16
    assert load_model(out).config.layer_windows == (16,) * 3
    ids = _ids(240, seed=10)
    assert_close(engines("phi3-window").logits(ids), ref_logits(exported, ids),
                 "phi3-window exported")


# ---- llama.cpp on the same files ----------------------------------------------------------------


@pytest.fixture(scope="module")
def llama_cpp():
    return pytest.importorskip(
        "llama_cpp", reason="llama-cpp-python is not installed: the second reference")


def _llama_cpp(llama_cpp, path: Path, n_ctx: int):
    # verbose=True: verbose=False crashes llama-cpp-python on this machine; F32 KV cache.
    return llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_batch=n_ctx, n_threads=1,
                           logits_all=True, verbose=True, type_k=0, type_v=0)


@pytest.mark.parametrize("name", list(GGUF_VARIANTS))
def test_llama_cpp_agrees_on_phi3_files(name, gguf_models, llama_cpp):
    """llama.cpp picks LongRoPE's set by its context size, as our max_context does: serving
    the pretrained context (short set) or the whole one (long set, short sequences too),
    both give its logits."""
    _, path = gguf_models[name]
    for max_context, lengths in _gguf_modes(name):
        served = _gguf_engine(path, max_context)
        llm = _llama_cpp(llama_cpp, path, served.config.max_context)
        for n in (9, lengths[-1]):
            ids = _ids(n, seed=11, vocab_size=400)
            llm.reset()
            llm.eval(ids)
            theirs = torch.from_numpy(np.array(llm.scores[:n], dtype=np.float32))
            err = float((served.logits(ids) - theirs).norm() / theirs.norm())
            assert err <= 1e-5, f"{name} ctx {max_context} len {n}: {err:.3g} from llama.cpp"


def test_a_phi3_files_window_is_ignored_as_llama_cpp_does(vocab, tmp_path, llama_cpp):
    """llama.cpp runs a phi3 file with full attention whatever its sliding_window says
    (Phi-3-mini-4k's 2,047): so do we, though transformers slides the window."""
    model = _phi3(len(vocab[0]), 20, context=GGUF_CONTEXT, **VARIANTS["phi3-window"])
    path = _write_phi3_gguf(tmp_path / "window.gguf", model, vocab)
    assert gguf.GGUFReader(str(path)).fields["phi3.attention.sliding_window"].contents() == 16
    engine = _gguf_engine(path)
    assert engine.config.layer_windows == ()
    ids = _ids(100, seed=21, vocab_size=400)
    llm = _llama_cpp(llama_cpp, path, GGUF_CONTEXT)
    llm.eval(ids)
    theirs = torch.from_numpy(np.array(llm.scores[:100], dtype=np.float32))
    ours = engine.logits(ids)
    assert float((ours - theirs).norm() / theirs.norm()) <= 1e-5
    windowed = ref_logits(model, ids)
    assert float((ours - windowed).norm() / windowed.norm()) > 0.01


def test_end_of_turn_tokens_are_llama_cpps(gguf_models, llama_cpp):
    """Generation ends on the tokens llama.cpp ends it on (its end-of-generation set)."""
    path = gguf_models["phi3-longrope"][1]
    llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=True)
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    eog = {i for i in range(llm.n_vocab()) if llama_cpp.llama_vocab_is_eog(vocab, i)}
    assert set(load_model(path).config.eos_token_ids) == eog
