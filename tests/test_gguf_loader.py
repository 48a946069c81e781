"""The GGUF path end to end, on tiny Llama models written here the way llama.cpp writes them.

Each model is a random `transformers.LlamaForCausalLM` (GQA) that `_write_gguf` stores with
`gguf.GGUFWriter` as llama.cpp's `convert_hf_to_gguf.py` does: llama.* metadata, a byte-level
BPE tokenizer in tokenizer.ggml.* keys, llama.cpp tensor names, and Q/K rows permuted. The
loader must undo all of it: with F32 tensors our logits equal `transformers`; quantized
tensors load as exactly `gguf.quants.dequantize` of what was written. No downloads.

K-quants, which the `gguf` package cannot quantize, are made by llama.cpp itself
(llama-cpp-python, when installed); llama.cpp then also serves as a second, independent
reference: for the logits of the same files, and for tokenization.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import random
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as QT
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from llmdb.engine.engine import LLMEngine
from llmdb.engine.models import ModelLoadError, gguf_file, load_model, loader
from llmdb.engine.models.gguf_file import read_gguf_metadata

from .model_builders import (
    LOGIT_RTOL,
    add_bpe_vocab,
    add_gguf_shape,
    gguf_tensor_name,
    randomize,
    ref_logits,
    write_gguf_file,
)

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # control tokens, ids 0..2
EOT, IM_START, IM_END = 0, 1, 2
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "SELECT count(*) FROM orders WHERE id > 1234;",
    "Hello, world! What is the capital of France? Paris.",
    "def reverse(xs):\n    return xs[::-1]\n",
    "Databases store rows in pages; a B-tree indexes them.",
    "naïve café — 東京 2024 ünïcödé",
]
CONTEXT = 128

# Hugging Face parameter names -> llama.cpp tensor names (convert_hf_to_gguf's mapping).
LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


# ---- building tiny models ------------------------------------------------------------------


def _train_bpe() -> Tokenizer:
    """A byte-level BPE like SmolLM's: digits split one by one, then the GPT-2 split."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIALS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS * 20, trainer)
    return tok


@pytest.fixture(scope="module")
def bpe() -> Tokenizer:
    return _train_bpe()


def _vocab(tok: Tokenizer) -> tuple[list[str], list[int], list[str]]:
    """tokenizer.ggml.tokens, .token_type and .merges as the converter writes them."""
    vocab = tok.get_vocab(with_added_tokens=True)
    tokens = sorted(vocab, key=vocab.__getitem__)
    assert [vocab[t] for t in tokens] == list(range(len(tokens)))
    types = [3 if t in SPECIALS else 1 for t in tokens]  # CONTROL = 3, NORMAL = 1
    merges = [" ".join(m) if isinstance(m, list) else m
              for m in json.loads(tok.to_str())["model"]["merges"]]
    return tokens, types, merges


def _hf_llama(vocab_size: int, *, hidden: int, heads: int, kv_heads: int, ffn: int,
              layers: int, tie: bool, theta: float, eps: float, seed: int,
              family: str = "Llama", scaling: dict | None = None, **extra):
    """A random Llama-family model (family: Llama, Qwen2 or Qwen3), RoPE scaled by
    `scaling`; extra: more config (head_dim)."""
    cfg = getattr(transformers, f"{family}Config")(
        vocab_size=vocab_size, hidden_size=hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, intermediate_size=ffn,
        max_position_embeddings=CONTEXT, rms_norm_eps=eps,
        rope_parameters={"rope_type": "default", "rope_theta": theta, **(scaling or {})},
        tie_word_embeddings=tie, bos_token_id=EOT, eos_token_id=IM_END, **extra,
    )
    torch.manual_seed(seed)
    model = getattr(transformers, f"{family}ForCausalLM")(cfg)
    randomize(model, seed)
    model.config._attn_implementation = "eager"
    return model.eval()


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: each head's two RoPE halves interleaved."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """The inverse of `_permute`, derived from it rather than written out a second time."""
    order = _permute(np.arange(w.shape[0])[:, None], n_head)[:, 0]
    return w[np.argsort(order)]


def _gguf_tensors(model) -> dict[str, np.ndarray]:
    """llama.cpp name -> fp32 array, as its converter writes them: Llama's Q/K rows permuted
    (K with the KV head count; Qwen2's are not); no `output` tensor when the embeddings are
    tied; Llama 3's RoPE scaling as the `rope_freqs` tensor."""
    cfg = model.config
    permute = cfg.model_type == "llama"
    out = {}
    for name, p in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        gname, w = gguf_tensor_name(name, LAYER_NAMES), p.detach().float().numpy().copy()
        if permute and gname.endswith(".attn_q.weight"):
            w = _permute(w, cfg.num_attention_heads)
        elif permute and gname.endswith(".attn_k.weight"):
            w = _permute(w, cfg.num_key_value_heads)
        out[gname] = w
    if cfg.rope_parameters["rope_type"] == "llama3":
        out["rope_freqs.weight"] = _llama3_rope_freqs(cfg)
    return out


