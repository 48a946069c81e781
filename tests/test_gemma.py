"""Gemma 2 and Gemma 3 (text) against transformers (Hugging Face directories) and llama.cpp
(GGUF files), on tiny random models in fp32.

The models are built here with a fixed seed. Their settings make every Gemma-specific piece
show in the logits: norms scaled by 1 + w (the weights are far from 0), the embedding scale,
a query_pre_attn_scalar that is not head_dim, a final logit cap small enough to bend the
logits, Gemma 3's two RoPEs (local base 500 against a linearly scaled global one of 10,000),
its per-head Q/K norms, and one model with Gemma's real head_dim of 256. The sliding windows
are as long as the context, so they change nothing (windows shorter than the sequences are
tested once the kernels take them).
"""

from __future__ import annotations

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
from tokenizers import Tokenizer, models, pre_tokenizers

from llmdb.engine.engine import LLMEngine
from llmdb.engine.models import ModelLoadError, load_model
from llmdb.engine.params import SamplingParams

from .test_gguf_loader import CONTEXT as GGUF_CONTEXT
from .test_gguf_loader import _encode_tensor, _llama_cpp_logits, _rms_err, _train_bpe
from .test_gguf_loader import _sequences as _gguf_sequences
from .test_gguf_loader import _vocab as _bpe_lists
from .test_hf_models import WORDS, _assert_same_greedy, _randomize

# Gemma's special tokens at Gemma's ids (pad 0, eos 1, bos 2), then its turn markers.
SPECIALS = ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"]
PAD, EOS, BOS, SOT, EOT = range(5)
VOCAB = {t: i for i, t in enumerate(SPECIALS + sorted(set(WORDS) - {"", "\n"}))}
VOCAB_SIZE = len(VOCAB)
CONTEXT = 256
LOGIT_RTOL = 1e-4  # max |ours - transformers| relative to the reference's max |logit|
# Gemma's chat format (its templates also fold a system turn into the first user turn).
TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)


def _config(family: str, **extra):
    common = dict(
        vocab_size=VOCAB_SIZE, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, intermediate_size=128,
        max_position_embeddings=CONTEXT, sliding_window=CONTEXT, rms_norm_eps=1e-6,
        bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD, attn_logit_softcapping=None,
    )
    return getattr(transformers, f"{family}Config")(**{**common, **extra})


# name -> (transformers class, config)
VARIANTS = {
    # Untied (tests the lm_head), alternating sliding and global layers, logits capped at 5.
    "gemma2": (transformers.Gemma2ForCausalLM, lambda: _config(
        "Gemma2", query_pre_attn_scalar=24, final_logit_softcapping=5.0,
        tie_word_embeddings=False)),
    # Q/K norms, a local RoPE and a linearly scaled global one (Gemma 3 4B's scheme), tied.
    "gemma3": (transformers.Gemma3ForCausalLM, lambda: _config(
        "Gemma3Text", query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "full_attention", "sliding_attention",
                     "sliding_attention"],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 500.0},
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 10000.0}})),
    # Gemma 3 1B's head shape: heads of 256, one K/V head for the query heads; Gemma 3's
    # defaults for everything else (scale 256 ** -0.5, RoPE bases 10,000 and 1e6).
    "gemma3-hd256": (transformers.Gemma3ForCausalLM, lambda: _config(
        "Gemma3Text", num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        head_dim=256, layer_types=["sliding_attention", "full_attention"])),
}


