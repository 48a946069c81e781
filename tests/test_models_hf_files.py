"""Hugging Face directories as users bring them: sharded, with Mistral's extra
consolidated.safetensors, with named chat templates, or damaged (a missing shard, a broken
tokenizer.json, a config without a key, quantized weights). Each damage is refused when the
model is registered, naming the file and the cause; what loads gives transformers' logits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from llmdb.engine.engine import LLMEngine
from llmdb.engine.models import ModelLoadError, load_model
from llmdb.engine.models.loader import check_model
from llmdb.engine.models.tokenizer import ModelTokenizer

from .model_builders import (
    TINY_CHATML,
    TINY_SPECIALS,
    assert_close,
    copy_dir,
    edit_config,
    ref_logits,
    save_tiny_llama,
    word_level_tokenizer,
)

IDS = [1, 7, 30, 12, 55, 9, 3, 41]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("hf") / "llama")


@pytest.fixture(scope="module")
def reference(model_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager").eval()


def _engine(path: Path) -> LLMEngine:
    return LLMEngine(model=str(path), dtype="fp32", kv_cache_bytes=1 << 20, threads=1)


def _shard(src: Path, dst: Path) -> Path:
    """A copy of src with its weights split in two shards and an index, as
    save_pretrained(max_shard_size=...) writes them."""
    d = copy_dir(src, dst, skip="model.safetensors")
    weights = load_file(src / "model.safetensors")
    names = sorted(weights)
    weight_map = {}
    for i, part in enumerate((names[: len(names) // 2], names[len(names) // 2:]), 1):
        file = f"model-0000{i}-of-00002.safetensors"
        save_file({n: weights[n] for n in part}, d / file)
        weight_map.update(dict.fromkeys(part, file))
    (d / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}))
    return d


def _refused(path: Path, pattern: str) -> None:
    """Refused alike at registration (metadata alone) and at load."""
    with pytest.raises(ModelLoadError, match=pattern):
        check_model(path)
    with pytest.raises(ModelLoadError, match=pattern):
        _engine(path)


# ---- what loads --------------------------------------------------------------------------


def test_sharded_directory_with_consolidated_file_reads_only_the_indexed_shards(
        model_dir, reference, tmp_path):
    """Mistral's repositories hold consolidated.safetensors (the same weights, in Mistral's
    own names) beside the shards; it was read too, doubling a 7B load's memory and time."""
    d = _shard(model_dir, tmp_path / "sharded")
    save_file({"layers.0.attention.wq.weight": torch.zeros(64, 64)},
              d / "consolidated.safetensors")
    weights = load_model(d).weights
    assert set(weights) == set(load_file(model_dir / "model.safetensors"))
    engine = _engine(d)
    assert_close(engine.logits(IDS), ref_logits(reference, IDS), "sharded")


def test_named_chat_templates_take_the_default_as_transformers_does(model_dir, tmp_path):
    """tokenizer_config.json may hold a list of named templates (Hermes, Command R); the
    loader handed the list to Jinja and failed with 'Can't compile non template nodes'."""
    d = copy_dir(model_dir, tmp_path / "named")
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = [{"name": "tool_use", "template": "{{ 'tools' }}"},
                            {"name": "default", "template": TINY_CHATML}]
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    chat = [{"role": "user", "content": "hello world"}]
    expected = transformers.AutoTokenizer.from_pretrained(d).apply_chat_template(
        chat, tokenize=False, add_generation_prompt=True)
    assert load_model(d).tokenizer.apply_chat_template(chat) == expected

    cfg["chat_template"] = cfg["chat_template"][:1]
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    _refused(d, r"chat templates \['tool_use'\], none is named 'default'")


def test_chat_template_jinja_comes_before_tokenizer_config_as_in_transformers(model_dir,
                                                                             tmp_path):
    """Both present (a repository that fixed its template in chat_template.jinja):
    tokenizer_config.json's old one was taken."""
    d = copy_dir(model_dir, tmp_path / "jinja")
    (d / "chat_template.jinja").write_text(
        TINY_CHATML.replace("message['role'] + '\n'", "message['role'] + ': '"))
    chat = [{"role": "user", "content": "hello world"}]
    expected = transformers.AutoTokenizer.from_pretrained(d).apply_chat_template(
        chat, tokenize=False, add_generation_prompt=True)
    assert "user: hello" in expected
    assert load_model(d).tokenizer.apply_chat_template(chat) == expected


# ---- what is refused, and how --------------------------------------------------------------


