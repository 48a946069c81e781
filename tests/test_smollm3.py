"""SmolLM3 (Llama's decoder with some layers taking no RoPE: NoPE) against transformers'
SmolLM3ForCausalLM in fp32, on tiny random models as Hugging Face directories: logits,
greedy tokens, prefills chunked over cached K/V and over a prefix-cache hit, the Triton
path, the hidden cache (K/V re-projected without RoPE in NoPE layers); and as llama.cpp's
smollm3 GGUF files, against transformers and llama.cpp."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from llmdb.engine.engine import LLMEngine
from llmdb.engine.models import ModelLoadError, load_model
from llmdb.engine.params import SamplingParams

from .model_builders import _assert_same_greedy as assert_same_greedy
from .model_builders import (
    assert_close,
    assert_greedy_matches,
    edit_config,
    gguf_tensor_name,
    randomize,
    ref_logits,
    reference_models,
)
from .test_gguf_loader import (
    LAYER_NAMES,
    _hf_llama,
    _llama_cpp_logits,
    _permute,
    _rms_err,
    _train_bpe,
    _write_gguf,
)
from .test_gguf_loader import _sequences as _gguf_sequences
from .test_hf_models import BOS, EOS, PAD, VOCAB_SIZE, _save
from .test_hidden_cache import BLOCK, _generate

CONTEXT = 256


def _smollm3(seed: int, **extra):
    cfg = transformers.SmolLM3Config(**{
        "vocab_size": VOCAB_SIZE, "hidden_size": 64, "num_hidden_layers": 8,
        "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
        "max_position_embeddings": CONTEXT, "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "bos_token_id": BOS, "eos_token_id": EOS, "pad_token_id": PAD, **extra})
    torch.manual_seed(seed)
    model = transformers.SmolLM3ForCausalLM(cfg)
    randomize(model, seed)
    return model.eval()


VARIANTS = {
    # SmolLM3-3B's scheme: every fourth layer without RoPE (3 and 7 of 8), GQA, tied.
    "smollm3": dict(),
    # NoPE layers listed (no_rope_layers: 0 = no RoPE), MHA (the hidden cache can run it),
    # untied, Q/K/V and MLP biases.
    "smollm3-list": dict(num_hidden_layers=5, num_key_value_heads=4,
                         no_rope_layers=[0, 1, 1, 0, 1], tie_word_embeddings=False,
                         attention_bias=True, mlp_bias=True),
    # use_sliding_window: transformers slides the NoPE layer (3 of 4) over 16 tokens.
    "smollm3-window": dict(num_hidden_layers=4, use_sliding_window=True, sliding_window=16),
}


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("smollm3")
    dirs = {}
    for seed, (name, extra) in enumerate(VARIANTS.items()):
        dirs[name] = root / name
        _save(_smollm3(seed, **extra), dirs[name], {"bos_token": "<s>", "eos_token": "</s>",
                                                    "add_bos_token": False}, None)
    return dirs


@pytest.fixture(scope="module")
def hf_ref(hf_dirs):
    return reference_models(hf_dirs)


def _engine(path: Path, **kw) -> LLMEngine:
    return LLMEngine(model=str(path), dtype="fp32", kv_cache_bytes=8 << 20, threads=2, **kw)


def _ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB_SIZE) for _ in range(n)]


# ---- Hugging Face directories --------------------------------------------------------------


@pytest.mark.parametrize("name", list(VARIANTS))
def test_config_is_transformers(name, hf_dirs):
    """The NoPE layers and the sliding ones as transformers' attention takes them."""
    cfg = load_model(hf_dirs[name]).config
    hf = transformers.AutoConfig.from_pretrained(hf_dirs[name])
    assert cfg.nope_layers == tuple(i for i, f in enumerate(hf.no_rope_layers) if not f)
    assert cfg.nope_layers  # (each model has some)
    windows = tuple(hf.sliding_window if hf.use_sliding_window and t == "sliding_attention"
                    else 0 for t in hf.layer_types)
    assert cfg.layer_windows == (windows if any(windows) else ())
    assert (cfg.arch, cfg.num_kv_heads, cfg.rope_theta, cfg.tie_embeddings) == (
        "llama", hf.num_key_value_heads, hf.rope_parameters["rope_theta"],
        hf.tie_word_embeddings)


