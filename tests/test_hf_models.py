"""The HF-directory loaders (Llama, OPT) against `transformers` on tiny random models.

Each model is built here with a fixed seed, saved with `save_pretrained` as safetensors next to
a `tokenizers` tokenizer made in code (no hub access), then loaded by `LLMEngine` from that
directory. Our teacher-forced logits and greedy tokens must match `transformers` in fp32.
"""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

import pytest
import torch
import transformers  # the reference; a test dependency (pyproject's [test] extra)
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, processors

from llmdb.engine.engine import LLMEngine
from llmdb.engine.models import ModelLoadError, load_model
from llmdb.engine.models.loader import check_model
from llmdb.engine.params import SamplingParams

from .model_builders import (
    WORDS,
    assert_close,
    assert_greedy_matches,
    assert_logits_match,
    assert_triton_path_matches,
    cached_engines,
    copy_dir,
    edit_config,
    randomize,
    ref_logits,
    reference_models,
    word_level_tokenizer,
)

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIALS = ["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
PAD, BOS, EOS = 0, 1, 2
VOCAB = {t: i for i, t in enumerate(SPECIALS + sorted(set(WORDS) - {""}))}
VOCAB_SIZE = len(VOCAB)


# ---- building tiny models ------------------------------------------------------------------


def _tokenizer(prepend: str | None) -> Tokenizer:
    """Word-level; `prepend` is the token the tokenizer itself puts first (as HF's do)."""
    tok = word_level_tokenizer(VOCAB, SPECIALS, unk="<pad>")
    if prepend:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{prepend} $A", pair=f"{prepend} $A {prepend} $B",
            special_tokens=[(prepend, VOCAB[prepend])],
        )
    return tok


def _save(model, path: Path, tok_cfg: dict, prepend: str | None) -> None:
    model.save_pretrained(path, safe_serialization=True)
    _tokenizer(prepend).save(str(path / "tokenizer.json"))
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": CHATML,
           "pad_token": "<pad>", "model_max_length": 256, **tok_cfg}
    (path / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))


def _llama(tie: bool, rope_theta: float, eps: float, scaling: dict | None = None,
           family: str = "Llama", **extra) -> torch.nn.Module:
    """A tiny Llama-family model (family: Llama, Mistral, Qwen2 or Qwen3), with RoPE
    scaling; extra: more config (head_dim)."""
    rope = {"rope_type": "default", "rope_theta": rope_theta, **(scaling or {})}
    cfg = getattr(transformers, f"{family}Config")(
        vocab_size=VOCAB_SIZE, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=128, max_position_embeddings=256,
        rms_norm_eps=eps, rope_parameters=rope, tie_word_embeddings=tie,
        bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD, **extra,
    )
    return getattr(transformers, f"{family}ForCausalLM")(cfg)


# Llama 3.1's scheme at a tiny scale: with head_dim 16 the wavelengths run from 6 to ~20,000
# positions, so over 256 positions some frequencies are kept (wavelength < 64 / 4), some
# stretched 8x (> 64) and some blended.
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


def _opt(layer_norm_before: bool, proj_dim: int) -> torch.nn.Module:
    cfg = transformers.OPTConfig(
        vocab_size=VOCAB_SIZE, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
        ffn_dim=128, max_position_embeddings=256, do_layer_norm_before=layer_norm_before,
        word_embed_proj_dim=proj_dim, bos_token_id=EOS, eos_token_id=EOS, pad_token_id=PAD,
        dropout=0.0, attention_dropout=0.0,
    )
    return transformers.OPTForCausalLM(cfg)