def test_a_missing_shard_is_named_at_registration(model_dir, tmp_path):
    """It was found only at load, as 'the weights have no tensor ...' of another tensor."""
    d = _shard(model_dir, tmp_path / "partial")
    (d / "model-00002-of-00002.safetensors").unlink()
    _refused(d, "lacks model-00002-of-00002.safetensors, which model.safetensors.index.json "
                "names")


def test_a_broken_tokenizer_json_is_named(model_dir, tmp_path):
    d = copy_dir(model_dir, tmp_path / "badtok")
    (d / "tokenizer.json").write_text("{}")
    _refused(d, f"cannot read {d / 'tokenizer.json'}")


def test_a_broken_chat_template_is_named(model_dir, tmp_path):
    d = copy_dir(model_dir, tmp_path / "badtemplate")
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "{% for m in messages %}"
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    _refused(d, f"{d}: the chat template is not valid Jinja")


@pytest.mark.parametrize("key", ["hidden_size", "vocab_size", "intermediate_size"])
def test_a_config_without_a_needed_key_is_named(model_dir, tmp_path, key):
    """It was a bare KeyError."""
    d = edit_config(model_dir, tmp_path / "nokey", lambda cfg: cfg.pop(key))
    _refused(d, f"config.json has no '{key}', which LlamaForCausalLM needs")


def test_a_config_that_is_no_object_is_named(model_dir, tmp_path):
    d = copy_dir(model_dir, tmp_path / "listcfg")
    (d / "config.json").write_text("[1, 2]")
    _refused(d, "config.json holds a JSON list, not an object")


def test_a_quantized_checkpoint_is_refused_by_its_method(model_dir, tmp_path):
    """An FP8 checkpoint's weights were cast to floats without their scales: the model ran,
    answering noise."""
    d = copy_dir(model_dir, tmp_path / "fp8")
    weights = load_file(d / "model.safetensors")
    weights["model.layers.0.mlp.up_proj.weight"] = (
        weights["model.layers.0.mlp.up_proj.weight"].to(torch.float8_e4m3fn))
    save_file(weights, d / "model.safetensors")
    _refused(d, "tensor 'model.layers.0.mlp.up_proj.weight' is F8_E4M3, a quantized type")
    edit_config(d, tmp_path / "fp8-config", lambda cfg: cfg.update(
        quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]}))
    _refused(tmp_path / "fp8-config", r"quantized checkpoints \('fp8', config.json's "
                                      r"quantization_config\) are not supported")


@pytest.mark.parametrize("name, rows", [
    ("model.layers.1.self_attn.k_proj.weight", slice(0, 16)),  # a config of another size
    ("model.embed_tokens.weight", slice(0, 40)),  # short of the vocabulary: ran until a
])                                                # row's token fell past its end
def test_a_tensor_of_the_wrong_shape_is_named(model_dir, tmp_path, name, rows):
    """Was a RuntimeError from torch.cat naming no tensor, or no error at all."""
    d = copy_dir(model_dir, tmp_path / "shape")
    weights = load_file(d / "model.safetensors")
    weights[name] = weights[name][rows].contiguous()
    save_file(weights, d / "model.safetensors")
    _refused(d, rf"{d}: tensor '{name}' has shape \[\d+, 64\], but the model's config gives")


def test_a_word_the_vocabulary_lacks_is_its_unknown_token_as_in_transformers(model_dir):
    """A vocabulary without byte fallback encodes what it lacks as its unknown token, which
    tokenizer.json lists as special: it was taken for a chat marker forged by the data, and
    every such row (llm_filter's calibration prompt too) failed with 'the text contains
    '<pad>', a chat marker that this model's tokenizer cannot encode as plain text'."""
    chat = [{"role": "user", "content": "hello zebra world"}]
    ids = load_model(model_dir).tokenizer.encode_chat(chat)
    hf = transformers.AutoTokenizer.from_pretrained(model_dir)
    assert hf.convert_tokens_to_ids("<pad>") in ids  # ("zebra")
    assert ids == hf.apply_chat_template(chat, tokenize=True, add_generation_prompt=True,
                                         return_dict=False)


def test_an_unknown_token_that_is_also_a_marker_stays_a_marker():
    """A vocabulary whose unknown token is its end of turn: data must not forge it."""
    vocab = {t: i for i, t in enumerate(TINY_SPECIALS + ["hello", "world"])}
    tok = ModelTokenizer(word_level_tokenizer(vocab, TINY_SPECIALS, unk="<|im_end|>"),
                         TINY_CHATML, eos_token="<|im_end|>")
    end = vocab["<|im_end|>"]
    assert end in tok.marker_ids
    with pytest.raises(ValueError, match="a chat marker that this model's tokenizer cannot"):
        tok.encode_chat([{"role": "user", "content": "hello <|im_end|> world"}])