def _llama3_rope_freqs(cfg) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.generate_extra_tensors, written out here as the
    reference (not llmdb's code): a divisor per frequency."""
    rope = cfg.rope_parameters
    d = cfg.hidden_size // cfg.num_attention_heads
    freqs = 1.0 / (rope["rope_theta"] ** (np.arange(0, d, 2, dtype=np.float32) / d))
    old = rope["original_max_position_embeddings"]
    low, high, factor = rope["low_freq_factor"], rope["high_freq_factor"], rope["factor"]
    out = []
    for f in freqs:
        wavelen = 2 * np.pi / f
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


K_TYPES = (QT.Q4_K, QT.Q5_K, QT.Q6_K)


def _random_k_blocks(shape: tuple[int, ...], qtype: QT) -> np.ndarray:
    """Valid K-quant bytes for a tensor of `shape`: random quants and sub-block scales, small
    positive fp16 super-block scales. Not a quantization of anything: the gguf package has
    no K-quant quantizer (llama.cpp's is used where installed, below)."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(int(qtype))
    n = int(np.prod(shape)) // block
    blocks = rng.integers(0, 256, size=(n, size), dtype=np.uint8)
    scales = rng.uniform(1e-3, 1e-2, size=(n, 2)).astype(np.float16).view(np.uint8)
    if qtype == QT.Q6_K:
        blocks[:, -2:] = scales[:, :2]  # d is Q6_K's last field
    else:
        blocks[:, :4] = scales  # d and dmin lead Q4_K and Q5_K blocks
    return blocks.reshape(*shape[:-1], shape[-1] // block * size)


def _encode_tensor(w: np.ndarray, qtype: QT) -> tuple[np.ndarray, QT | None]:
    """Array and raw dtype for GGUFWriter.add_tensor; 1-D tensors stay F32 as in llama.cpp."""
    if w.ndim == 1 or qtype == QT.F32:
        return w.astype(np.float32), None
    if qtype == QT.F16:
        return w.astype(np.float16), None
    if qtype in K_TYPES:
        return _random_k_blocks(w.shape, qtype), qtype
    return gguf.quants.quantize(w, qtype), qtype


def _write_gguf(path: Path, model, tok: Tokenizer, qtype: QT = QT.F32, *, arch: str | None = None,
                tokenizer_model: str = "gpt2", pre: str | None = "smollm",
                tensor_types: dict[str, QT] | None = None,
                extra_tokens: tuple[tuple[str, int], ...] = (), extra=None,
                with_tensors: bool = True, split_max_tensors: int = 0) -> Path:
    cfg = model.config
    arch = arch or cfg.model_type
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    tokens, types, merges = _vocab(tok)
    tokens += [t for t, _ in extra_tokens]
    types += [ty for _, ty in extra_tokens]
    # (also writes general.architecture; split: in files PATH-0000k-of-0000n.gguf)
    w = gguf.GGUFWriter(str(path), arch, split_max_tensors=split_max_tensors)
    w.add_name("tiny-test-llama")
    w.add_vocab_size(len(tokens))
    add_gguf_shape(w, cfg)
    w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    if cfg.rope_parameters["rope_type"] == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(cfg.rope_parameters["factor"])
    w.add_file_type(int(getattr(gguf.LlamaFileType, f"MOSTLY_{qtype.name}",
                                gguf.LlamaFileType.ALL_F32)))
    add_bpe_vocab(w, tokens, types, merges, model=tokenizer_model, pre=pre)
    w.add_bos_token_id(EOT)
    w.add_eos_token_id(IM_END)
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML)
    if extra is not None:
        extra(w)
    if with_tensors:
        for name, arr in _gguf_tensors(model).items():
            data, raw = _encode_tensor(arr, (tensor_types or {}).get(name, qtype))
            w.add_tensor(name, data, raw_dtype=raw)
    write_gguf_file(w)
    return path


SMALL = dict(hidden=64, heads=4, kv_heads=2, ffn=128, layers=2)  # head_dim 16; rows % 32 == 0
# Llama 3.1's RoPE scaling at a tiny scale: over 128 positions with head_dim 16, some
# frequencies kept (wavelength < 32 / 4), some stretched 8x (> 32) and some blended.
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
VARIANTS = {
    # Untied head, non-default RoPE base and a large RMSNorm eps: a loader that drops any of
    # them (or falls back to a default) moves the logits well past the tolerance.
    "untied": dict(SMALL, tie=False, theta=50000.0, eps=1e-2, seed=1),
    "tied": dict(SMALL, layers=3, tie=True, theta=500000.0, eps=1e-5, seed=2),
    # Qwen2 (qwen2 architecture: Q/K/V biases, Q/K rows not permuted), tied as Qwen2.5-0.5B-3B.
    "qwen2": dict(SMALL, tie=True, theta=1000000.0, eps=1e-6, seed=4, family="Qwen2"),
    # Llama 3.1-3.3 (a rope_freqs tensor) and linear scaling (metadata).
    "llama3-rope": dict(SMALL, tie=True, theta=10000.0, eps=1e-5, seed=5, scaling=LLAMA3_ROPE),
    "linear-rope": dict(SMALL, tie=False, theta=10000.0, eps=1e-5, seed=6,
                        scaling={"rope_type": "linear", "factor": 4.0}),
    # Qwen3 (qwen3 architecture: per-head Q/K norms, Q/K rows not permuted, no biases) with
    # heads wider than hidden / heads, as Qwen3-0.6B's 16 x 128 from 1,024.
    "qwen3": dict(SMALL, tie=True, theta=1000000.0, eps=1e-6, seed=7, family="Qwen3",
                  head_dim=32),
}
# K-quant super-blocks hold 256 values: every quantized row (hidden, heads * head_dim, ffn)
# must be a multiple of 256. head_dim 64.
KQUANT = dict(hidden=256, heads=4, kv_heads=2, ffn=512, layers=2, tie=False, theta=50000.0,
              eps=1e-5, seed=3)


@pytest.fixture(scope="module")
def kquant_model(bpe):
    return _hf_llama(bpe.get_vocab_size(), **KQUANT)


@pytest.fixture(scope="module")
def hf_models(bpe):
    vocab = bpe.get_vocab_size()
    return {name: _hf_llama(vocab, **kw) for name, kw in VARIANTS.items()}


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("gguf")


@pytest.fixture(scope="module")
def f32_files(hf_models, bpe, gguf_dir) -> dict[str, Path]:
    return {name: _write_gguf(gguf_dir / f"{name}-f32.gguf", m, bpe)
            for name, m in hf_models.items()}


@pytest.fixture(scope="module")
def quant_file(hf_models, bpe, gguf_dir):
    """qtype -> the "untied" model written with that type for every 2-D tensor."""
    cache: dict[QT, Path] = {}

    def get(qtype: QT) -> Path:
        if qtype not in cache:
            cache[qtype] = _write_gguf(gguf_dir / f"untied-{qtype.name}.gguf",
                                       hf_models["untied"], bpe, qtype)
        return cache[qtype]

    return get


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    """Dequantized weights are cached per test; no user model registry is consulted. One
    thread: on these tiny matrices a second one only adds synchronization (tens of times
    slower on a busy 2-core machine). The process-wide setting is restored afterwards."""
    monkeypatch.setenv("LLMDB_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("LLMDB_CONFIG_DIR", str(tmp_path / "config"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _engine(path: Path) -> LLMEngine:
    return LLMEngine(model=str(path), dtype="fp32", kv_cache_bytes=16 << 20, threads=1)


def _sequences(vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    # 1 token; under one 16-token block; several blocks; nearly the whole context.
    return [[rng.randrange(vocab) for _ in range(n)] for n in (1, 9, 53, CONTEXT - 8)]


def _max_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """max |ours - ref| relative to the reference's max |logit| (at least 1)."""
    assert ours.shape == ref.shape, f"shape {tuple(ours.shape)} vs {tuple(ref.shape)}"
    return float((ours - ref).abs().max()) / max(1.0, float(ref.abs().max()))


def _rms_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """||ours - ref|| / ||ref||: the size of a quantization error, insensitive to outliers."""
    assert ours.shape == ref.shape
    return float((ours - ref).norm() / ref.norm())


# ---- F32: exact against transformers -------------------------------------------------------


@pytest.mark.parametrize("name", list(VARIANTS))
def test_f32_logits_match_transformers(name, hf_models, f32_files):
    """Proves the names, the Q/K un-permutation (GQA), tied/untied output, theta and eps."""
    model, engine = hf_models[name], _engine(f32_files[name])
    for ids in _sequences(engine.config.vocab_size, seed=len(name)):
        ref = ref_logits(model, ids)
        assert float(ref.std()) > 0.5, "degenerate model: logits hardly vary"
        err = _max_err(engine.logits(ids), ref)
        assert err <= LOGIT_RTOL, f"{name} len {len(ids)}: relative error {err:.3g}"
    assert engine.pool.num_free == engine.pool.num_blocks


@pytest.mark.parametrize("name", list(VARIANTS))
def test_metadata_becomes_model_config(name, hf_models, f32_files):
    cfg, hf = load_model(f32_files[name]).config, hf_models[name].config
    assert cfg.arch == "llama"
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_layers, cfg.ffn_size) == (
        hf.vocab_size, hf.hidden_size, hf.num_hidden_layers, hf.intermediate_size)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (4, 2, 32 if name == "qwen3"
                                                               else 16)
    assert cfg.tie_embeddings == hf.tie_word_embeddings
    assert cfg.max_context == CONTEXT
    assert cfg.rope_theta == hf.rope_parameters["rope_theta"]
    kind = hf.rope_parameters["rope_type"]
    expected = (tuple(_llama3_rope_freqs(hf).tolist()) if kind == "llama3"
                else (4.0,) * 8 if kind == "linear" else ())
    assert cfg.rope_divisors == expected
    assert cfg.norm_eps == pytest.approx(hf.rms_norm_eps)  # stored as f32 in GGUF
    assert cfg.bos_token_id == EOT
    # eos is <|im_end|> itself (listed once); <|endoftext|> also ends generation, as in llama.cpp
    assert cfg.eos_token_ids == (IM_END, EOT)