# name -> (builder, tokenizer_config additions, token the tokenizer prepends)
VARIANTS = {
    # Untied head, a non-default RoPE base and a large RMSNorm eps: a loader that drops
    # either falls back to a default that changes the logits well past the tolerance.
    "llama-gqa": (lambda: _llama(tie=False, rope_theta=50000.0, eps=1e-2),
                  {"bos_token": "<s>", "eos_token": "<|im_end|>"}, "<s>"),
    "llama-gqa-tied": (lambda: _llama(tie=True, rope_theta=10000.0, eps=1e-5),
                       {"bos_token": "<s>", "eos_token": "<|im_end|>", "add_bos_token": False},
                       None),
    "opt": (lambda: _opt(layer_norm_before=True, proj_dim=64),
            {"bos_token": "</s>", "eos_token": "</s>"}, "</s>"),
    # OPT-350m's shape: post-LN layers, no final norm, project_in/out around the stack.
    "opt-350m-style": (lambda: _opt(layer_norm_before=False, proj_dim=32),
                       {"bos_token": "</s>", "eos_token": "</s>"}, "</s>"),
    # Llama 3.1-3.3's RoPE scaling; linear scaling (older long-context fine-tunes).
    "llama3-rope": (lambda: _llama(tie=False, rope_theta=10000.0, eps=1e-5, scaling=LLAMA3_ROPE),
                    {"bos_token": "<s>", "eos_token": "<|im_end|>"}, "<s>"),
    "llama-linear-rope": (lambda: _llama(tie=False, rope_theta=10000.0, eps=1e-5,
                                         scaling={"rope_type": "linear", "factor": 4.0}),
                          {"bos_token": "<s>", "eos_token": "<|im_end|>"}, "<s>"),
    # Qwen2 (Qwen2.5): Llama's decoder with biases on Q, K and V; no BOS.
    "qwen2": (lambda: _llama(tie=False, rope_theta=1000000.0, eps=1e-6, family="Qwen2"),
              {"bos_token": None, "eos_token": "<|im_end|>"}, None),
    "mistral": (lambda: _llama(tie=False, rope_theta=1000000.0, eps=1e-5, family="Mistral"),
                {"bos_token": "<s>", "eos_token": "</s>"}, "<s>"),
    # Qwen3: an RMSNorm over each Q and K head before RoPE, no biases, and a head_dim of its
    # own (4 heads of 32 from a hidden size of 64, as Qwen3-0.6B has 16 of 128 from 1,024).
    "qwen3": (lambda: _llama(tie=True, rope_theta=1000000.0, eps=1e-6, family="Qwen3",
                             head_dim=32),
              {"bos_token": None, "eos_token": "<|im_end|>"}, None),
    # Sliding-window attention (Mistral 7B v0.1's, at a tiny scale): every layer sees its
    # last 8 positions, and the test sequences run to 30 times that.
    "mistral-window": (lambda: _llama(tie=False, rope_theta=10000.0, eps=1e-5,
                                      family="Mistral", sliding_window=8),
                       {"bos_token": "<s>", "eos_token": "</s>"}, "<s>"),
    # Qwen2's: only the layers from max_window_layers on slide, here the last two of four.
    "qwen2-window": (lambda: _llama(tie=False, rope_theta=1000000.0, eps=1e-6, family="Qwen2",
                                    use_sliding_window=True, sliding_window=5,
                                    max_window_layers=2),
                     {"bos_token": None, "eos_token": "<|im_end|>"}, None),
}
WINDOWED = ["mistral-window", "qwen2-window"]


@pytest.fixture(scope="session")
def hf_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf_models")
    out = {}
    for seed, (name, (build, tok_cfg, prepend)) in enumerate(VARIANTS.items()):
        torch.manual_seed(seed)
        model = build()
        randomize(model, seed)
        _save(model, root / name, tok_cfg, prepend)
        out[name] = root / name
    return out


@pytest.fixture(scope="session")
def hf_ref(hf_dirs):
    """name -> the `transformers` model reloaded from the saved directory (eager, fp32)."""
    return reference_models(hf_dirs)


@pytest.fixture(scope="session")
def engines(hf_dirs):
    """(name, attention, **options) -> an engine on the saved directory."""
    return cached_engines(hf_dirs, kv_cache_bytes=4 << 20)