@pytest.mark.parametrize("attention", ["reference", "cpu"])
@pytest.mark.parametrize("name", list(VARIANTS))
def test_logits_match_transformers(name, attention, hf_dirs, hf_ref):
    engine = _engine(hf_dirs[name], attention=attention)
    for n in (1, 9, 53, 240):
        ids = _ids(n, seed=n)
        ref = ref_logits(hf_ref(name), ids)
        assert float(ref.std()) > 0.5, "degenerate model: logits hardly vary"
        assert_close(engine.logits(ids), ref, f"{name}/{attention} len {n}")
    assert engine.pool.num_free == engine.pool.num_blocks, "KV blocks leaked"


@pytest.mark.parametrize("name", list(VARIANTS))
def test_prefill_chunked_over_cached_kv_matches_transformers(name, hf_dirs, hf_ref):
    """A prompt in 24-token steps, whose later chunks attend to the K/V cached before them;
    then a prompt that extends an earlier one: its prefix comes from the prefix cache, the
    rest is prefilled in chunks after it, and every generated token's top log-probabilities
    are transformers'."""
    ref_model = hf_ref(name)
    engine = _engine(hf_dirs[name], max_num_batched_tokens=24)
    ids = _ids(200, seed=3)
    assert_close(engine.logits(ids), ref_logits(ref_model, ids), f"{name} chunked")
    params = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=5)
    prompt = _ids(150, seed=4)
    engine.generate([prompt[:70]], params)
    [res] = engine.generate([prompt], params)
    assert res.usage.cached_tokens == 64  # the first one's full blocks
    logits = ref_logits(ref_model, prompt + res.token_ids)
    assert_same_greedy(ref_model, prompt, logits[len(prompt) - 1:-1].argmax(-1).tolist(),
                       res.token_ids)
    bound = 2e-4 * max(1.0, float(logits.abs().max()))
    for step, (_, top) in enumerate(res.logprobs):
        ref = logits[len(prompt) - 1 + step].log_softmax(-1)
        for token, logprob in top.items():
            assert abs(logprob - float(ref[token])) <= bound, (step, token)
    assert engine.pool.num_free == engine.pool.num_blocks


@pytest.mark.parametrize("name", list(VARIANTS))
def test_greedy_generation_matches_transformers(name, hf_dirs, hf_ref):
    prompts = [_ids(n, seed=7 + n) for n in (1, 6, 21)]
    answers = assert_greedy_matches(_engine(hf_dirs[name]), hf_ref(name), prompts, 10, PAD)
    assert len({t for ref, _ in answers for t in ref}) > 3, "degenerate model: constant output"


@pytest.mark.parametrize("name", list(VARIANTS))
def test_triton_path_matches_transformers(name, hf_dirs, hf_ref):
    """The fused RoPE and K/V-write kernel leaves NoPE layers' Q and K unrotated (Triton's
    interpreter on CPU tensors in CI): transformers' logits, whole and chunked, and the CPU
    path's greedy tokens."""
    pytest.importorskip("triton", reason="triton is not installed")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    engine = _engine(hf_dirs[name], device=device, attention="triton",
                     max_num_batched_tokens=24)
    for n in (9, 40):
        ids = _ids(n, seed=5)
        assert_close(engine.logits(ids), ref_logits(hf_ref(name), ids), f"{name}/triton")
    prompts = [_ids(n, seed=6) for n in (1, 9)]
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    assert ([r.token_ids for r in engine.generate(prompts, params)]
            == [r.token_ids for r in _engine(hf_dirs[name]).generate(prompts, params)])
    assert engine.pool.num_free == engine.pool.num_blocks


@pytest.mark.parametrize("attention", ["cpu", "triton"])
def test_hidden_cache_reprojects_nope_layers_unrotated(attention, hf_dirs):
    """The MHA model may keep hidden states instead of K/V (Apt-Serve): K re-projected from
    them is rotated in RoPE layers only, so hidden-cache requests (alone, mixed with KV
    ones, projected back to KV mid-generation) generate the KV cache's tokens."""
    if attention == "triton":
        pytest.importorskip("triton", reason="triton is not installed")
    device = "cuda" if torch.cuda.is_available() and attention == "triton" else "cpu"
    engine = LLMEngine(str(hf_dirs["smollm3-list"]), device=device, dtype="fp32",
                       kv_cache_bytes=1 << 21, block_size=BLOCK, attention=attention,
                       cuda_graphs=False)
    assert engine.describe()["hidden_cache"]["enabled"]
    prompts = [_ids(n, seed=n) for n in (3, 17)]
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    want = _generate(engine, prompts, ["kv"] * 2, params=params)
    assert _generate(engine, prompts, ["hidden", "kv"], params=params) == want
    assert _generate(engine, prompts, ["hidden"] * 2, switch={2: ["kv"] * 2}, params=params,
                     project=True) == want