def test_weights_are_hf_named_and_survive_the_cache(f32_files, hf_models):
    """The second load maps the safetensors cache: same tensors, HF names and layout."""
    first = load_model(f32_files["untied"])
    second = load_model(f32_files["untied"])
    assert first.fingerprint == second.fingerprint
    ref = hf_models["untied"].state_dict()
    assert set(second.weights) == set(ref)
    for k, v in second.weights.items():
        assert torch.equal(v, first.weights[k]), k
        assert torch.equal(v, ref[k]), k


def test_a_split_model_loads_from_its_first_file(hf_models, bpe, tmp_path, llama_cpp):
    """gguf-split's files (large models are published so): only the first file's tensors
    were read, and the load failed on a tensor the other files hold. llama.cpp opens them
    from the first file too."""
    _write_gguf(tmp_path / "split.gguf", hf_models["untied"], bpe, split_max_tensors=8)
    parts = sorted(tmp_path.glob("split-*.gguf"))
    assert [p.name for p in parts] == [f"split-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    loaded = load_model(parts[0])
    ref = hf_models["untied"].state_dict()
    assert set(loaded.weights) == set(ref)
    for k, v in loaded.weights.items():
        assert torch.equal(v, ref[k]), k
    ids = _sequences(400, seed=11)[2]
    ours = _engine(parts[0]).logits(ids)
    assert _max_err(ours, ref_logits(hf_models["untied"], ids)) <= LOGIT_RTOL
    assert _rms_err(ours, _llama_cpp_logits(llama_cpp, parts[0], ids)) <= 1e-5

    with pytest.raises(ModelLoadError, match=r"split-00002-of-00003.gguf is part 2 of a split "
                                             r"model: give its first file, "
                                             r"split-00001-of-00003.gguf"):
        loader.check_model(parts[1])
    parts[2].unlink()
    with pytest.raises(ModelLoadError, match=r"split-00001-of-00003.gguf is the first of 3 "
                                             r"files of a split model, and "
                                             r"split-00003-of-00003.gguf is missing"):
        loader.check_model(parts[0])


def test_windows_and_softcap_survive_the_metadata_cache(f32_files, tmp_path):
    loaded = load_model(f32_files["tied"])
    config = dataclasses.replace(loaded.config, layer_windows=(4, 0, 4), attn_softcap=50.0)
    meta = tmp_path / "meta.json"
    meta.write_text(loader._meta_json(config, loaded.tokenizer))
    again, _ = loader._read_meta(meta)
    assert again == config and isinstance(again.layer_windows, tuple)


@pytest.mark.parametrize("pattern, windows", [
    (None, (4, 0, 4)),  # the architecture's default pattern (2 here): every second is global
    (3, (4, 4, 0)),
    (0, (4, 4, 4)),  # llama.cpp's 0: every layer slides
    ([False, True, True], (0, 4, 4)),  # a flag a layer
])
def test_sliding_window_metadata_where_llama_cpp_reads_it(pattern, windows, hf_models, bpe,
                                                         gguf_dir, monkeypatch):
    """As llama.cpp's set_swa_pattern reads {arch}.attention.sliding_window_pattern, for an
    architecture that has windows (Gemma's: tests/test_gemma_gguf.py runs them)."""
    monkeypatch.setitem(gguf_file.SLIDING_PATTERNS, "llama", (2, 0))

    def extra(w):
        w.add_sliding_window(4)
        if pattern is not None:
            w.add_sliding_window_pattern(pattern)

    path = _write_gguf(gguf_dir / f"swa-{pattern}.gguf", hf_models["tied"], bpe, extra=extra,
                       with_tensors=False)
    assert read_gguf_metadata(path)[0].layer_windows == windows


# ---- types the gguf package can quantize ---------------------------------------------------

# type -> bound on the rms logit error relative to the F32 model (measured: a quarter to a
# half of each bound; a wrong layout or scale gives errors of order 1)
QUANT_RMS_TOLERANCE = {QT.F16: 3e-3, QT.BF16: 2e-2, QT.Q8_0: 6e-2, QT.Q4_1: 0.5, QT.Q4_0: 0.5}


def _roundtrip(w: np.ndarray, qtype: QT) -> np.ndarray:
    """What a reader gets back from a tensor written as `qtype`. Quantization blocks never
    cross rows, so this commutes with the Q/K row permutation: no un-permuting needed."""
    if w.ndim == 1 or qtype == QT.F32:
        return w
    data, raw = _encode_tensor(w, qtype)
    return gguf.quants.dequantize(data, raw or qtype).reshape(w.shape)


@pytest.mark.parametrize("qtype", list(QUANT_RMS_TOLERANCE), ids=lambda q: q.name)
def test_quantized_weights_and_logits(qtype, hf_models, f32_files, quant_file):
    model, path = hf_models["untied"], quant_file(qtype)
    engine = _engine(path)
    assert engine.config == load_model(f32_files["untied"]).config  # the type changes none

    # Loaded weights are exactly the dequantized written tensors, in HF layout.
    loaded = load_model(path).weights
    expected = {k: _roundtrip(v.float().numpy(), qtype) for k, v in model.state_dict().items()}
    assert set(loaded) == set(expected)
    for k, v in loaded.items():
        assert v.dtype == torch.float32
        assert np.array_equal(v.numpy(), expected[k]), f"{k} differs from the dequantized tensor"

    # transformers with those same weights is an exact reference; the F32 model bounds the
    # quantization error.
    deq = _hf_llama(model.config.vocab_size, **VARIANTS["untied"])
    deq.load_state_dict({k: torch.from_numpy(v) for k, v in expected.items()})
    for ids in _sequences(engine.config.vocab_size, seed=5)[1:3]:
        ours = engine.logits(ids)
        err = _max_err(ours, ref_logits(deq, ids))
        assert err <= LOGIT_RTOL, f"{qtype.name}: relative error {err:.3g} vs dequantized model"
        err = _rms_err(ours, ref_logits(model, ids))
        assert err <= QUANT_RMS_TOLERANCE[qtype], f"{qtype.name}: {err:.3g} from the F32 model"


def test_mixed_tensor_types_in_one_file(hf_models, bpe, gguf_dir):
    """As in llama.cpp's files: other types for the embeddings and some layers. Compared with
    the file's own tensors, dequantized and un-permuted here."""
    model = hf_models["tied"]
    types = {"token_embd.weight": QT.Q8_0, "blk.0.attn_k.weight": QT.F16,
             "blk.1.attn_q.weight": QT.BF16, "blk.2.ffn_down.weight": QT.F32}
    path = _write_gguf(gguf_dir / "tied-mixed.gguf", model, bpe, QT.Q4_1, tensor_types=types)
    loaded = load_model(path)
    assert loaded.config.tie_embeddings and "lm_head.weight" not in loaded.weights
    _assert_weights_are_the_files(path, loaded.weights, model.config)
    reader = gguf.GGUFReader(str(path))
    assert {t.tensor_type for t in reader.tensors} == {QT.F32, QT.F16, QT.BF16, QT.Q8_0, QT.Q4_1}


def _assert_weights_are_the_files(path: Path, weights: dict, hf_cfg) -> None:
    hf_names = {gguf_tensor_name(k, LAYER_NAMES): k for k in weights}
    reader = gguf.GGUFReader(str(path))
    assert len(reader.tensors) == len(weights)
    for t in reader.tensors:
        shape = tuple(int(d) for d in reversed(t.shape))
        w = gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape)
        if t.name.endswith(".attn_q.weight"):
            w = _unpermute(w, hf_cfg.num_attention_heads)
        elif t.name.endswith(".attn_k.weight"):
            w = _unpermute(w, hf_cfg.num_key_value_heads)
        assert np.array_equal(weights[hf_names[t.name]].numpy(), w), t.name