def _sequences(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    # 1 token; under one block; several 16-token blocks; most of the 256 positions.
    return [[rng.randrange(VOCAB_SIZE) for _ in range(n)] for n in (1, 9, 53, 240)]


# ---- the tests -----------------------------------------------------------------------------


@pytest.mark.parametrize("attention", ["reference", "cpu"])
@pytest.mark.parametrize("name", list(VARIANTS))
def test_logits_match_transformers(name, attention, hf_ref, engines):
    engine = engines(name, attention)
    assert engine.config.vocab_size == VOCAB_SIZE
    assert_logits_match(engine, hf_ref(name), _sequences(seed=len(name)), f"{name}/{attention}")
    assert not engine.has_unfinished
    assert engine.pool.num_free == engine.pool.num_blocks, "KV blocks leaked"


@pytest.mark.parametrize("name", list(VARIANTS))
def test_chunked_prefill_logits_match_transformers(name, hf_ref, engines):
    """Prompts split over steps: later chunks attend to cached K/V at offset positions."""
    engine = engines(name, "cpu", max_num_batched_tokens=24)
    ids = _sequences(seed=3)[-1]
    assert_close(engine.logits(ids), ref_logits(hf_ref(name), ids), f"{name} chunked")


@pytest.mark.parametrize("name", ["llama-gqa", "opt", "qwen2", "llama3-rope", "qwen3", *WINDOWED])
def test_triton_path_matches_transformers(name, hf_dirs, hf_ref):
    """The GPU kernels' forward (RoPE fused with the K/V write, residual-add RMSNorm, one
    attention launch per mixed step), run on CPU tensors by Triton's interpreter in CI:
    whole and chunked prompts give transformers' logits, and greedy tokens the CPU path's."""
    prompts = [ids[:n] for ids, n in zip(_sequences(seed=6), (1, 9, 30), strict=False)]
    assert_triton_path_matches(hf_dirs[name], hf_ref(name), _sequences(seed=5)[:3], prompts,
                               max_tokens=4, kv_cache_bytes=4 << 20, what=f"{name}/triton")


@pytest.mark.parametrize("attention", ["reference", "cpu"])
@pytest.mark.parametrize("name", list(VARIANTS))
def test_greedy_generation_matches_transformers(name, attention, hf_ref, engines):
    rng = random.Random(7)
    prompts = [[rng.randrange(VOCAB_SIZE) for _ in range(n)] for n in (1, 6, 21)]
    n_new = 10
    answers = assert_greedy_matches(engines(name, attention), hf_ref(name), prompts, n_new, PAD)
    for ref, res in answers:
        assert res.error is None and res.finish_reason == "length", res
        assert len(ref) == n_new
    distinct = {t for ref, _ in answers for t in ref}
    assert len(distinct) > 3, "degenerate model: greedy output is nearly constant"


def _transformers_windows(hf_cfg) -> tuple[int, ...]:
    """Each layer's window as transformers' attention applies it: the sliding_window of the
    layers its layer_types calls sliding (all of them where there is no such list, as in
    Mistral's), 0 elsewhere; () where no layer has one shorter than the context (256)."""
    window = getattr(hf_cfg, "sliding_window", None)
    if hf_cfg.model_type == "llama" or not window or window >= 256:  # Llama has no windows
        return ()
    types = getattr(hf_cfg, "layer_types", None) or ["sliding_attention"] * 4
    windows = tuple(window if t == "sliding_attention" else 0 for t in types)
    return windows if any(windows) else ()


@pytest.mark.parametrize("name", list(VARIANTS))
def test_metadata_and_tokenizer(name, hf_dirs):
    """Config numbers, special tokens and chat template as `transformers` reads them."""
    loaded = load_model(hf_dirs[name])
    cfg, ours = loaded.config, loaded.tokenizer
    hf_cfg = transformers.AutoConfig.from_pretrained(hf_dirs[name])
    assert cfg.arch == ("opt" if name.startswith("opt") else "llama")
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_layers, cfg.num_heads) == (
        hf_cfg.vocab_size, hf_cfg.hidden_size, hf_cfg.num_hidden_layers,
        hf_cfg.num_attention_heads)
    assert cfg.tie_embeddings == hf_cfg.tie_word_embeddings
    assert cfg.max_context == 256
    assert cfg.layer_windows == _transformers_windows(hf_cfg)
    assert bool(cfg.layer_windows) == (name in WINDOWED)
    # config.json's EOS, then the tokenizer's where it differs (<|im_end|>: where vLLM and
    # llama.cpp stop).
    assert cfg.eos_token_ids == tuple(dict.fromkeys([EOS, VOCAB[VARIANTS[name][1]["eos_token"]]]))
    if cfg.arch == "llama":
        assert cfg.num_kv_heads == hf_cfg.num_key_value_heads == 2
        assert cfg.norm_eps == hf_cfg.rms_norm_eps
        assert cfg.rope_theta == hf_cfg.rope_parameters["rope_theta"]
    else:
        assert cfg.norm_before == hf_cfg.do_layer_norm_before
    # The class tokenizer_config.json names (AutoTokenizer would take Qwen2's, which builds
    # a byte-level BPE of its own from this word-level vocabulary).
    hf_tok = transformers.PreTrainedTokenizerFast.from_pretrained(hf_dirs[name])
    assert ours.vocab_size == len(hf_tok) == VOCAB_SIZE
    text = "hello world . what is the capital of france ?"
    assert ours.encode(text, add_special=True) == hf_tok(text)["input_ids"]
    messages = [{"role": "system", "content": "be good"},
                {"role": "user", "content": "select count from table"}]
    rendered = ours.apply_chat_template(messages)
    assert rendered == hf_tok.apply_chat_template(messages, tokenize=False,
                                                  add_generation_prompt=True)
    assert rendered.endswith("<|im_start|>assistant\n")
    ids = ours.encode(rendered)
    assert ids[0] == VOCAB["<|im_start|>"] and VOCAB["<|im_end|>"] in ids
    assert ids == hf_tok(rendered, add_special_tokens=False)["input_ids"]