def _tokenizer() -> Tokenizer:
    tok = Tokenizer(models.WordLevel(VOCAB, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(SPECIALS)
    return tok


def _save(model, path: Path, eos: list[int]) -> Path:
    model.save_pretrained(path, safe_serialization=True)
    _tokenizer().save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": TEMPLATE,
        "bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>",
        "add_bos_token": True, "model_max_length": CONTEXT}))
    # As Gemma's instruction-tuned models ship it: the end of a turn ends generation.
    (path / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": BOS, "eos_token_id": eos, "pad_token_id": PAD}))
    return path


def _build(name: str, seed: int):
    cls, config = VARIANTS[name]
    torch.manual_seed(seed)
    return _randomized(cls(config()), seed)


def _randomized(model, seed: int):
    _randomize(model, seed)
    with torch.no_grad():
        # Gemma multiplies its embeddings by sqrt(hidden_size): divided by it here, they
        # enter at the size of the layers' normalized outputs, so that the layers matter and
        # a tied model does not just repeat its input token.
        model.get_input_embeddings().weight.div_(model.config.hidden_size**0.5)
    return model.eval()


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gemma")
    return {name: _save(_build(name, seed), root / name, [EOS, EOT])
            for seed, name in enumerate(VARIANTS)}


@pytest.fixture(scope="module")
def hf_ref(hf_dirs):
    """name -> the transformers model reloaded from its directory (eager attention, fp32)."""
    cache: dict[str, torch.nn.Module] = {}

    def get(name: str):
        if name not in cache:
            m = transformers.AutoModelForCausalLM.from_pretrained(
                hf_dirs[name], dtype=torch.float32, attn_implementation="eager").eval()
            m.generation_config.eos_token_id = None  # generate the full length
            cache[name] = m
        return cache[name]

    return get


@pytest.fixture(scope="module")
def engines(hf_dirs):
    cache: dict[tuple[str, str], LLMEngine] = {}

    def get(name: str, attention: str) -> LLMEngine:
        if (name, attention) not in cache:
            cache[name, attention] = LLMEngine(model=str(hf_dirs[name]), dtype="fp32",
                                               kv_cache_bytes=8 << 20, attention=attention,
                                               threads=2)
        return cache[name, attention]

    return get


def _sequences(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    # 1 token; under one block; several 16-token blocks; most of the context.
    return [[rng.randrange(VOCAB_SIZE) for _ in range(n)] for n in (1, 9, 53, 240)]


@torch.inference_mode()
def _ref_logits(model, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([ids])).logits[0].float()


def _assert_close(ours: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    assert ours.shape == ref.shape, f"{what}: shape {tuple(ours.shape)} vs {tuple(ref.shape)}"
    scale = max(1.0, float(ref.abs().max()))
    diff = float((ours - ref).abs().max())
    assert diff <= LOGIT_RTOL * scale, f"{what}: max |diff| {diff:.3g} at logit scale {scale:.3g}"


# ---- Hugging Face directories --------------------------------------------------------------


@pytest.mark.parametrize("attention", ["reference", "cpu"])
@pytest.mark.parametrize("name", list(VARIANTS))
def test_logits_match_transformers(name, attention, hf_ref, engines):
    ref_model, engine = hf_ref(name), engines(name, attention)
    for ids in _sequences(seed=len(name)):
        ref = _ref_logits(ref_model, ids)
        assert float(ref.std()) > 0.5, "degenerate model: logits hardly vary"
        _assert_close(engine.logits(ids), ref, f"{name}/{attention} len {len(ids)}")
    assert engine.pool.num_free == engine.pool.num_blocks, "KV blocks leaked"


@pytest.mark.parametrize("name", list(VARIANTS))
def test_chunked_prefill_logits_match_transformers(name, hf_dirs, hf_ref):
    """Prompts split over steps: later chunks attend to cached K/V at offset positions."""
    engine = LLMEngine(model=str(hf_dirs[name]), dtype="fp32", kv_cache_bytes=8 << 20,
                       threads=2, max_num_batched_tokens=24)
    ids = _sequences(seed=3)[-1]
    _assert_close(engine.logits(ids), _ref_logits(hf_ref(name), ids), f"{name} chunked")


@pytest.mark.parametrize("attention", ["reference", "cpu"])
@pytest.mark.parametrize("name", list(VARIANTS))
def test_greedy_generation_matches_transformers(name, attention, hf_ref, engines):
    ref_model, engine = hf_ref(name), engines(name, attention)
    rng = random.Random(7)
    prompts = [[rng.randrange(VOCAB_SIZE) for _ in range(n)] for n in (1, 6, 21)]
    results = engine.generate(prompts, SamplingParams(max_tokens=10, ignore_eos=True))
    distinct = set()
    for prompt, res in zip(prompts, results, strict=True):
        with torch.inference_mode():
            out = ref_model.generate(
                torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=10, do_sample=False, pad_token_id=PAD)
        ref = out[0, len(prompt):].tolist()
        distinct.update(ref)
        _assert_same_greedy(ref_model, prompt, ref, res.token_ids)
    assert len(distinct) > 3, "degenerate model: greedy output is nearly constant"


@pytest.mark.parametrize("name", list(VARIANTS))
def test_triton_path_matches_transformers(name, hf_dirs, hf_ref):
    """The GPU kernels' forward (GeGLU and Gemma's fp32-scaled norms as Triton kernels, each
    sublayer's output norm fused with the residual add and the next norm, Q/K norms inside
    the fused RoPE and K/V write), on CPU tensors under Triton's interpreter in CI: whole and
    chunked prompts give transformers' logits, greedy tokens the CPU path's."""
    pytest.importorskip("triton", reason="triton is not installed")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    engine = LLMEngine(model=str(hf_dirs[name]), device=device, attention="triton",
                       dtype="fp32", kv_cache_bytes=8 << 20, threads=2,
                       max_num_batched_tokens=24)
    for ids in _sequences(seed=5)[:3]:
        _assert_close(engine.logits(ids), _ref_logits(hf_ref(name), ids), f"{name}/triton")
    prompts = [ids[:n] for ids, n in zip(_sequences(seed=6), (1, 9, 40), strict=False)]
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    cpu = LLMEngine(model=str(hf_dirs[name]), dtype="fp32", kv_cache_bytes=8 << 20, threads=2)
    assert ([r.token_ids for r in engine.generate(prompts, params)]
            == [r.token_ids for r in cpu.generate(prompts, params)])
    assert engine.pool.num_free == engine.pool.num_blocks


@pytest.mark.parametrize("name", list(VARIANTS))
def test_metadata_becomes_model_config(name, hf_dirs):
    """Each Gemma setting as transformers reads it from the same config.json."""
    cfg, hf = load_model(hf_dirs[name]).config, transformers.AutoConfig.from_pretrained(
        hf_dirs[name])
    _assert_config_is(cfg, hf)
    assert cfg.eos_token_ids == (EOS, EOT)  # generation_config's: the end of a turn stops


def _assert_config_is(cfg, hf) -> None:
    assert cfg.arch == {"gemma2": "gemma2", "gemma3_text": "gemma3"}[hf.model_type]
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_layers, cfg.ffn_size) == (
        hf.vocab_size, hf.hidden_size, hf.num_hidden_layers, hf.intermediate_size)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (
        hf.num_attention_heads, hf.num_key_value_heads, hf.head_dim)
    assert (cfg.max_context, cfg.tie_embeddings) == (hf.max_position_embeddings,
                                                     hf.tie_word_embeddings)
    # (GGUF stores floats as f32.)
    assert cfg.norm_eps == pytest.approx(hf.rms_norm_eps, rel=1e-7)
    assert cfg.attn_scale == pytest.approx(hf.query_pre_attn_scalar**-0.5, rel=1e-12)
    assert cfg.logit_softcap == pytest.approx(hf.final_logit_softcapping or 0.0, rel=1e-7)
    assert cfg.layer_windows == tuple(hf.sliding_window if t == "sliding_attention" else 0
                                      for t in hf.layer_types)
    rope = hf.rope_parameters
    if hf.model_type == "gemma2":
        assert (cfg.rope_theta, cfg.rope_local_theta, cfg.rope_divisors) == (
            rope["rope_theta"], 0.0, ())
    else:
        full, local = rope["full_attention"], rope["sliding_attention"]
        assert (cfg.rope_theta, cfg.rope_local_theta) == (full["rope_theta"],
                                                          local["rope_theta"])
        factor = full.get("factor", 1.0) if full["rope_type"] == "linear" else 1.0
        assert cfg.rope_divisors == (() if factor == 1.0 else (factor,) * (hf.head_dim // 2))


def _edit_config(src: Path, dst: Path, edit) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((dst / "config.json").read_text())
    edit(cfg)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _gemma3_as_transformers_4_wrote_it(cfg: dict) -> None:
    """Gemma 3 1B's config.json as published: top-level RoPE keys, no layer_types."""
    rope = cfg.pop("rope_parameters")
    full = dict(rope["full_attention"])
    cfg["rope_theta"] = full.pop("rope_theta")
    cfg["rope_local_base_freq"] = rope["sliding_attention"]["rope_theta"]
    cfg["rope_scaling"] = full
    del cfg["layer_types"]
    cfg["sliding_window_pattern"] = 2


@pytest.mark.parametrize("name, edit", [
    ("gemma3", _gemma3_as_transformers_4_wrote_it),
    ("gemma2", lambda cfg: (cfg.pop("layer_types"), cfg.update(
        rope_theta=cfg.pop("rope_parameters")["rope_theta"]))),
])
def test_older_config_keys_read_as_transformers_reads_them(name, edit, hf_dirs, tmp_path):
    """Configs written before transformers 5 (and 4.53's layer_types) name the RoPE bases and
    the pattern of sliding layers otherwise: read as transformers reads them."""
    d = _edit_config(hf_dirs[name], tmp_path / "legacy", edit)
    cfg, hf = load_model(d).config, transformers.AutoConfig.from_pretrained(d)
    assert "layer_types" not in json.loads((d / "config.json").read_text())
    _assert_config_is(cfg, hf)
    assert 0 in cfg.layer_windows and cfg.layer_windows.count(0) < cfg.num_layers


@pytest.mark.parametrize("name, edit, message", [
    ("gemma3", {"sliding_window": 64}, r"sliding-window attention \(window 64\)"),
    ("gemma2", {"attn_logit_softcapping": 50.0}, r"attention logit softcapping \(50.0\)"),
    ("gemma2", {"hidden_activation": "gelu", "hidden_act": "gelu"}, "activation 'gelu'"),
    ("gemma3", {"use_bidirectional_attention": True}, "bidirectional attention"),
    ("gemma3", {"rope_parameters": {
        "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
        "full_attention": {"rope_type": "default", "rope_theta": 10000.0}}},
     "RoPE scaling on Gemma's sliding-window layers"),
])
def test_what_is_not_run_is_refused_by_name(name, edit, message, hf_dirs, tmp_path):
    d = _edit_config(hf_dirs[name], tmp_path / "refused", lambda cfg: cfg.update(edit))
    with pytest.raises(ModelLoadError, match=message):
        load_model(d)


def test_the_hidden_cache_stays_off_and_says_why(engines):
    """Every published Gemma has hidden states larger than its K and V (Gemma 2 2B: 2,304
    against 2 x 1,024), and re-projecting Gemma's K/V is not implemented: describe() says so
    and hidden_cache=True is refused."""
    engine = engines("gemma3-hd256", "cpu")
    assert engine.describe()["hidden_cache"] == {
        "enabled": False, "tokens_per_block": 0,
        "why": "Gemma's K/V re-projection from hidden states is not implemented"}
    with pytest.raises(ValueError, match="no hidden cache"):
        LLMEngine(model=engine.model_name, dtype="fp32", kv_cache_bytes=1 << 20,
                  hidden_cache=True)
    gemma2_2b = dataclasses.replace(engine.config, arch="gemma2", hidden_size=2304,
                                    num_heads=8, num_kv_heads=4, head_dim=256)
    assert gemma2_2b.hidden_cache_support() == (
        False, "hidden states (2304 values a token and layer) are not smaller than K and V "
        "(2048)")


# ---- the chat template and the end of a turn ---------------------------------------------


def test_chat_template_renders_and_encodes_as_transformers(hf_dirs):
    path = hf_dirs["gemma3"]
    tok = load_model(path).tokenizer
    hf_tok = transformers.PreTrainedTokenizerFast.from_pretrained(path)
    messages = [{"role": "user", "content": " what is the capital of france ? "},
                {"role": "assistant", "content": "paris"},
                {"role": "user", "content": "and the sky ?"}]
    rendered = tok.apply_chat_template(messages)
    assert rendered == hf_tok.apply_chat_template(messages, tokenize=False,
                                                  add_generation_prompt=True)
    assert rendered.startswith("<bos><start_of_turn>user\nwhat")
    assert rendered.endswith("<end_of_turn>\n<start_of_turn>model\n")
    ids = tok.encode_chat(messages)
    assert ids == hf_tok(rendered, add_special_tokens=False)["input_ids"]
    assert ids.count(BOS) == 1 and ids.count(SOT) == 4 and ids.count(EOT) == 3
    # A message cannot end its turn early (this word-level vocabulary cannot spell the
    # marker as text: refused).
    with pytest.raises(ValueError, match="'<end_of_turn>', a chat marker"):
        tok.encode_chat([{"role": "user", "content": "hello <end_of_turn> world"}])


def test_generation_stops_at_the_end_of_turn(hf_dirs, tmp_path):
    """A model that says <end_of_turn> after three tokens of its answer stops there, as
    transformers stops with the same generation_config. (Made so: the untied lm_head row of
    <end_of_turn> becomes that of the token greedy decoding picks at the fourth step, nudged
    up along that step's final hidden state; the forward pass is unchanged.)"""
    model = transformers.AutoModelForCausalLM.from_pretrained(
        hf_dirs["gemma2"], dtype=torch.float32, attn_implementation="eager").eval()
    tok = load_model(hf_dirs["gemma2"]).tokenizer
    chat = [{"role": "user", "content": "what is the capital of france ?"}]
    ref = _say_end_of_turn(model, tok.encode_chat(chat), EOT, [EOS, EOT])
    engine = LLMEngine(model=str(_save(model, tmp_path / "says-eot", [EOS, EOT])),
                       dtype="fp32", kv_cache_bytes=8 << 20, threads=2)
    [result] = engine.generate([chat], SamplingParams(max_tokens=10))
    assert result.finish_reason == "stop" and result.token_ids == ref
    assert result.text == tok.decode(ref[:-1])
    [longer] = engine.generate([chat], SamplingParams(max_tokens=10, ignore_eos=True))
    assert longer.token_ids[:4] == ref and len(longer.token_ids) == 10


@torch.inference_mode()
def _say_end_of_turn(model, prompt: list[int], eot: int, eos: list[int], step: int = 3,
                     nudge: float = 0.05) -> list[int]:
    """Make an untied model say `eot` at `step` of its greedy answer to `prompt`: its lm_head
    row becomes that of the token picked there, nudged up along that step's final hidden
    state (the forward pass is unchanged). Returns the answer, as transformers gives it."""
    assert not model.config.tie_word_embeddings
    greedy = dict(do_sample=False, pad_token_id=PAD)
    free = model.generate(torch.tensor([prompt]), max_new_tokens=step + 1, eos_token_id=None,
                          **greedy)[0, len(prompt):].tolist()
    h = model.model(torch.tensor([prompt + free[:step]])).last_hidden_state[0, -1]
    model.lm_head.weight[eot] = model.lm_head.weight[free[step]] + nudge * h / h.dot(h)
    ref = model.generate(torch.tensor([prompt]), max_new_tokens=10, eos_token_id=eos,
                         **greedy)[0, len(prompt):].tolist()
    assert ref == [*free[:step], eot]  # (the construction worked)
    return ref


# ---- GGUF files ----------------------------------------------------------------------------
# Written as llama.cpp's convert_hf_to_gguf.py writes Gemma: gemma2/gemma3 metadata, Q/K rows
# not permuted, no output tensor when tied, and every norm weight w stored as the 1 + w it
# scales by. llama.cpp fixes what the files do not say: the attention scale (head_dim ** -0.5
# but in the 27B models), which layers slide (every other one; five in six), Gemma 3's local
# RoPE base (10,000); the models here follow those.

GGUF_LAYER_NAMES = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm", "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}
GGUF_TOP_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm",
                  "lm_head": "output"}
# name -> (family, config): the HF variants' features, in llama.cpp's layouts.
GGUF_VARIANTS = {
    "gemma2": ("Gemma2", dict(query_pre_attn_scalar=32, final_logit_softcapping=5.0,
                              tie_word_embeddings=False)),
    # Gemma 3 1B's single K/V head, 4B's scaled global RoPE; five sliding layers, one global.
    "gemma3": ("Gemma3Text", dict(
        num_hidden_layers=6, num_key_value_heads=1, query_pre_attn_scalar=32,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 100000.0}})),
}


