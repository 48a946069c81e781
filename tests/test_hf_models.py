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
from tokenizers import Tokenizer, models, pre_tokenizers, processors

from llmdb.engine.engine import LLMEngine
from llmdb.engine.models import ModelLoadError, load_model
from llmdb.engine.models.loader import check_model
from llmdb.engine.params import SamplingParams

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIALS = ["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
PAD, BOS, EOS = 0, 1, 2
WORDS = (
    "the a an of to in is it and or not on at by for with from as be this that what which who "
    "how why when where sql table row column query select count sum avg join group order limit "
    "database index tree page cache model token user system assistant hello world good morning "
    "paris france capital blue sky prime number list python reverse haiku review battery day "
    "one two three four five six seven eight nine ten . , ? ! : ' \n"
).split(" ")
VOCAB = {t: i for i, t in enumerate(SPECIALS + sorted(set(WORDS) - {""}))}
VOCAB_SIZE = len(VOCAB)
LOGIT_RTOL = 1e-4  # max |ours - transformers| relative to the reference's max |logit|
NEAR_TIE = 1e-4


# ---- building tiny models ------------------------------------------------------------------


def _tokenizer(prepend: str | None) -> Tokenizer:
    """Word-level; `prepend` is the token the tokenizer itself puts first (as HF's do)."""
    tok = Tokenizer(models.WordLevel(VOCAB, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(SPECIALS)
    if prepend:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{prepend} $A", pair=f"{prepend} $A {prepend} $B",
            special_tokens=[(prepend, VOCAB[prepend])],
        )
    return tok


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights far from the defaults (norms of 1, biases of 0) so that a swapped or dropped
    tensor shows, and logits spread enough that greedy decoding is not all ties."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if "norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.3 * noise)
            elif name.endswith("bias"):
                p.copy_(0.1 * noise)
            elif "embed" in name:
                p.copy_(0.5 * noise)
            else:
                p.copy_(noise / p.shape[-1] ** 0.5)


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
        _randomize(model, seed)
        _save(model, root / name, tok_cfg, prepend)
        out[name] = root / name
    return out


@pytest.fixture(scope="session")
def hf_ref(hf_dirs):
    """name -> the `transformers` model reloaded from the saved directory (eager, fp32)."""
    cache: dict[str, torch.nn.Module] = {}

    def get(name: str):
        if name not in cache:
            m = transformers.AutoModelForCausalLM.from_pretrained(
                hf_dirs[name], dtype=torch.float32, attn_implementation="eager"
            ).eval()
            m.generation_config.eos_token_id = None  # generate the full length (ignore_eos)
            cache[name] = m
        return cache[name]

    return get


@pytest.fixture(scope="session")
def engines(hf_dirs):
    cache: dict[tuple[str, str], LLMEngine] = {}

    def get(name: str, attention: str) -> LLMEngine:
        if (name, attention) not in cache:
            cache[name, attention] = LLMEngine(
                model=str(hf_dirs[name]), dtype="fp32", kv_cache_bytes=4 << 20,
                attention=attention, threads=2,
            )
        return cache[name, attention]

    return get


def _sequences(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    # 1 token; under one block; several 16-token blocks; most of the 256 positions.
    return [[rng.randrange(VOCAB_SIZE) for _ in range(n)] for n in (1, 9, 53, 240)]


@torch.inference_mode()
def _ref_logits(model, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([ids])).logits[0].float()


def _assert_close(ours: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    assert ours.shape == ref.shape, f"{what}: shape {tuple(ours.shape)} vs {tuple(ref.shape)}"
    scale = max(1.0, float(ref.abs().max()))
    diff = float((ours - ref).abs().max())
    assert diff <= LOGIT_RTOL * scale, f"{what}: max |diff| {diff:.3g} at logit scale {scale:.3g}"


# ---- the tests -----------------------------------------------------------------------------


@pytest.mark.parametrize("attention", ["reference", "cpu"])
@pytest.mark.parametrize("name", list(VARIANTS))
def test_logits_match_transformers(name, attention, hf_ref, engines):
    ref_model, engine = hf_ref(name), engines(name, attention)
    assert engine.config.vocab_size == VOCAB_SIZE
    for ids in _sequences(seed=len(name)):
        ref = _ref_logits(ref_model, ids)
        # A model whose logits hardly vary would make this test vacuous.
        assert float(ref.std()) > 0.5
        _assert_close(engine.logits(ids), ref, f"{name}/{attention} len {len(ids)}")
    assert not engine.has_unfinished
    assert engine.pool.num_free == engine.pool.num_blocks, "KV blocks leaked"


@pytest.mark.parametrize("name", list(VARIANTS))
def test_chunked_prefill_logits_match_transformers(name, hf_dirs, hf_ref):
    """Prompts split over steps: later chunks attend to cached K/V at offset positions."""
    engine = LLMEngine(model=str(hf_dirs[name]), dtype="fp32", kv_cache_bytes=4 << 20,
                       attention="cpu", threads=2, max_num_batched_tokens=24)
    ids = _sequences(seed=3)[-1]
    _assert_close(engine.logits(ids), _ref_logits(hf_ref(name), ids), f"{name} chunked")


@pytest.mark.parametrize("name", ["llama-gqa", "opt", "qwen2", "llama3-rope", "qwen3", *WINDOWED])
def test_triton_path_matches_transformers(name, hf_dirs, hf_ref):
    """The GPU kernels' forward (RoPE fused with the K/V write, residual-add RMSNorm, one
    attention launch per mixed step), run on CPU tensors by Triton's interpreter in CI:
    whole and chunked prompts give transformers' logits, and greedy tokens the CPU path's."""
    pytest.importorskip("triton", reason="triton is not installed")
    # Compiled on a GPU; in the interpreter on CPU tensors elsewhere (conftest).
    device = "cuda" if torch.cuda.is_available() else "cpu"
    engine = LLMEngine(model=str(hf_dirs[name]), device=device, attention="triton",
                       dtype="fp32", kv_cache_bytes=4 << 20, threads=2,
                       max_num_batched_tokens=24)
    ref_model = hf_ref(name)
    for ids in _sequences(seed=5)[:3]:
        _assert_close(engine.logits(ids), _ref_logits(ref_model, ids), f"{name}/triton")
    prompts = [ids[:n] for ids, n in zip(_sequences(seed=6), (1, 9, 40), strict=False)]
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    cpu = LLMEngine(model=str(hf_dirs[name]), dtype="fp32", kv_cache_bytes=4 << 20, threads=2)
    assert ([r.token_ids for r in engine.generate(prompts, params)]
            == [r.token_ids for r in cpu.generate(prompts, params)])
    assert engine.pool.num_free == engine.pool.num_blocks


def _assert_same_greedy(ref_model, prompt: list[int], ref: list[int], got: list[int]) -> None:
    """Identical, or at the first difference a near-tie in the reference's logits."""
    assert len(got) == len(ref), f"got {len(got)} tokens, reference {len(ref)}"
    i = next((k for k, (a, b) in enumerate(zip(ref, got, strict=True)) if a != b), None)
    if i is None:
        return
    top2 = _ref_logits(ref_model, prompt + ref[:i])[-1].topk(2).values
    margin = float(top2[0] - top2[1])
    assert margin < NEAR_TIE, (
        f"greedy tokens differ at step {i}: reference {ref[i:]} ours {got[i:]}, "
        f"reference top-2 margin {margin:.3g} is not a near-tie"
    )


@pytest.mark.parametrize("attention", ["reference", "cpu"])
@pytest.mark.parametrize("name", list(VARIANTS))
def test_greedy_generation_matches_transformers(name, attention, hf_ref, engines):
    ref_model, engine = hf_ref(name), engines(name, attention)
    rng = random.Random(7)
    prompts = [[rng.randrange(VOCAB_SIZE) for _ in range(n)] for n in (1, 6, 21)]
    n_new = 10
    # All prompts in one engine call: decodes of different lengths batch together.
    results = engine.generate(prompts, SamplingParams(max_tokens=n_new, ignore_eos=True))
    distinct = set()
    for prompt, res in zip(prompts, results, strict=True):
        assert res.error is None and res.finish_reason == "length", res
        with torch.inference_mode():
            out = ref_model.generate(
                torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=n_new, do_sample=False, pad_token_id=PAD,
            )
        ref = out[0, len(prompt):].tolist()
        assert len(ref) == n_new
        distinct.update(ref)
        _assert_same_greedy(ref_model, prompt, ref, res.token_ids)
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
    assert cfg.eos_token_ids == (EOS,)
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


def _copy_dir(src: Path, dst: Path, skip: str | None = None) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        if f.name != skip:
            (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_unsupported_architecture_is_named(hf_dirs, tmp_path):
    d = _edit_config(hf_dirs["opt"], tmp_path / "gpt2", lambda cfg: cfg.update(
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
    d = _copy_dir(hf_dirs["llama-gqa-tied"], tmp_path / "incomplete", skip=missing)
    with pytest.raises(ModelLoadError, match=pattern):
        LLMEngine(model=str(d), dtype="fp32", kv_cache_bytes=1 << 20)


def test_invalid_config_json_is_refused(hf_dirs, tmp_path):
    d = _copy_dir(hf_dirs["llama-gqa-tied"], tmp_path / "badjson")
    (d / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="not valid JSON"):
        load_model(d)


def _edit_config(src: Path, dst: Path, edit) -> Path:
    d = _copy_dir(src, dst)
    cfg = json.loads((d / "config.json").read_text())
    edit(cfg)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def test_legacy_rope_theta_key_is_read(hf_dirs, tmp_path):
    """transformers < 5 wrote rope_theta at the top level, with no rope_parameters."""
    def legacy(cfg):
        cfg["rope_theta"] = cfg.pop("rope_parameters")["rope_theta"]
        cfg["rope_scaling"] = None

    d = _edit_config(hf_dirs["llama-gqa"], tmp_path / "legacy", legacy)
    assert load_model(d).config.rope_theta == 50000.0


def test_legacy_rope_scaling_key_is_read(hf_dirs, tmp_path):
    """transformers < 5 wrote {"type": ..., "factor": ...} as rope_scaling: the same
    frequencies as the rope_parameters transformers 5 writes."""
    def legacy(cfg):
        rope = cfg.pop("rope_parameters")
        cfg["rope_theta"] = rope.pop("rope_theta")
        cfg["rope_scaling"] = {"type": rope.pop("rope_type"), **rope}

    for name in ("llama3-rope", "llama-linear-rope"):
        d = _edit_config(hf_dirs[name], tmp_path / name, legacy)
        divisors = load_model(d).config.rope_divisors
        assert divisors == load_model(hf_dirs[name]).config.rope_divisors
        assert len(divisors) == 8 and max(divisors) > 1.0


@pytest.mark.parametrize("where", ["rope_scaling", "rope_parameters"])
@pytest.mark.parametrize("kind", ["yarn", "dynamic"])
def test_other_rope_scaling_is_refused_by_name(hf_dirs, tmp_path, where, kind):
    """Schemes that depend on the sequence's length: running them unscaled would be silently
    wrong. (LongRoPE: tests/test_phi3.py.)"""
    scaled = {"rope_type": kind, "factor": 2.0, "rope_theta": 10000.0}
    d = _edit_config(hf_dirs["llama-gqa-tied"], tmp_path / "scaled",
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
    d = _edit_config(hf_dirs[name], tmp_path / "window", lambda cfg: cfg.update(edit))
    windows = load_model(d).config.layer_windows
    assert windows == _transformers_windows(transformers.AutoConfig.from_pretrained(d))
    assert check_model(d).layer_windows == windows


def test_unknown_layer_type_is_refused_by_name(hf_dirs, tmp_path):
    types = ["sliding_attention", "chunked_attention", "full_attention", "full_attention"]
    d = _edit_config(hf_dirs["qwen2"], tmp_path / "chunked", lambda cfg: cfg.update(
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
    n_new = 40
    with torch.inference_mode():
        out = ref_model.generate(torch.tensor([prompt]), max_new_tokens=n_new, do_sample=False,
                                 attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                 pad_token_id=PAD)
    ref = out[0, len(prompt):].tolist()
    got = engine.generate([prompt], SamplingParams(max_tokens=n_new, ignore_eos=True))[0]
    _assert_same_greedy(ref_model, prompt, ref, got.token_ids)
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
    _assert_close(logits["cpu"], logits["reference"], "cpu vs reference")
    _assert_close(logits["triton"], logits["reference"], "triton vs reference")