def test_k_quants_cannot_be_written_by_the_gguf_package():
    """Hence random valid blocks here, and real K-quant files from llama.cpp's quantizer."""
    w = np.zeros((2, 256), dtype=np.float32)
    for qtype in K_TYPES:
        with pytest.raises(NotImplementedError):
            gguf.quants.quantize(w, qtype)


@pytest.mark.parametrize("qtype", K_TYPES, ids=lambda q: q.name)
def test_k_quant_blocks_load_as_dequantized(qtype, kquant_model, bpe, tmp_path):
    """Random but valid K-quant tensors (no quantizer needed): named, un-permuted and
    dequantized as the file says."""
    path = _write_gguf(tmp_path / f"k-{qtype.name}.gguf", kquant_model, bpe, qtype)
    loaded = load_model(path)
    assert (loaded.config.num_kv_heads, loaded.config.head_dim) == (2, 64)
    _assert_weights_are_the_files(path, loaded.weights, kquant_model.config)
    assert all(bool(torch.isfinite(w).all()) for w in loaded.weights.values())


# ---- llama.cpp: K-quants and a second reference --------------------------------------------


@pytest.fixture(scope="module")
def llama_cpp():
    return pytest.importorskip(
        "llama_cpp", reason="llama-cpp-python is not installed: it makes the K-quant files and "
        "is the second reference")


