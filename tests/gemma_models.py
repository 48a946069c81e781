"""Tiny random Gemma 2 and Gemma 3 models as Hugging Face directories, and the checks the
Gemma tests share (tests/test_gemma.py, tests/test_gemma_gguf.py, tests/gpu).

Their settings make every Gemma-specific piece show in the logits: norms scaled by 1 + w (the
weights are far from 0), the embedding scale, a query_pre_attn_scalar that is not head_dim,
attention and final logit caps small enough to bend the scores, sliding windows of 16 tokens
(the test sequences run to 240), Gemma 3's two RoPEs (local base 500 against a linearly
scaled global one of 10,000), its per-head Q/K norms, and one model with Gemma's real
head_dim of 256 whose window is the whole context: its local layers still take the local
RoPE.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from tokenizers import Tokenizer

from .model_builders import WORDS, assert_close, randomize, ref_logits, word_level_tokenizer

# Gemma's special tokens at Gemma's ids (pad 0, eos 1, bos 2), then its turn markers.
SPECIALS = ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"]
PAD, EOS, BOS, SOT, EOT = range(5)
VOCAB = {t: i for i, t in enumerate(SPECIALS + sorted(set(WORDS) - {"", "\n"}))}
VOCAB_SIZE = len(VOCAB)
CONTEXT = 256
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
    # Untied (tests the lm_head), alternating sliding and global layers, attention scores
    # and logits capped at 5 (Gemma 2 2B's caps are 50 and 30 on larger scores).
    "gemma2": (transformers.Gemma2ForCausalLM, lambda: _config(
        "Gemma2", query_pre_attn_scalar=24, sliding_window=16, attn_logit_softcapping=5.0,
        final_logit_softcapping=5.0, tie_word_embeddings=False)),
    # Q/K norms, a local RoPE and a linearly scaled global one (Gemma 3 4B's scheme), tied.
    "gemma3": (transformers.Gemma3ForCausalLM, lambda: _config(
        "Gemma3Text", query_pre_attn_scalar=24, sliding_window=16,
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
    return word_level_tokenizer(VOCAB, SPECIALS, unk="<pad>")


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
    randomize(model, seed)
    with torch.no_grad():
        # Gemma multiplies its embeddings by sqrt(hidden_size): divided by it here, they
        # enter at the size of the layers' normalized outputs, so that the layers matter and
        # a tied model does not just repeat its input token.
        model.get_input_embeddings().weight.div_(model.config.hidden_size**0.5)
    return model.eval()


# The names the Gemma tests imported these by before tests/model_builders.py held them.
_ref_logits, _assert_close = ref_logits, assert_close


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
    sliding = [t == "sliding_attention" for t in hf.layer_types]
    window = hf.sliding_window
    # (Empty where no window is shorter than the context: then none binds.)
    assert cfg.layer_windows == (() if window >= hf.max_position_embeddings
                                 else tuple(window if s else 0 for s in sliding))
    rope = hf.rope_parameters
    if hf.model_type == "gemma2":
        assert cfg.attn_softcap == pytest.approx(hf.attn_logit_softcapping or 0.0, rel=1e-7)
        assert (cfg.rope_theta, cfg.rope_local_theta, cfg.rope_divisors) == (
            rope["rope_theta"], 0.0, ())
    else:
        assert cfg.attn_softcap == 0.0  # (Gemma 3's attention has none)
        full, local = rope["full_attention"], rope["sliding_attention"]
        assert (cfg.rope_theta, cfg.rope_local_theta) == (full["rope_theta"],
                                                          local["rope_theta"])
        assert cfg.rope_local_layers == tuple(i for i, s in enumerate(sliding) if s)
        factor = full.get("factor", 1.0) if full["rope_type"] == "linear" else 1.0
        assert cfg.rope_divisors == (() if factor == 1.0 else (factor,) * (hf.head_dim // 2))


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