def test_a_config_without_rope_theta_takes_smollm3s_default(hf_dirs, tmp_path):
    """transformers' SmolLM3Config default base, 2e6, not Llama's 10,000."""
    d = edit_config(hf_dirs["smollm3"], tmp_path / "no-theta",
                     lambda cfg: cfg.pop("rope_parameters"))
    hf = transformers.AutoConfig.from_pretrained(d)
    assert load_model(d).config.rope_theta == hf.rope_parameters["rope_theta"] == 2e6


def test_short_no_rope_layers_is_refused_by_name(hf_dirs, tmp_path):
    d = edit_config(hf_dirs["smollm3"], tmp_path / "short",
                     lambda cfg: cfg.update(no_rope_layers=[1, 1, 1, 0]))
    with pytest.raises(ModelLoadError, match="no_rope_layers has 4 flags for 8 layers"):
        load_model(d)


# ---- GGUF: llama.cpp's smollm3 -------------------------------------------------------------


@pytest.fixture(scope="module")
def gguf_model():
    """A SmolLM3 whose NoPE layers are llama.cpp's (every fourth: 3 and 7 of 8), GQA, tied,
    in the vocabulary of tests/test_gguf_loader.py."""
    return _hf_llama(_train_bpe().get_vocab_size(), hidden=64, heads=4, kv_heads=2, ffn=128,
                     layers=8, tie=True, theta=10000.0, eps=1e-5, seed=31, family="SmolLM3",
                     pad_token_id=None)


def _smollm3_tensors(model) -> dict[str, np.ndarray]:
    """As llama.cpp's converter writes SmolLM3 (a LlamaModel there): Q/K rows permuted, no
    output tensor when tied."""
    cfg, out = model.config, {}
    for name, p in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        gname, w = gguf_tensor_name(name, LAYER_NAMES), p.detach().float().numpy().copy()
        if gname.endswith(".attn_q.weight"):
            w = _permute(w, cfg.num_attention_heads)
        elif gname.endswith(".attn_k.weight"):
            w = _permute(w, cfg.num_key_value_heads)
        out[gname] = w
    return out


@pytest.fixture(scope="module")
def gguf_file(gguf_model, tmp_path_factory) -> Path:
    def tensors(w) -> None:
        for name, arr in _smollm3_tensors(gguf_model).items():
            w.add_tensor(name, arr)

    path = tmp_path_factory.mktemp("smollm3-gguf") / "smollm3.gguf"
    return _write_gguf(path, gguf_model, _train_bpe(), arch="smollm3", with_tensors=False,
                       extra=tensors)


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMDB_CACHE_DIR", str(tmp_path / "cache"))  # (dequantized GGUFs)


def test_gguf_logits_match_transformers(gguf_model, gguf_file):
    engine = _engine(gguf_file)
    assert engine.config.nope_layers == (3, 7)
    for ids in _gguf_sequences(engine.config.vocab_size, seed=2):
        assert_close(engine.logits(ids), ref_logits(gguf_model, ids), f"GGUF len {len(ids)}")


def test_llama_cpp_agrees(gguf_file):
    """llama.cpp runs the same file (its smollm3: unpermuted Q/K, no RoPE in every fourth
    layer) to the same logits."""
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    ids = _gguf_sequences(400, seed=12)[3]
    err = _rms_err(_engine(gguf_file).logits(ids), _llama_cpp_logits(llama_cpp, gguf_file, ids))
    assert err <= 1e-5, f"{err:.3g} from llama.cpp"


@torch.inference_mode()
@pytest.mark.parametrize("source", ["gguf", "smollm3-list", "smollm3-window"])
def test_exported_smollm3_runs_in_transformers(source, gguf_file, hf_dirs, tmp_path):
    """export_hf writes a SmolLM3 config (its NoPE layers, other than the default ones in
    smollm3-list, its biases, the window of smollm3-window's sliding layer): transformers
    runs the exported weights as we run the model (53 tokens: over the 16-token window)."""
    from llmdb.engine.models.export import export_hf

    path = gguf_file if source == "gguf" else hf_dirs[source]
    loaded = load_model(path)
    assert load_model(path).config == loaded.config  # (again: a GGUF's from the cache)
    out = export_hf(loaded, tmp_path / "hf", dtype=torch.float32)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        out, dtype=torch.float32, attn_implementation="eager").eval()
    assert type(model).__name__ == "SmolLM3ForCausalLM"
    engine = _engine(path)
    for ids in _gguf_sequences(engine.config.vocab_size, seed=3)[:3]:
        assert_close(engine.logits(ids), ref_logits(model, ids), f"{source} export")