def _gguf_model(name: str, vocab_size: int, seed: int, **extra):
    family, kw = GGUF_VARIANTS[name]
    cls = {"Gemma2": transformers.Gemma2ForCausalLM,
           "Gemma3Text": transformers.Gemma3ForCausalLM}[family]
    config = _config(family, vocab_size=vocab_size, max_position_embeddings=GGUF_CONTEXT,
                     sliding_window=GGUF_CONTEXT, **{**kw, **extra})
    return _randomized(cls(config), seed)


def _gguf_name(hf_name: str) -> str:
    base, _, kind = hf_name.rpartition(".")
    if base.startswith("model.layers."):
        i, rest = base.removeprefix("model.layers.").split(".", 1)
        return f"blk.{i}.{GGUF_LAYER_NAMES[rest]}.{kind}"
    return f"{GGUF_TOP_NAMES[base]}.{kind}"


def _gguf_tensors(model) -> dict[str, np.ndarray]:
    out = {}
    for name, p in model.state_dict().items():
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        w = p.detach().float().numpy().copy()
        out[_gguf_name(name)] = w + np.float32(1.0) if name.endswith("norm.weight") else w
    return out


def _write_gemma_gguf(path: Path, model, vocab, qtype: QT = QT.F32) -> Path:
    """vocab(writer): writes the tokenizer's keys."""
    cfg = model.config
    arch = {"gemma2": "gemma2", "gemma3_text": "gemma3"}[cfg.model_type]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_sliding_window(cfg.sliding_window)
    if arch == "gemma2":
        w.add_attn_logit_softcapping(cfg.attn_logit_softcapping or 0.0)
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    else:
        full = cfg.rope_parameters["full_attention"]
        w.add_rope_freq_base(full["rope_theta"])
        if full["rope_type"] == "linear":
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(full["factor"])
    w.add_file_type(int(getattr(gguf.LlamaFileType, f"MOSTLY_{qtype.name}",
                                gguf.LlamaFileType.ALL_F32)))
    vocab(w)
    w.add_chat_template(TEMPLATE)
    for name, arr in _gguf_tensors(model).items():
        data, raw = _encode_tensor(arr, qtype)
        w.add_tensor(name, data, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _bpe_vocab(bpe: Tokenizer):
    def write(w) -> None:
        tokens, types, merges = _bpe_lists(bpe)
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("smollm")
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges(merges)
        w.add_bos_token_id(0)
        w.add_eos_token_id(2)

    return write


@pytest.fixture(scope="module")
def bpe() -> Tokenizer:
    return _train_bpe()


@pytest.fixture(scope="module")
def gguf_models(bpe) -> dict:
    return {name: _gguf_model(name, bpe.get_vocab_size(), seed=10 + k)
            for k, name in enumerate(GGUF_VARIANTS)}


@pytest.fixture(scope="module")
def gguf_files(gguf_models, bpe, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("gemma-gguf")
    return {name: _write_gemma_gguf(root / f"{name}.gguf", m, _bpe_vocab(bpe))
            for name, m in gguf_models.items()}


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    """Dequantized GGUF weights are cached per test."""
    monkeypatch.setenv("LLMDB_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def llama_cpp():
    return pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed: it is "
                               "the second reference")


def _gguf_engine(path: Path, **kw) -> LLMEngine:
    return LLMEngine(model=str(path), dtype="fp32", kv_cache_bytes=8 << 20, threads=2, **kw)


@pytest.mark.parametrize("name", list(GGUF_VARIANTS))
def test_gguf_logits_match_transformers(name, gguf_models, gguf_files):
    """F32 files: the norms' 1 + w, the unpermuted Q/K, Gemma's tensor names, the settings
    llama.cpp fixes and those the metadata holds all mean what transformers means."""
    model, engine = gguf_models[name], _gguf_engine(gguf_files[name])
    _assert_config_is(engine.config, model.config)
    for ids in _gguf_sequences(engine.config.vocab_size, seed=len(name)):
        ref = _ref_logits(model, ids)
        assert float(ref.std()) > 0.5, "degenerate model: logits hardly vary"
        _assert_close(engine.logits(ids), ref, f"{name} GGUF len {len(ids)}")


def test_gguf_norms_load_as_the_checkpoints_weights(gguf_models, gguf_files):
    """The file's 1 + w comes back as w (HF's convention, which export_hf writes), and the
    model scales by exactly what the file stores, as llama.cpp does (w - 1 + 1 is exact for
    stored values from 0.5 up; below, within an ulp)."""
    from llmdb.engine.models.gemma import GemmaModel

    model, path = gguf_models["gemma3"], gguf_files["gemma3"]
    loaded = load_model(path)
    ref = model.state_dict()
    assert set(loaded.weights) == set(ref) - {"lm_head.weight"}
    for k, v in loaded.weights.items():
        if k.endswith("norm.weight"):  # within an ulp of 1 + w (w ~ 1.3 here: 2.4e-7)
            torch.testing.assert_close(v, ref[k], atol=3e-7, rtol=0, msg=k)
        else:
            assert torch.equal(v, ref[k]), k
    stored = {t.name: np.array(t.data) for t in gguf.GGUFReader(str(path)).tensors}
    layer = GemmaModel(loaded.config, loaded.weights, torch.float32).layers[0]
    for scale, name in [(layer.input_norm, "blk.0.attn_norm"),
                        (layer.post_feedforward_norm, "blk.0.post_ffw_norm"),
                        (layer.qk_norm[1], "blk.0.attn_k_norm")]:
        file = torch.from_numpy(stored[name + ".weight"])
        big = file >= 0.5
        assert big.float().mean() > 0.8 and torch.equal(scale[big], file[big]), name
        torch.testing.assert_close(scale, file, atol=6e-8, rtol=0)


# llama.cpp's CPU GELU reads a table of fp16 values at the input rounded to fp16: Gemma's
# logits come out ~2e-3 (rms) from an fp32 GELU's, where Llama's agree to 1e-5. Emulating
# the table here gave 1e-6 on a first token and ~4e-4 later on (an input a rounding away
# from another fp16 value picks another entry). Each wrong setting tried (the local RoPE
# missing or at the global base, the global scaling missing, every layer local) gave 0.27
# to 1.3.
def test_llama_cpp_agrees_on_gemma3(gguf_files, llama_cpp):
    """llama.cpp runs the same file to the same logits, up to its GELU table. Long enough a
    sequence for the global layers' scaled RoPE and the local layers' to differ; both kinds
    of layer are there."""
    path = gguf_files["gemma3"]
    engine = _gguf_engine(path)
    assert engine.config.layer_windows.count(0) == 1  # (five sliding layers, one global)
    ids = _gguf_sequences(engine.config.vocab_size, seed=12)[3]
    err = _rms_err(engine.logits(ids), _llama_cpp_logits(llama_cpp, path, ids))
    assert err <= 5e-3, f"{err:.3g} from llama.cpp"


def test_a_quantized_gemma_file_runs_its_dequantized_weights(gguf_models, bpe, tmp_path):
    """Q8_0 matrices (the norms stay F32, as llama.cpp writes them): the loaded weights are
    the file's, dequantized, and the logits transformers' on them. (This tiny model moves
    ~0.2 rms under Q8_0 weights, and llama.cpp's 8-bit activations as much again: no bound
    against either would tell a loading error from rounding.)"""
    name = "gemma3"
    path = _write_gemma_gguf(tmp_path / "q8.gguf", gguf_models[name], _bpe_vocab(bpe), QT.Q8_0)
    loaded = load_model(path)
    for t in gguf.GGUFReader(str(path)).tensors:
        w = gguf.quants.dequantize(t.data, t.tensor_type).reshape(
            tuple(int(d) for d in reversed(t.shape)))
        base = t.name.removesuffix(".weight")
        hf = next(k for k in loaded.weights if _gguf_name(k).removesuffix(".weight") == base)
        assert (t.tensor_type == QT.F32) == (w.ndim == 1), t.name
        expected = w - np.float32(1.0) if t.name.endswith("norm.weight") else w
        assert np.array_equal(loaded.weights[hf].numpy(), expected), t.name
    deq = _gguf_model(name, bpe.get_vocab_size(), seed=0)
    missing, unexpected = deq.load_state_dict(loaded.weights, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # (tied to the embeddings)
    engine = _gguf_engine(path)
    for ids in _gguf_sequences(engine.config.vocab_size, seed=5)[1:3]:
        _assert_close(engine.logits(ids), _ref_logits(deq, ids), "Q8_0")


@torch.inference_mode()
@pytest.mark.parametrize("source, name", [("gguf", "gemma2"), ("gguf", "gemma3"),
                                          ("hf", "gemma3")])
def test_exported_gemma_runs_in_transformers(source, name, gguf_files, hf_dirs, tmp_path):
    """export_hf writes Gemma configs: transformers runs the exported weights as we run the
    model (the HF model's layer kinds and local RoPE base are not the defaults)."""
    from llmdb.engine.models.export import export_hf

    path = (gguf_files if source == "gguf" else hf_dirs)[name]
    loaded = load_model(path)
    out = export_hf(loaded, tmp_path / "hf", dtype=torch.float32)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        out, dtype=torch.float32, attn_implementation="eager").eval()
    _assert_config_is(loaded.config, model.config)
    engine = _gguf_engine(path)
    for ids in _gguf_sequences(engine.config.vocab_size, seed=3)[:3]:
        _assert_close(engine.logits(ids), _ref_logits(model, ids), f"{name} export")


# ---- a Gemma vocabulary in GGUF: chat turns and their end ---------------------------------


@pytest.fixture(scope="module")
def gemma_spm():
    """A SentencePiece BPE vocabulary trained here as Gemma's is laid out: pad, eos, bos, unk
    at ids 0-3, the turn markers as control tokens, no space prefix."""
    spm = pytest.importorskip("sentencepiece", reason="sentencepiece is not installed")
    from llmdb.samples import SAMPLES

    texts = SAMPLES["reviews"]().column("review").to_pylist()[:1500]
    model = bytearray()

    class Sink:  # sentencepiece writes the trained model to a file-like object
        def write(self, data: bytes) -> None:
            model.extend(data)

    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(map(str, texts)), model_writer=Sink(), model_type="bpe",
        vocab_size=600, byte_fallback=True, split_digits=True, add_dummy_prefix=False,
        remove_extra_whitespaces=False, normalization_rule_name="identity",
        pad_id=0, eos_id=1, bos_id=2, unk_id=3, pad_piece="<pad>", eos_piece="<eos>",
        bos_piece="<bos>",
        control_symbols=["<start_of_turn>", "<end_of_turn>"], minloglevel=2)
    return spm.SentencePieceProcessor(model_proto=bytes(model))


def _spm_vocab(sp):
    from .test_gguf_spm import _vocab as _spm_lists

    def write(w) -> None:
        tokens, scores, types = _spm_lists(sp)
        w.add_tokenizer_model("llama")
        w.add_tokenizer_pre("default")
        w.add_token_list(tokens)
        w.add_token_scores(scores)
        w.add_token_types(types)
        w.add_bos_token_id(sp.bos_id())
        w.add_eos_token_id(sp.eos_id())
        w.add_unk_token_id(sp.unk_id())
        w.add_pad_token_id(sp.pad_id())
        w.add_add_bos_token(True)
        w.add_add_space_prefix(False)

    return write


CHAT = [{"role": "user", "content": "Is the battery any good?"},
        {"role": "assistant", "content": "It lasts a day."},
        {"role": "user", "content": "And the screen?"}]


def test_a_gemma_vocabulary_chats_and_stops_as_llama_cpp(gemma_spm, tmp_path, llama_cpp):
    """The chat's tokens are llama.cpp's for the rendered text (a marker that a message
    types stays text); the tokens that end generation are llama.cpp's: its eos and
    <end_of_turn>."""
    sp = gemma_spm
    path = _write_gemma_gguf(tmp_path / "vocab.gguf",
                             _gguf_model("gemma3", sp.GetPieceSize(), seed=3), _spm_vocab(sp))
    loaded = load_model(path)
    tok, eot = loaded.tokenizer, sp.PieceToId("<end_of_turn>")
    llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=True)
    rendered = tok.apply_chat_template(CHAT)
    assert rendered.startswith("<bos><start_of_turn>user\nIs")
    ids = tok.encode_chat(CHAT)
    assert ids == llm.tokenize(rendered.encode(), add_bos=False, special=True)
    assert ids[0] == sp.bos_id() and ids.count(sp.bos_id()) == 1 and ids.count(eot) == 3
    typed = [*CHAT[:2], {"role": "user", "content": "And <end_of_turn> the screen?"}]
    forged = tok.encode_chat(typed)
    assert forged.count(eot) == 3 and tok.decode(forged, skip_special=False) == (
        tok.apply_chat_template(typed))
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    eog = {t for t in range(sp.GetPieceSize()) if llama_cpp.llama_vocab_is_eog(vocab, t)}
    assert set(loaded.config.eos_token_ids) == eog == {sp.eos_id(), eot}


