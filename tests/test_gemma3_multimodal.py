"""Gemma 3 4B/12B/27B's Hugging Face directories (Gemma3ForConditionalGeneration: an image
encoder beside the text decoder) against transformers' Gemma3ForConditionalGeneration on
text, in fp32: tiny random models saved by save_pretrained (weights under language_model.,
the text settings under text_config), whose text decoder has every Gemma 3 feature of
tests/gemma_models.py's "gemma3" (Q/K norms, a local and a linearly scaled global RoPE,
windows of 16 tokens); configs as sparse as Google's read as transformers reads them; the
vision tower is never read."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch
import transformers

from llmdb.engine.engine import LLMEngine
from llmdb.engine.models import hf_dir, load_model
from llmdb.engine.models.hf_dir import read_hf_metadata

from .gemma_models import (
    EOS,
    EOT,
    PAD,
    TEMPLATE,
    VARIANTS,
    VOCAB_SIZE,
    _assert_close,
    _assert_config_is,
    _ref_logits,
    _save,
)
from .model_builders import assert_greedy_matches, randomize, reference_models


def _multimodal(tie: bool, seed: int):
    """Gemma 3's text decoder as tests/gemma_models.py builds it, a two-layer SigLIP encoder
    beside it; tied as Google's models are, or not (the LM head is then stored too)."""
    text = VARIANTS["gemma3"][1]()
    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64,
                                             num_hidden_layers=2, num_attention_heads=2,
                                             image_size=28, patch_size=14)
    config = transformers.Gemma3Config(text_config=text, vision_config=vision,
                                       mm_tokens_per_image=4, tie_word_embeddings=tie)
    torch.manual_seed(seed)
    model = transformers.Gemma3ForConditionalGeneration(config)
    randomize(model, seed)
    with torch.no_grad():  # (as gemma_models._randomized does, by the text model's size)
        model.get_input_embeddings().weight.div_(text.hidden_size**0.5)
    return model.eval()


MODELS = {"tied": True, "untied": False}


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gemma3-mm")
    return {name: _save(_multimodal(tie, seed=20 + k), root / name, [EOS, EOT])
            for k, (name, tie) in enumerate(MODELS.items())}


@pytest.fixture(scope="module")
def hf_ref(hf_dirs):
    return reference_models(hf_dirs, transformers.Gemma3ForConditionalGeneration)


def _engine(path: Path, **kw) -> LLMEngine:
    return LLMEngine(model=str(path), dtype="fp32", kv_cache_bytes=8 << 20, threads=2, **kw)