# ---- directories that must be refused ------------------------------------------------------


def test_unsupported_architecture_is_named(hf_dirs, tmp_path):
    d = edit_config(hf_dirs["opt"], tmp_path / "gpt2", lambda cfg: cfg.update(
        architectures=["GPT2LMHeadModel"], model_type="gpt2"))
    with pytest.raises(ModelLoadError, match="GPT2LMHeadModel"):
        LLMEngine(model=str(d), dtype="fp32", kv_cache_bytes=1 << 20)
    with pytest.raises(ModelLoadError, match="unsupported architecture.*GPT2LMHeadModel"):
        load_model(d)


@pytest.mark.parametrize(
    "missing, pattern",
    [("config.json", r"no config\.json"), ("tokenizer.json", r"no tokenizer\.json"),
     ("model.safetensors", r"no \*\.safetensors")],
)
def test_incomplete_directory_is_refused(hf_dirs, tmp_path, missing, pattern):
    d = copy_dir(hf_dirs["llama-gqa-tied"], tmp_path / "incomplete", skip=missing)
    with pytest.raises(ModelLoadError, match=pattern):
        LLMEngine(model=str(d), dtype="fp32", kv_cache_bytes=1 << 20)


def test_a_missing_weight_is_named_with_the_directory(hf_dirs, tmp_path):
    """An untied model saved without its head: the tensor and the directory are named, not
    a bare KeyError."""
    d = copy_dir(hf_dirs["llama-gqa"], tmp_path / "headless")
    weights = load_file(d / "model.safetensors")
    del weights["lm_head.weight"]
    save_file(weights, d / "model.safetensors")
    with pytest.raises(ModelLoadError, match=f"{d}: the weights have no tensor 'lm_head.weight'"):
        LLMEngine(model=str(d), dtype="fp32", kv_cache_bytes=1 << 20)


def test_invalid_config_json_is_refused(hf_dirs, tmp_path):
    d = copy_dir(hf_dirs["llama-gqa-tied"], tmp_path / "badjson")
    (d / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="not valid JSON"):
        load_model(d)


def test_legacy_rope_theta_key_is_read(hf_dirs, tmp_path):
    """transformers < 5 wrote rope_theta at the top level, with no rope_parameters."""
    def legacy(cfg):
        cfg["rope_theta"] = cfg.pop("rope_parameters")["rope_theta"]
        cfg["rope_scaling"] = None

    d = edit_config(hf_dirs["llama-gqa"], tmp_path / "legacy", legacy)
    assert load_model(d).config.rope_theta == 50000.0