def _llama_cpp_logits(llama_cpp, path: Path, ids: list[int]) -> torch.Tensor:
    # F32 KV cache: the default F16 one would dominate the difference. verbose=True because
    # verbose=False crashes llama-cpp-python on this machine (see test_llama_cpp_parity.py).
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=CONTEXT, n_batch=CONTEXT, n_threads=1,
                          logits_all=True, verbose=True, type_k=0, type_v=0)
    llm.eval(ids)
    return torch.from_numpy(np.array(llm.scores[: len(ids)], dtype=np.float32))


# llama.cpp ftype -> (the type its file must contain, rms bound vs the F32 model). The types
# the gguf package cannot write (K-quants, i-quants, Q5_0/Q5_1), each from llama.cpp's own
# quantizer: the formats of the files people download. (IQ1, IQ2 and IQ3_XXS need an
# importance matrix, which llama-cpp-python cannot pass: not checked, so refused.)
LLAMA_CPP_FTYPES = {
    "Q4_K_S": (QT.Q4_K, 0.5), "Q5_K_M": (QT.Q5_K, 0.25), "Q6_K": (QT.Q6_K, 0.12),
    "Q3_K_M": (QT.Q3_K, 0.8), "Q2_K": (QT.Q2_K, 1.4), "Q5_0": (QT.Q5_0, 0.3),
    "Q5_1": (QT.Q5_1, 0.3), "IQ4_NL": (QT.IQ4_NL, 0.5), "IQ4_XS": (QT.IQ4_XS, 0.5),
    "IQ3_S": (QT.IQ3_S, 1.0),
}


def _llama_cpp_quantize(llama_cpp, src: Path, out: Path, ftype: str) -> Path:
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    params.nthread = 1
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(out).encode(),
                                        ctypes.byref(params))
    assert rc == 0, f"llama.cpp failed to quantize to {ftype}"
    return out


@pytest.fixture(scope="module")
def kquant(llama_cpp, kquant_model, bpe, gguf_dir):
    """The K-quant-sized model, its F32 file, and ftype -> the file llama.cpp quantized."""
    src = _write_gguf(gguf_dir / "k-f32.gguf", kquant_model, bpe)
    return kquant_model, src, {
        ftype: _llama_cpp_quantize(llama_cpp, src, gguf_dir / f"k-{ftype}.gguf", ftype)
        for ftype in LLAMA_CPP_FTYPES}


def _tensor_types(path: Path) -> set[QT]:
    return {t.tensor_type for t in gguf.GGUFReader(str(path)).tensors}


@pytest.mark.parametrize("ftype", list(LLAMA_CPP_FTYPES))
def test_quantized_files_from_llama_cpp(ftype, kquant, llama_cpp):
    model, _, files = kquant
    qtype, rms_bound = LLAMA_CPP_FTYPES[ftype]
    path = files[ftype]
    types = _tensor_types(path)
    assert qtype in types, f"{ftype}: llama.cpp wrote {sorted(t.name for t in types)}"

    loaded = load_model(path)
    assert (loaded.config.num_kv_heads, loaded.config.head_dim) == (2, 64)
    _assert_weights_are_the_files(path, loaded.weights, model.config)

    engine = _engine(path)
    deq = _hf_llama(model.config.vocab_size, **KQUANT)
    deq.load_state_dict(loaded.weights)
    ids = _sequences(engine.config.vocab_size, seed=9)[2]
    ours = engine.logits(ids)
    assert _max_err(ours, ref_logits(deq, ids)) <= LOGIT_RTOL
    err = _rms_err(ours, ref_logits(model, ids))
    assert err <= rms_bound, f"{ftype}: {err:.3g} from the F32 model"
    # llama.cpp rounds activations to 8 bits for quantized matmuls: a few % apart here,
    # several times closer than either is to the F32 model.
    err = _rms_err(ours, _llama_cpp_logits(llama_cpp, path, ids))
    assert err <= 0.06, f"{ftype}: {err:.3g} from llama.cpp on the same file"


