"""Gemma 2 and Gemma 3 (text) Hugging Face directories against transformers, in fp32, on
the tiny random models of tests/gemma_models.py: logits, greedy tokens, chunked prefill, the
Triton path, the config as transformers reads it, the chat template and its end of turn."""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

import pytest
import torch
import transformers

from llmdb.engine.engine import LLMEngine
from llmdb.engine.models import ModelLoadError, load_model
from llmdb.engine.params import SamplingParams

from .gemma_models import (
    BOS,
    EOS,
    EOT,
    PAD,
    SOT,
    VARIANTS,
    VOCAB_SIZE,
    _assert_config_is,
    _build,
    _save,
    _say_end_of_turn,
)
from .model_builders import (
    assert_close,
    assert_greedy_matches,
    assert_logits_match,
    assert_triton_path_matches,
    cached_engines,
    edit_config,
    ref_logits,
    reference_models,
)


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gemma")
    return {name: _save(_build(name, seed), root / name, [EOS, EOT])
            for seed, name in enumerate(VARIANTS)}


@pytest.fixture(scope="module")
def hf_ref(hf_dirs):
    """name -> the transformers model reloaded from its directory (eager attention, fp32)."""
    return reference_models(hf_dirs)


@pytest.fixture(scope="module")
def engines(hf_dirs):
    """(name, attention, **options) -> an engine on the model's directory."""
    return cached_engines(hf_dirs, kv_cache_bytes=8 << 20)


def _sequences(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    # 1 token; under one block; several 16-token blocks; most of the context.
    return [[rng.randrange(VOCAB_SIZE) for _ in range(n)] for n in (1, 9, 53, 240)]


# ---- Hugging Face directories --------------------------------------------------------------


@pytest.mark.parametrize("attention", ["reference", "cpu"])
@pytest.mark.parametrize("name", list(VARIANTS))
def test_logits_match_transformers(name, attention, hf_ref, engines):
    engine = engines(name, attention)
    assert_logits_match(engine, hf_ref(name), _sequences(seed=len(name)), f"{name}/{attention}")
    assert engine.pool.num_free == engine.pool.num_blocks, "KV blocks leaked"


@pytest.mark.parametrize("name", list(VARIANTS))
def test_chunked_prefill_logits_match_transformers(name, hf_ref, engines):
    """Prompts split over steps: later chunks attend to cached K/V at offset positions."""
    engine = engines(name, "cpu", max_num_batched_tokens=24)
    ids = _sequences(seed=3)[-1]
    assert_close(engine.logits(ids), ref_logits(hf_ref(name), ids), f"{name} chunked")


@pytest.mark.parametrize("attention", ["reference", "cpu"])
@pytest.mark.parametrize("name", list(VARIANTS))
def test_greedy_generation_matches_transformers(name, attention, hf_ref, engines):
    rng = random.Random(7)
    prompts = [[rng.randrange(VOCAB_SIZE) for _ in range(n)] for n in (1, 6, 21)]
    answers = assert_greedy_matches(engines(name, attention), hf_ref(name), prompts, 10, PAD)
    distinct = {t for ref, _ in answers for t in ref}
    assert len(distinct) > 3, "degenerate model: greedy output is nearly constant"


@pytest.mark.parametrize("name", list(VARIANTS))
def test_triton_path_matches_transformers(name, hf_dirs, hf_ref):
    """The GPU kernels' forward (GeGLU and Gemma's fp32-scaled norms as Triton kernels, each
    sublayer's output norm fused with the residual add and the next norm, Q/K norms inside
    the fused RoPE and K/V write), on CPU tensors under Triton's interpreter in CI: whole and
    chunked prompts give transformers' logits, greedy tokens the CPU path's."""
    prompts = [ids[:n] for ids, n in zip(_sequences(seed=6), (1, 9, 30), strict=False)]
    assert_triton_path_matches(hf_dirs[name], hf_ref(name), _sequences(seed=5)[:3], prompts,
                               max_tokens=4, kv_cache_bytes=8 << 20, what=f"{name}/triton")


@pytest.mark.parametrize("name", list(VARIANTS))
def test_metadata_becomes_model_config(name, hf_dirs):
    """Each Gemma setting as transformers reads it from the same config.json."""
    cfg, hf = load_model(hf_dirs[name]).config, transformers.AutoConfig.from_pretrained(
        hf_dirs[name])
    _assert_config_is(cfg, hf)
    assert cfg.eos_token_ids == (EOS, EOT)  # generation_config's: the end of a turn stops


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
    d = edit_config(hf_dirs[name], tmp_path / "legacy", edit)
    cfg, hf = load_model(d).config, transformers.AutoConfig.from_pretrained(d)
    assert "layer_types" not in json.loads((d / "config.json").read_text())
    _assert_config_is(cfg, hf)
    windows = cfg.layer_windows
    assert 0 in windows and windows.count(0) < cfg.num_layers  # (both kinds of layer)


@pytest.mark.parametrize("name, edit, message", [
    ("gemma2", {"hidden_activation": "gelu", "hidden_act": "gelu"}, "activation 'gelu'"),
    ("gemma3", {"use_bidirectional_attention": True}, "bidirectional attention"),
    ("gemma3", {"rope_parameters": {
        "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
        "full_attention": {"rope_type": "default", "rope_theta": 10000.0}}},
     "RoPE scaling on Gemma's sliding-window layers"),
])
def test_what_is_not_run_is_refused_by_name(name, edit, message, hf_dirs, tmp_path):
    d = edit_config(hf_dirs[name], tmp_path / "refused", lambda cfg: cfg.update(edit))
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