def test_legacy_rope_scaling_key_is_read(hf_dirs, tmp_path):
    """transformers < 5 wrote {"type": ..., "factor": ...} as rope_scaling: the same
    frequencies as the rope_parameters transformers 5 writes."""
    def legacy(cfg):
        rope = cfg.pop("rope_parameters")
        cfg["rope_theta"] = rope.pop("rope_theta")
        cfg["rope_scaling"] = {"type": rope.pop("rope_type"), **rope}

    for name in ("llama3-rope", "llama-linear-rope"):
        d = edit_config(hf_dirs[name], tmp_path / name, legacy)
        divisors = load_model(d).config.rope_divisors
        assert divisors == load_model(hf_dirs[name]).config.rope_divisors
        assert len(divisors) == 8 and max(divisors) > 1.0


@pytest.mark.parametrize("where", ["rope_scaling", "rope_parameters"])
@pytest.mark.parametrize("kind", ["yarn", "dynamic"])
def test_other_rope_scaling_is_refused_by_name(hf_dirs, tmp_path, where, kind):
    """Schemes that depend on the sequence's length: running them unscaled would be silently
    wrong. (LongRoPE: tests/test_phi3.py.)"""
    scaled = {"rope_type": kind, "factor": 2.0, "rope_theta": 10000.0}
    d = edit_config(hf_dirs["llama-gqa-tied"], tmp_path / "scaled",
                    lambda cfg: cfg.update({where: scaled}))
    with pytest.raises(ModelLoadError, match=f"rope_scaling '{kind}' is not supported"):
        load_model(d)


@pytest.mark.parametrize("name, edit", [
    ("mistral", {"sliding_window": 128}),
    ("mistral", {"sliding_window": 255}),
    ("mistral", {"sliding_window": 256}),  # not smaller than the context: no window
    ("mistral", {"sliding_window": None}),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 64}),  # (max_window_layers 28)
    ("qwen2", {"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 1,
               "layer_types": None}),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 64,
               "layer_types": ["sliding_attention", "full_attention"] * 2}),
    ("qwen2", {"use_sliding_window": False, "sliding_window": 64, "max_window_layers": 0}),
    ("qwen3", {"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 3,
               "layer_types": None}),
    ("llama-gqa", {"sliding_window": 64}),  # Llama's attention ignores the key
])
def test_sliding_windows_are_read_as_transformers_reads_them(hf_dirs, tmp_path, name, edit):
    d = edit_config(hf_dirs[name], tmp_path / "window", lambda cfg: cfg.update(edit))
    windows = load_model(d).config.layer_windows
    assert windows == _transformers_windows(transformers.AutoConfig.from_pretrained(d))
    assert check_model(d).layer_windows == windows


@torch.inference_mode()
@pytest.mark.parametrize("name", WINDOWED)
def test_exported_windows_run_in_transformers(name, hf_dirs, engines, tmp_path):
    """export_hf writes the sliding windows (it wrote none, so transformers ran the export
    over the whole context): transformers and our loader read the model's windows back, and
    over prompts longer than the window transformers' logits are the engine's."""
    from llmdb.engine.models.export import export_hf

    loaded = load_model(hf_dirs[name])
    out = export_hf(loaded, tmp_path / "hf", dtype=torch.float32)
    exported = transformers.AutoModelForCausalLM.from_pretrained(
        out, dtype=torch.float32, attn_implementation="eager").eval()
    assert _transformers_windows(exported.config) == loaded.config.layer_windows
    assert load_model(out).config.layer_windows == loaded.config.layer_windows
    engine = engines(name, "cpu")
    for ids in _sequences(seed=9)[2:]:  # 53 and 240 tokens, over windows of 8 and 5
        assert_close(engine.logits(ids), ref_logits(exported, ids), f"{name} exported")


@torch.inference_mode()
def test_exported_qwen2_windows_hold_without_layer_types(hf_dirs, engines, tmp_path):
    """Older vLLM reads which of a Qwen2's layers slide from max_window_layers (those from
    it on), not from layer_types; missing, it is 28: no layer of this 4-layer model would
    slide. The export writes it; transformers reads it where layer_types is missing, so
    with layer_types dropped it must slide the engine's layers: its logits over prompts
    longer than the window are the engine's."""
    from llmdb.engine.models.export import export_hf

    loaded = load_model(hf_dirs["qwen2-window"])
    assert loaded.config.layer_windows == (0, 0, 5, 5)
    out = export_hf(loaded, tmp_path / "hf", dtype=torch.float32)
    assert json.loads((out / "config.json").read_text())["max_window_layers"] == 2
    d = edit_config(out, tmp_path / "no-layer-types", lambda cfg: cfg.pop("layer_types"))
    exported = transformers.AutoModelForCausalLM.from_pretrained(
        d, dtype=torch.float32, attn_implementation="eager").eval()
    assert _transformers_windows(exported.config) == loaded.config.layer_windows
    assert load_model(d).config.layer_windows == loaded.config.layer_windows
    engine = engines("qwen2-window", "cpu")
    for ids in _sequences(seed=9)[2:]:  # 53 and 240 tokens, over a window of 5
        assert_close(engine.logits(ids), ref_logits(exported, ids), "qwen2 exported")