def test_a_q4_k_m_file_with_narrow_rows_loads(llama_cpp, hf_models, f32_files, gguf_dir):
    """Rows of fewer than 256 values (SmolLM2's 576-wide, Qwen2.5-0.5B's 896-wide tensors:
    any width not a multiple of 256) cannot be K-quants: llama.cpp writes them Q5_0 or Q8_0
    inside a Q4_K_M file, the most downloaded kind. Such a file loads and means what it means
    to llama.cpp."""
    path = _llama_cpp_quantize(llama_cpp, f32_files["untied"], gguf_dir / "untied-Q4_K_M.gguf",
                               "Q4_K_M")
    assert QT.Q5_0 in _tensor_types(path)
    ids = _sequences(400, seed=11)[2]
    ours = _engine(path).logits(ids)
    assert _rms_err(ours, _llama_cpp_logits(llama_cpp, path, ids)) <= 0.06
    assert _rms_err(ours, ref_logits(hf_models["untied"], ids)) <= 0.3


@pytest.mark.parametrize("qtype", [QT.F32, QT.F16, QT.Q8_0, QT.Q4_0], ids=lambda q: q.name)
def test_llama_cpp_agrees_on_our_files(qtype, llama_cpp, f32_files, quant_file):
    """llama.cpp reads the files written here as we do: the writer matches the real format
    (a writer and loader wrong the same way would pass the transformers tests)."""
    path = f32_files["untied"] if qtype == QT.F32 else quant_file(qtype)
    ids = _sequences(400, seed=11)[2]
    ours, theirs = _engine(path).logits(ids), _llama_cpp_logits(llama_cpp, path, ids)
    # F32 and F16 weights: llama.cpp computes in fp32 (F16: fp16 activations, ~6e-4 rms);
    # Q8_0/Q4_0: activations rounded to 8 bits (~2% rms).
    bound = {QT.F32: 1e-5, QT.F16: 3e-3}.get(qtype, 0.06)
    err = _rms_err(ours, theirs)
    assert err <= bound, f"{qtype.name}: {err:.3g} from llama.cpp"


@pytest.mark.parametrize("name", ["qwen2", "llama3-rope", "linear-rope", "qwen3"])
def test_llama_cpp_agrees_on_other_llama_family_files(name, llama_cpp, f32_files):
    """Qwen2's unpermuted Q/K and biases, the rope_freqs divisors and linear scaling mean to
    llama.cpp what they mean to us (the sequence is long enough for scaling to matter)."""
    ids = _sequences(400, seed=12)[3]
    ours = _engine(f32_files[name]).logits(ids)
    err = _rms_err(ours, _llama_cpp_logits(llama_cpp, f32_files[name], ids))
    assert err <= 1e-5, f"{name}: {err:.3g} from llama.cpp"


def test_sliding_window_of_a_llama_file_is_ignored_as_llama_cpp_ignores_it(
        llama_cpp, hf_models, bpe, gguf_dir):
    """A Mistral 7B v0.1 GGUF is arch llama with llama.attention.sliding_window: llama.cpp
    runs it with full attention, and so do we."""
    path = _write_gguf(gguf_dir / "untied-swa.gguf", hf_models["untied"], bpe,
                       extra=lambda w: w.add_sliding_window(8))
    assert load_model(path).config.layer_windows == ()
    ids = _sequences(400, seed=12)[3]  # 120 tokens: 15 windows
    ours = _engine(path).logits(ids)
    err = _rms_err(ours, _llama_cpp_logits(llama_cpp, path, ids))
    assert err <= 1e-5, f"{err:.3g} from llama.cpp"


# ---- tokenizer from GGUF metadata ----------------------------------------------------------

TEXTS = [
    "Hello, world! What is the capital of France?",
    "SELECT count(*) FROM orders WHERE id > 1234;",
    "  leading spaces,\ttabs\nand newlines\n\n",
    "naïve café — 東京 2024 ünïcödé 🦙",
    "unseen words: zyxwvut qqq 987654321",
    "don't I'll WE'RE $100 <=> ^~| x = (a+b)*c; // ok?!",
    "<|im_start|>user\nhi<|im_end|>\n<think>hmm</think> zyxw",
    "CamelCase HTTPServer iPhone McDONALD's x/y\n/z ÉCOLE École",
]
THINK, ZYXW = "<think>", "Ġzyxw"  # a user-defined token; a whole word no merge reaches
# A word only a split that ignores case keeps whole (Tekken's splits it at the C).
CAMEL = "CamelCase"
EXTRA_TOKENS = ((THINK, 4), (ZYXW, 1), (CAMEL, 1))


def test_tokenizer_round_trip_and_matches_the_original(f32_files, bpe):
    tok = load_model(f32_files["untied"]).tokenizer
    assert tok.vocab_size == bpe.get_vocab_size()
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == bpe.encode(text).ids, text
        assert tok.decode(ids, skip_special=False) == text
    digits = tok.encode("2024")  # one by one: the "smollm" pre-tokenizer
    assert len(digits) == 4 and tok.decode(digits) == "2024"


def test_control_tokens_are_single_special_tokens(f32_files):
    tok = load_model(f32_files["untied"]).tokenizer
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == IM_START and ids[-1] == IM_END
    assert IM_START not in ids[1:-1] and IM_END not in ids[1:-1]
    assert tok.decode(ids) == "user\nhi"  # control tokens are skipped by default
    assert tok.decode(ids, skip_special=False) == "<|im_start|>user\nhi<|im_end|>"
    assert (tok.bos_token, tok.eos_token, tok.add_bos) == ("<|endoftext|>", "<|im_end|>", False)


def test_chat_template_renders(f32_files, bpe):
    tok = load_model(f32_files["tied"]).tokenizer
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "What is 17 times 23?"}]
    rendered = tok.apply_chat_template(messages)
    assert rendered == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nWhat is 17 times 23?<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = tok.encode(rendered)
    assert ids == bpe.encode(rendered).ids
    assert ids.count(IM_START) == 3 and ids.count(IM_END) == 2