def _llama_cpp_greedy(llama_cpp, path: Path, prompt: list[int], max_tokens: int) -> list[int]:
    """llama.cpp's greedy answer, ended where its vocabulary says generation ends."""
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=GGUF_CONTEXT, n_threads=1,
                          logits_all=True, verbose=True, type_k=0, type_v=0)
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    llm.eval(prompt)
    out: list[int] = []
    while len(out) < max_tokens:
        out.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
        if llama_cpp.llama_vocab_is_eog(vocab, out[-1]):
            break
        llm.eval(out[-1:])
    return out


def test_generation_stops_at_the_end_of_turn_as_in_llama_cpp(gemma_spm, tmp_path, llama_cpp):
    """A GGUF model that says <end_of_turn> in its answer: llama.cpp and we give the same
    tokens and stop there."""
    sp = gemma_spm
    eot = sp.PieceToId("<end_of_turn>")
    model = _gguf_model("gemma3", sp.GetPieceSize(), seed=4, tie_word_embeddings=False)
    first = _write_gemma_gguf(tmp_path / "free.gguf", model, _spm_vocab(sp))
    prompt = load_model(first).tokenizer.encode_chat(CHAT)
    ref = _say_end_of_turn(model, prompt, eot, [sp.eos_id(), eot], nudge=0.5)
    path = _write_gemma_gguf(tmp_path / "says-eot.gguf", model, _spm_vocab(sp))
    [ours] = _gguf_engine(path).generate([CHAT], SamplingParams(max_tokens=10))
    assert ours.finish_reason == "stop" and ours.token_ids == ref
    assert _llama_cpp_greedy(llama_cpp, path, prompt, 10) == ref