@pytest.mark.parametrize("name, windows, message", [
    ("mistral-window", (8, 0, 8, 0),
     r"MistralForCausalLM, whose config slides every.*context in layers \[1, 3\]"),
    ("mistral-window", (8, 4, 8, 4), r"one sliding window, not one a layer \(4, 8\)"),
    ("qwen2-window", (0, 5, 0, 5),
     r"Qwen2ForCausalLM, whose max_window_layers slides .* \(1\) on: .* layers \[2\]"),
])
def test_export_refuses_windows_a_config_cannot_hold(hf_dirs, tmp_path, name, windows,
                                                      message):
    from llmdb.engine.models.export import export_hf

    loaded = load_model(hf_dirs[name])
    loaded.config = dataclasses.replace(loaded.config, layer_windows=windows)
    with pytest.raises(ValueError, match=message):
        export_hf(loaded, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()  # refused before writing


def test_unknown_layer_type_is_refused_by_name(hf_dirs, tmp_path):
    types = ["sliding_attention", "chunked_attention", "full_attention", "full_attention"]
    d = edit_config(hf_dirs["qwen2"], tmp_path / "chunked", lambda cfg: cfg.update(
        use_sliding_window=True, sliding_window=64, layer_types=types))
    with pytest.raises(ModelLoadError, match="layer type 'chunked_attention'"):
        load_model(d)


@pytest.mark.parametrize("name", WINDOWED)
def test_long_generation_beyond_the_window_matches_transformers(name, hf_ref, engines):
    """Greedy decoding far past the window: by the end every query's window lies wholly in
    generated tokens, at positions whose blocks the window left long ago."""
    ref_model, engine = hf_ref(name), engines(name, "cpu")
    assert engine.config.layer_windows
    rng = random.Random(11)
    prompt = [rng.randrange(5, VOCAB_SIZE) for _ in range(30)]
    [(ref, _)] = assert_greedy_matches(engine, ref_model, [prompt], 40, PAD)
    assert len(set(ref)) > 3, "degenerate model: greedy output is nearly constant"


def test_generation_stops_at_the_context_length(engines):
    """A request that reaches the model's context finishes with reason `length`."""
    engine = engines("llama-gqa", "cpu")
    ctx = engine.config.max_context
    prompt = [5 + i % 20 for i in range(ctx - 10)]
    r = engine.generate([prompt], SamplingParams(max_tokens=50, ignore_eos=True))[0]
    assert r.finish_reason == "length"
    assert len(prompt) + len(r.token_ids) == ctx  # prompt plus output fill the context
    assert engine.pool.num_free == engine.pool.num_blocks


def test_attention_softcap_reaches_every_kernel_set(hf_dirs):
    """attn_softcap (Gemma 2's; no architecture here has one) goes to every layer's attention
    call: a small cap changes the logits, the same way with the C++ kernels, the reference
    and the Triton path (with a window too)."""
    ids = _sequences(seed=13)[2]
    logits = {}
    for attention in ("cpu", "reference", "triton"):
        engine = LLMEngine(model=str(hf_dirs["qwen2-window"]), dtype="fp32", threads=2,
                           kv_cache_bytes=4 << 20, attention=attention)
        model = engine.model
        uncapped = engine.logits(ids)
        model.config = dataclasses.replace(model.config, attn_softcap=0.5)
        logits[attention] = engine.logits(ids)
        assert float((logits[attention] - uncapped).abs().max()) > 0.1
    assert_close(logits["cpu"], logits["reference"], "cpu vs reference")
    assert_close(logits["triton"], logits["reference"], "triton vs reference")
