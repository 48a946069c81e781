"""Gemma GGUF files (llama.cpp's gemma2 and gemma3 architectures) against transformers and
llama.cpp, in fp32, written here as llama.cpp's converter writes them, with sliding windows
of 32 tokens under sequences of up to 120 and Gemma 2's attention cap (5) biting."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as QT
from tokenizers import Tokenizer

from llmdb.engine.engine import LLMEngine
from llmdb.engine.models import load_model
from llmdb.engine.params import SamplingParams

from .gemma_models import (
    EOS,
    EOT,
    TEMPLATE,
    _assert_config_is,
    _build,
    _config,
    _randomized,
    _save,
    _say_end_of_turn,
)
from .model_builders import (
    add_bpe_vocab,
    add_gguf_shape,
    assert_close,
    assert_logits_match,
    gguf_tensor_name,
    ref_logits,
    write_gguf_file,
)
from .test_gguf_loader import CONTEXT as GGUF_CONTEXT
from .test_gguf_loader import _encode_tensor, _llama_cpp_logits, _rms_err, _train_bpe
from .test_gguf_loader import _sequences as _gguf_sequences
from .test_gguf_loader import _vocab as _bpe_lists

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
# name -> (family, config): the HF variants' features, in llama.cpp's layouts.
GGUF_VARIANTS = {
    # Tied: llama.cpp's gemma2 reads no output tensor (its converter drops lm_head).
    "gemma2": ("Gemma2", dict(query_pre_attn_scalar=32, sliding_window=32,
                              attn_logit_softcapping=5.0, final_logit_softcapping=5.0)),
    # Gemma 3 1B's single K/V head, 4B's scaled global RoPE; five sliding layers, one global.
    "gemma3": ("Gemma3Text", dict(
        num_hidden_layers=6, num_key_value_heads=1, query_pre_attn_scalar=32, sliding_window=32,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 100000.0}})),
}


def _gguf_model(name: str, vocab_size: int, seed: int, **extra):
    family, kw = GGUF_VARIANTS[name]
    cls = {"Gemma2": transformers.Gemma2ForCausalLM,
           "Gemma3Text": transformers.Gemma3ForCausalLM}[family]
    config = _config(family, vocab_size=vocab_size, max_position_embeddings=GGUF_CONTEXT,
                     **{**kw, **extra})
    return _randomized(cls(config), seed)


def _gguf_tensors(model) -> dict[str, np.ndarray]:
    out = {}
    for name, p in model.state_dict().items():
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        w = p.detach().float().numpy().copy()
        gname = gguf_tensor_name(name, GGUF_LAYER_NAMES)
        out[gname] = w + np.float32(1.0) if name.endswith("norm.weight") else w
    return out


def _write_gemma_gguf(path: Path, model, vocab, qtype: QT = QT.F32) -> Path:
    """vocab(writer): writes the tokenizer's keys."""
    cfg = model.config
    arch = {"gemma2": "gemma2", "gemma3_text": "gemma3"}[cfg.model_type]
    w = gguf.GGUFWriter(str(path), arch)
    add_gguf_shape(w, cfg)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_sliding_window(cfg.sliding_window)
    if arch == "gemma2":
        w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
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
    write_gguf_file(w)
    return path


def _bpe_vocab(bpe: Tokenizer):
    def write(w) -> None:
        add_bpe_vocab(w, *_bpe_lists(bpe))
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


def _gguf_engine(path: Path) -> LLMEngine:
    return LLMEngine(model=str(path), dtype="fp32", kv_cache_bytes=8 << 20, threads=2)


@pytest.mark.parametrize("name", list(GGUF_VARIANTS))
def test_gguf_logits_match_transformers(name, gguf_models, gguf_files):
    """F32 files: the norms' 1 + w, the unpermuted Q/K, Gemma's tensor names, the settings
    llama.cpp fixes and those the metadata holds all mean what transformers means."""
    model, engine = gguf_models[name], _gguf_engine(gguf_files[name])
    _assert_config_is(engine.config, model.config)
    assert_logits_match(engine, model, _gguf_sequences(engine.config.vocab_size, seed=len(name)),
                        f"{name} GGUF")


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
# missing or at the global base, the global scaling missing, every layer local, no window,
# no attention cap) gave 0.2 or more.
@pytest.mark.parametrize("name", list(GGUF_VARIANTS))
def test_llama_cpp_agrees(name, gguf_files, llama_cpp):
    """llama.cpp runs the same file to the same logits, up to its GELU table, on a sequence
    almost four windows long: the sliding layers' windows, Gemma 2's attention cap, Gemma
    3's local and scaled global RoPEs all as llama.cpp reads the file."""
    path = gguf_files[name]
    engine = _gguf_engine(path)
    windows = engine.config.layer_windows
    assert windows.count(0) == (2 if name == "gemma2" else 1) and max(windows) == 32
    ids = _gguf_sequences(engine.config.vocab_size, seed=12)[3]
    err = _rms_err(engine.logits(ids), _llama_cpp_logits(llama_cpp, path, ids))
    assert err <= 5e-3, f"{name}: {err:.3g} from llama.cpp"


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
        hf = next(k for k in loaded.weights
                  if gguf_tensor_name(k, GGUF_LAYER_NAMES).removesuffix(".weight") == base)
        assert (t.tensor_type == QT.F32) == (w.ndim == 1), t.name
        expected = w - np.float32(1.0) if t.name.endswith("norm.weight") else w
        assert np.array_equal(loaded.weights[hf].numpy(), expected), t.name
    deq = _gguf_model(name, bpe.get_vocab_size(), seed=0)
    missing, unexpected = deq.load_state_dict(loaded.weights, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # (tied to the embeddings)
    engine = _gguf_engine(path)
    for ids in _gguf_sequences(engine.config.vocab_size, seed=5)[1:3]:
        assert_close(engine.logits(ids), ref_logits(deq, ids), "Q8_0")


@torch.inference_mode()
@pytest.mark.parametrize("source, name", [("gguf", "gemma2"), ("gguf", "gemma3"),
                                          ("hf", "gemma3")])
def test_exported_gemma_runs_in_transformers(source, name, gguf_files, tmp_path):
    """export_hf writes Gemma configs: transformers runs the exported weights as we run the
    model (the HF model's layer kinds and local RoPE base are not the defaults)."""
    from llmdb.engine.models.export import export_hf

    path = (gguf_files[name] if source == "gguf"
            else _save(_build(name, seed=1), tmp_path / "src", [EOS, EOT]))
    loaded = load_model(path)
    out = export_hf(loaded, tmp_path / "hf", dtype=torch.float32)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        out, dtype=torch.float32, attn_implementation="eager").eval()
    _assert_config_is(loaded.config, model.config)
    engine = _gguf_engine(path)
    for ids in _gguf_sequences(engine.config.vocab_size, seed=3)[:3]:
        assert_close(engine.logits(ids), ref_logits(model, ids), f"{name} export")


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