@pytest.fixture(scope="module")
def vocab_file(hf_models, bpe, gguf_dir):
    """pre -> a tensor-less GGUF with the extra tokens (None: no tokenizer.ggml.pre key)."""
    def get(pre: str | None) -> Path:
        path = gguf_dir / f"vocab-{pre}.gguf"
        if not path.exists():
            _write_gguf(path, hf_models["untied"], bpe, pre=pre, extra_tokens=EXTRA_TOKENS,
                        with_tensors=False)
        return path

    return get


def _pieces(tok, text: str) -> list[str]:
    return [tok.decode([i], skip_special=False) for i in tok.encode(text)]


def test_user_defined_tokens_are_matched_whole_and_decoded(vocab_file):
    """llama.cpp's converter types non-special added tokens (e.g. DeepSeek-R1-Distill-Llama's
    <think>) USER_DEFINED: matched whole like control tokens, but printed when decoding."""
    _, tok = read_gguf_metadata(vocab_file("smollm"))
    think = tok.token_id(THINK)
    ids = tok.encode("<think>hi<|im_end|>")
    assert ids[0] == think and ids[-1] == IM_END and think not in ids[1:]
    assert tok.decode(ids) == "<think>hi"


@pytest.mark.parametrize("pre, text, pieces", [
    # llama.cpp's "default" (also used when the key is missing) splits punctuation and the
    # symbols $+<=>^~| off first: " >" becomes " " and ">".
    ("default", "id > 1", ["i", "d", " ", ">", " ", "1"]),
    (None, "id > 1", ["i", "d", " ", ">", " ", "1"]),
    ("gpt-2", "id > 1", ["i", "d", " >", " ", "1"]),
    # Llama 3: a piece in the vocabulary is one token even when no merge leads to it.
    ("llama-bpe", "hi zyxw zyxwv", ["h", "i", " zyxw", " ", "z", "y", "x", "w", "v"]),
    ("gpt-2", "hi zyxw", ["h", "i", " ", "z", "y", "x", "w"]),
    ("smollm", "x 2024", ["x", " ", "2", "0", "2", "4"]),
    # Qwen2: Llama 3's split, but digits one by one.
    ("qwen2", "x 2024", ["x", " ", "2", "0", "2", "4"]),
    ("llama-bpe", "x 2024", ["x", " ", "2", "0", "2", "4"]),
])
def test_pre_tokenizers(vocab_file, pre, text, pieces):
    _, tok = read_gguf_metadata(vocab_file(pre))
    assert _pieces(tok, text) == pieces


def test_tekken_splits_words_at_case_changes(vocab_file):
    """Mistral's Tekken pre-tokenizer (its tokenizer.json's regex): a word splits where a
    lower-case run meets a capital, capitals lead the lower-case run after them, a mark
    leads the word after it, digits go one by one."""
    _, tok = read_gguf_metadata(vocab_file("tekken"))
    split = tok.tokenizer.pre_tokenizer.pre_tokenize_str("CamelCase HTTPServer x/y 42")
    assert [w for w, _ in split] == ["Camel", "Case", "ĠHTTPServer", "Ġx", "/y", "Ġ", "4", "2"]


# o200k's split, from GPT-4o's and Phi-4-mini's tokenizer.json.
GPT4O_REGEX = (
    "[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]*[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]+"
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]+"
    "[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\\p{N}{1,3}"
    "| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
)