def _sequences(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    # 1 token; under one block; several 16-token windows; most of the context.
    return [[rng.randrange(VOCAB_SIZE) for _ in range(n)] for n in (1, 9, 53, 240)]


def test_the_directory_is_a_multimodal_checkpoint(hf_dirs):
    """What the tests below load is what Google ships: the text settings under text_config,
    the decoder's weights under language_model.model., a vision tower beside them, and an
    LM head stored only when untied."""
    from safetensors import safe_open

    for name, tie in MODELS.items():
        cfg = json.loads((hf_dirs[name] / "config.json").read_text())
        assert cfg["architectures"] == ["Gemma3ForConditionalGeneration"]
        assert "text_config" in cfg and "num_hidden_layers" not in cfg
        with safe_open(str(hf_dirs[name] / "model.safetensors"), "pt") as f:
            keys = set(f.keys())
        assert "language_model.model.layers.0.self_attn.q_norm.weight" in keys
        assert any(k.startswith("vision_tower.") for k in keys)
        assert ("language_model.lm_head.weight" in keys) == (not tie)


@pytest.mark.parametrize("attention", ["reference", "cpu"])
@pytest.mark.parametrize("name", list(MODELS))
def test_logits_match_transformers(name, attention, hf_dirs, hf_ref):
    engine = _engine(hf_dirs[name], attention=attention)
    for ids in _sequences(seed=len(name)):
        ref = _ref_logits(hf_ref(name), ids)
        assert float(ref.std()) > 0.5, "degenerate model: logits hardly vary"
        _assert_close(engine.logits(ids), ref, f"{name}/{attention} len {len(ids)}")
    assert engine.pool.num_free == engine.pool.num_blocks, "KV blocks leaked"


def test_chunked_prefill_logits_match_transformers(hf_dirs, hf_ref):
    """A prompt split over 24-token steps: later chunks attend to cached K/V."""
    engine = _engine(hf_dirs["tied"], max_num_batched_tokens=24)
    ids = _sequences(seed=3)[-1]
    _assert_close(engine.logits(ids), _ref_logits(hf_ref("tied"), ids), "chunked")


@pytest.mark.parametrize("name", list(MODELS))
def test_greedy_generation_matches_transformers(name, hf_dirs, hf_ref):
    rng = random.Random(7)
    prompts = [[rng.randrange(VOCAB_SIZE) for _ in range(n)] for n in (1, 6, 21)]
    answers = assert_greedy_matches(_engine(hf_dirs[name]), hf_ref(name), prompts, 10, PAD)
    assert len({t for ref, _ in answers for t in ref}) > 3, "degenerate model: constant output"


def test_triton_path_matches_transformers(hf_dirs, hf_ref):
    """The GPU kernels (Triton's interpreter on CPU tensors in CI) run the text decoder the
    checkpoint holds: transformers' logits, whole and chunked."""
    pytest.importorskip("triton", reason="triton is not installed")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    engine = _engine(hf_dirs["untied"], device=device, attention="triton",
                     max_num_batched_tokens=24)
    for ids in _sequences(seed=5)[:3]:
        _assert_close(engine.logits(ids), _ref_logits(hf_ref("untied"), ids), "triton")
    assert engine.pool.num_free == engine.pool.num_blocks


def _as_transformers_5_names_them(src: Path, dst: Path) -> Path:
    """The directory with its tensors under transformers 5's module names (model.
    language_model..., model.vision_tower..., lm_head), as some checkpoints store them."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    renamed = {}
    for k, v in load_file(str(src / "model.safetensors")).items():
        k = k.replace("language_model.lm_head.", "lm_head.").replace(
            "language_model.model.", "model.language_model.")
        renamed[k if k.startswith(("model.", "lm_head.")) else f"model.{k}"] = v
    save_file(renamed, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("names", ["as saved", "as transformers 5 names the modules"])
def test_only_the_text_decoders_weights_are_read(names, hf_dirs, hf_ref, monkeypatch,
                                                 tmp_path):
    """Every tensor of the text decoder, under the names the engine's models read, and no
    tensor of the vision tower or its projection is ever taken from the file (Gemma 3 4B's
    encoder is 0.4B parameters of no use to text)."""
    dirs = hf_dirs if names == "as saved" else {
        name: _as_transformers_5_names_them(hf_dirs[name], tmp_path / name) for name in MODELS}
    read: list[str] = []
    real_open = hf_dir.safe_open

    class Recording:
        def __init__(self, *args, **kwargs):
            self.file = real_open(*args, **kwargs)

        def __enter__(self):
            self.tensors = self.file.__enter__()
            return self

        def __exit__(self, *exc):
            return self.file.__exit__(*exc)

        def keys(self):
            return self.tensors.keys()

        def get_tensor(self, key: str):
            read.append(key)
            return self.tensors.get_tensor(key)

        def get_slice(self, key: str):  # (a header: the checks of shapes and types)
            return self.tensors.get_slice(key)

    monkeypatch.setattr(hf_dir, "safe_open", Recording)
    for name, tie in MODELS.items():
        read.clear()
        weights = load_model(dirs[name]).weights
        assert read and not [k for k in read if "language_model." not in k
                             and not k.startswith("lm_head.")]
        text = hf_ref(name).model.language_model.state_dict()
        want = {f"model.{k}": v for k, v in text.items()}
        if not tie:
            want["lm_head.weight"] = hf_ref(name).lm_head.weight
        assert set(weights) == set(want)
        for k, v in weights.items():
            assert torch.equal(v, want[k]), k


# Google's text_config of Gemma 3 4B, 12B and 27B (config.json as published, written by
# transformers 4.50): only what differs from Gemma3TextConfig's defaults; the end of turn
# (106) among the top level's eos ids.
PUBLISHED_TEXT_CONFIGS = {
    "4b": {"hidden_size": 2560, "intermediate_size": 10240, "num_hidden_layers": 34},
    "12b": {"hidden_size": 3840, "intermediate_size": 15360, "num_attention_heads": 16,
            "num_hidden_layers": 48, "num_key_value_heads": 8},
    "27b": {"head_dim": 128, "hidden_size": 5376, "intermediate_size": 21504,
            "num_attention_heads": 32, "num_hidden_layers": 62, "num_key_value_heads": 16,
            "query_pre_attn_scalar": 168},
}


@pytest.mark.parametrize("size", list(PUBLISHED_TEXT_CONFIGS))
def test_published_configs_read_as_transformers_reads_them(size, hf_dirs, tmp_path):
    """The keys the published configs leave out take Gemma3TextConfig's defaults (head_dim
    256 rather than hidden / heads, 131,072 positions, five sliding layers in six, RoPE
    bases 1e6 and 10,000), as in transformers; the RoPE scaling of the legacy key."""
    d = tmp_path / size
    d.mkdir()
    shutil.copy(hf_dirs["tied"] / "tokenizer.json", d)
    text = {**PUBLISHED_TEXT_CONFIGS[size], "model_type": "gemma3_text",
            "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 1024}
    (d / "config.json").write_text(json.dumps({
        "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
        "boi_token_index": 255999, "eoi_token_index": 256000, "eos_token_id": [1, 106],
        "image_token_index": 262144, "mm_tokens_per_image": 256, "text_config": text,
        "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
                          "model_type": "siglip_vision_model", "num_attention_heads": 16,
                          "num_hidden_layers": 27, "patch_size": 14,
                          "vision_use_head": False}}))
    cfg, _ = read_hf_metadata(d)
    hf = transformers.AutoConfig.from_pretrained(d)
    _assert_config_is(cfg, hf.text_config)
    assert cfg.head_dim == (128 if size == "27b" else 256)
    assert cfg.layer_windows.count(1024) == cfg.num_layers - cfg.num_layers // 6
    assert cfg.eos_token_ids == (1, 106)


def test_chat_template_and_tokenizer_are_the_directorys(hf_dirs, tmp_path):
    """The chat is rendered with the directory's template and encoded with its tokenizer, as
    transformers does, from tokenizer_config.json or, where a multimodal processor wrote it,
    chat_template.json; the end of turn stops generation (generation_config's eos ids)."""
    messages = [{"role": "user", "content": "what is the capital of france ?"},
                {"role": "assistant", "content": "paris"},
                {"role": "user", "content": "and the sky ?"}]
    hf_tok = transformers.PreTrainedTokenizerFast.from_pretrained(hf_dirs["tied"])
    rendered = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered.startswith("<bos><start_of_turn>user\nwhat")
    d = tmp_path / "processor-template"
    shutil.copytree(hf_dirs["tied"], d)
    tok_cfg = json.loads((d / "tokenizer_config.json").read_text())
    (d / "chat_template.json").write_text(json.dumps({"chat_template": tok_cfg.pop(
        "chat_template")}))
    (d / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    for path in (hf_dirs["tied"], d):
        loaded = load_model(path)
        assert loaded.tokenizer.chat_template == TEMPLATE
        assert loaded.tokenizer.apply_chat_template(messages) == rendered
        assert loaded.tokenizer.encode_chat(messages) == hf_tok(
            rendered, add_special_tokens=False)["input_ids"]
        assert loaded.config.eos_token_ids == (EOS, EOT)