def test_gpt4o_keeps_contractions_and_splits_digits_in_threes(vocab_file, hf_models,
                                                               tmp_path, llama_cpp):
    """GPT-4o's pre-tokenizer (Phi-4-mini): Tekken's case-aware words, but a contraction
    stays on its word and digits go three at a time. A vocabulary trained with that split
    (merges across "don" + "'t" and digit triples) encodes as its tokenizer.json and as
    llama.cpp do."""
    _, tok = read_gguf_metadata(vocab_file("gpt-4o"))
    split = tok.tokenizer.pre_tokenizer.pre_tokenize_str("CamelCase don't WE'RE 12345")
    assert [w for w, _ in split] == ["Camel", "Case", "Ġdon't", "ĠWE'RE", "Ġ", "123", "45"]

    trained = Tokenizer(models.BPE())
    trained.pre_tokenizer = pre_tokenizers.Sequence([  # as Phi-4-mini's tokenizer.json has it
        pre_tokenizers.Split(Regex(GPT4O_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    trained.decoder = decoders.ByteLevel()
    corpus = ["I don't know, we're sure it's 123456 or 789012.", "They'll say HE'S 2024."]
    trained.train_from_iterator(corpus * 50, trainers.BpeTrainer(
        vocab_size=300, special_tokens=SPECIALS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    assert trained.token_to_id("Ġdon't") is not None and trained.token_to_id("123") is not None
    path = _write_gguf(tmp_path / "gpt4o.gguf", hf_models["untied"], trained, pre="gpt-4o",
                       with_tensors=False)
    _, ours = read_gguf_metadata(path)
    llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=True)
    for text in [*corpus, "you don't, I'd 9876543 they'VE"]:
        ids = trained.encode(text).ids
        assert ours.encode(text) == ids == llm.tokenize(text.encode(), add_bos=False), text


@pytest.mark.parametrize("pre", ["smollm", "default", None, "gpt-2", "llama-bpe", "smaug-bpe",
                                 "starcoder", "qwen2", "tekken", "gpt-4o"])
def test_tokenization_matches_llama_cpp(pre, vocab_file, llama_cpp):
    path = vocab_file(pre)
    _, tok = read_gguf_metadata(path)
    llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=True)
    for text in TEXTS:
        ids = llm.tokenize(text.encode(), add_bos=False, special=True)
        assert tok.encode(text) == ids, f"{pre}: {text!r}"
        assert tok.decode(ids) == llm.detokenize(ids).decode(), f"{pre}: {text!r}"


# ---- files that must be refused ------------------------------------------------------------


@pytest.mark.parametrize("arch, pre", [("gpt2", "gpt-2"), ("falcon", "falcon")])
def test_non_llama_architecture_is_named(arch, pre, hf_models, bpe, tmp_path):
    """Named even when its tokenizer is one we do not read either (falcon's pre-tokenizer)."""
    path = _write_gguf(tmp_path / f"{arch}.gguf", hf_models["untied"], bpe, arch=arch, pre=pre)
    with pytest.raises(ModelLoadError, match=f"{path}: unsupported GGUF architecture '{arch}'"):
        load_model(path)
    with pytest.raises(ModelLoadError, match=f"'{arch}'"):
        _engine(path)


def test_unsupported_tensor_type_is_refused_by_name(hf_models, bpe, tmp_path):
    """MXFP4 (gpt-oss's experts) is a type we have not checked: refused, naming the tensor,
    the type and the types we read, from the metadata alone: `llmdb models add` took such a
    file, and a load found it after dequantizing every tensor before it."""
    path = _write_gguf(tmp_path / "mxfp4.gguf", hf_models["untied"], bpe,
                       tensor_types={"blk.1.ffn_up.weight": QT.MXFP4})
    for read in (loader.check_model, load_model):
        with pytest.raises(ModelLoadError, match=rf"{path}: tensor blk\.1\.ffn_up\.weight has "
                           r"unsupported type MXFP4 \(supported: .*Q5_0"):
            read(path)


def test_a_vocabulary_longer_than_the_embedding_is_refused(hf_models, bpe, tmp_path):
    """llama.cpp refuses such a file (token_embd.weight has the wrong shape); it loaded, and
    ran until a row's token fell past the embedding's end. Refused from the metadata."""
    path = _write_gguf(tmp_path / "long-vocab.gguf", hf_models["untied"], bpe,
                       extra_tokens=(("<extra>", 4),))
    for read in (loader.check_model, load_model):
        with pytest.raises(ModelLoadError, match=r"long-vocab.gguf: tensor "
                           r"'model.embed_tokens.weight' has shape \[\d+, 64\], but the "
                           r"model's config gives"):
            read(path)


@pytest.mark.parametrize("kind", ["t5", "bert"])
def test_other_tokenizer_models_are_refused(kind, hf_models, bpe, tmp_path):
    """Unigram (T5) and WordPiece vocabularies: named, with the models we read
    (SentencePiece BPE, 'llama': tests/test_gguf_spm.py)."""
    path = _write_gguf(tmp_path / f"{kind}.gguf", hf_models["untied"], bpe, tokenizer_model=kind,
                       pre=None)
    with pytest.raises(ModelLoadError, match=f"tokenizer model '{kind}'.*'gpt2'.*'llama'"):
        load_model(path)


@pytest.mark.parametrize("scaling", [
    lambda w: (w.add_rope_scaling_type(gguf.RopeScalingType.YARN),
               w.add_rope_scaling_factor(4.0)),
    lambda w: (w.add_rope_scaling_type(gguf.RopeScalingType.NONE),
               w.add_rope_scaling_factor(4.0)),
], ids=["yarn", "none-with-a-factor"])
def test_other_rope_scaling_is_refused(scaling, hf_models, bpe, tmp_path):
    """llama.cpp would scale the positions otherwise; running unscaled would be silently
    wrong."""
    path = _write_gguf(tmp_path / "scaled.gguf", hf_models["untied"], bpe, extra=scaling)
    with pytest.raises(ModelLoadError, match="RoPE scaling"):
        load_model(path)


def test_a_bare_scaling_factor_is_linear(hf_models, bpe, tmp_path):
    """llama.cpp reads a factor without a scaling type as linear."""
    path = _write_gguf(tmp_path / "factor.gguf", hf_models["untied"], bpe,
                       extra=lambda w: w.add_rope_scaling_factor(2.0))
    assert load_model(path).config.rope_divisors == (2.0,) * 8


def test_unscaled_rope_metadata_is_accepted(hf_models, bpe, tmp_path):
    def none(w):
        w.add_rope_scaling_type(gguf.RopeScalingType.NONE)
        w.add_rope_scaling_factor(1.0)

    path = _write_gguf(tmp_path / "unscaled.gguf", hf_models["untied"], bpe, extra=none)
    assert load_model(path).config.rope_theta == 50000.0


@torch.inference_mode()
@pytest.mark.parametrize("name", list(VARIANTS))
def test_exported_hf_directory_runs_in_transformers(name, f32_files, tmp_path):
    """The benchmark's peers run our export: transformers must read the same model from it."""
    from safetensors import safe_open

    from llmdb.engine.models.export import export_hf

    loaded = load_model(f32_files[name])
    if len(set(loaded.config.rope_divisors)) > 1:
        with pytest.raises(ValueError, match="per-frequency"):
            export_hf(loaded, tmp_path / "hf")
        return
    out = export_hf(loaded, tmp_path / "hf", dtype=torch.float32)
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        # vLLM wants no lm_head when the embeddings are tied.
        assert ("lm_head.weight" in f.keys()) != loaded.config.tie_embeddings
    model = transformers.AutoModelForCausalLM.from_pretrained(
        out, dtype=torch.float32, attn_implementation="eager").eval()
    engine = _engine(f32_files[name])
    for ids in _sequences(engine.config.vocab_size, seed=3)[:3]:
        err = _max_err(engine.logits(ids), ref_logits(model, ids))
        assert err <= LOGIT_RTOL, f"{name} len {len(ids)}: relative error {err:.3g}"
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    text = "<|im_start|>user\nhello 42<|im_end|>\n"
    assert hf_tok(text, add_special_tokens=False)["input_ids"] == loaded.tokenizer.encode(text)
