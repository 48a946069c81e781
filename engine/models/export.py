"""Write a loaded model as a Hugging Face directory (bf16 safetensors), so that peers such as
transformers and vLLM run exactly the weights our GGUF loader produced."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders

from .config import ModelConfig
from .loader import LoadedModel

# arch or family -> (architecture, model_type) of its Hugging Face config
_HF_NAMES = {"llama": ("LlamaForCausalLM", "llama"),
             "mistral": ("MistralForCausalLM", "mistral"),
             "qwen2": ("Qwen2ForCausalLM", "qwen2"),
             "qwen3": ("Qwen3ForCausalLM", "qwen3"), "phi3": ("Phi3ForCausalLM", "phi3"),
             "smollm3": ("SmolLM3ForCausalLM", "smollm3"),
             "gemma2": ("Gemma2ForCausalLM", "gemma2"),
             "gemma3": ("Gemma3ForCausalLM", "gemma3_text")}


def export_hf(model: LoadedModel, out_dir: str | Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    c, tok = model.config, model.tokenizer
    if c.arch not in ("llama", "gemma2", "gemma3"):
        raise ValueError(f"export supports llama and gemma models, not {c.arch}")
    # Layers without RoPE: SmolLM3's architecture; fused Q/K/V: Phi-3's; per-head Q/K norms:
    # Qwen3's; Q/K/V biases: Qwen2's (a Llama without them would drop them); sliding
    # windows: Mistral's (Llama's attention ignores a sliding_window key).
    family = c.arch if c.arch != "llama" else (
        "smollm3" if c.nope_layers else
        "phi3" if "model.layers.0.self_attn.qkv_proj.weight" in model.weights else
        "qwen3" if "model.layers.0.self_attn.q_norm.weight" in model.weights else
        "qwen2" if "model.layers.0.self_attn.q_proj.bias" in model.weights else
        "mistral" if c.layer_windows else "llama")
    # RoPE in the keys transformers 4 wrote (vLLM's reads them; transformers 5 too).
    rope: dict = {"rope_theta": c.rope_theta}
    if c.rotary_dim:
        rope["partial_rotary_factor"] = c.rotary_dim / c.head_dim
    if c.rope_long_divisors:
        # Phi-3's LongRoPE, its pretrained context beside it as Phi-3's configs have it.
        rope["rope_scaling"] = {"rope_type": "longrope", "short_factor": list(c.rope_divisors),
                                "long_factor": list(c.rope_long_divisors),
                                "attention_factor": c.rope_attention_factor}
        rope["original_max_position_embeddings"] = c.rope_original_context
    elif c.rope_divisors:
        if len(set(c.rope_divisors)) > 1:  # (Llama 3's parameters are not kept, only these)
            raise ValueError("export supports linear RoPE scaling only, not per-frequency "
                             "divisors (a Llama 3.1 GGUF's rope_freqs)")
        rope["rope_scaling"] = {"rope_type": "linear", "factor": c.rope_divisors[0]}
    # (Phi-3's config class would otherwise pad with token 32000, outside small vocabularies.)
    arch_keys = (_gemma_keys(c) if c.arch != "llama" else
                 {"hidden_act": "silu", "pad_token_id": None, **_window_keys(c, family)})
    if family == "smollm3":  # (its flags: 1 rotates, 0 does not; biases are switched on)
        arch_keys.update(
            no_rope_layers=[int(i not in c.nope_layers) for i in range(c.num_layers)],
            attention_bias="model.layers.0.self_attn.q_proj.bias" in model.weights,
            mlp_bias="model.layers.0.mlp.down_proj.bias" in model.weights)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    weights = {k: v.to(dtype).contiguous() for k, v in model.weights.items()}
    if c.tie_embeddings:
        weights.pop("lm_head.weight", None)  # vLLM expects no lm_head for tied embeddings
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    architecture, model_type = _HF_NAMES[family]
    config = {
        "architectures": [architecture],
        "model_type": model_type,
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.ffn_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "max_position_embeddings": c.max_context,
        "rms_norm_eps": c.norm_eps,
        **rope,
        "tie_word_embeddings": c.tie_embeddings,
        "bos_token_id": c.bos_token_id,
        "eos_token_id": list(c.eos_token_ids),
        **arch_keys,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": c.bos_token_id, "eos_token_id": list(c.eos_token_ids)}, indent=2))
    hf_tok = tok.tokenizer
    if tok.spm_space_prefix:
        # Hugging Face's Llama tokenizer.json drops the prefix's space in its decoder (llama.cpp
        # and ModelTokenizer.decode do it outside the tokenizer).
        hf_tok = Tokenizer.from_str(hf_tok.to_str())
        hf_tok.decoder = decoders.Sequence([hf_tok.decoder, decoders.Strip(" ", 1, 0)])
    hf_tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": tok.bos_token,
        "eos_token": tok.eos_token,
        "add_bos_token": tok.add_bos,
        "chat_template": tok.chat_template,
        "model_max_length": c.max_context,
    }, indent=2))
    return out


def _window_keys(c: ModelConfig, family: str) -> dict:
    """A Llama-family model's sliding windows in the keys its config class reads (and
    hf_dir._layer_windows reads back): Qwen2, Qwen3 and SmolLM3 name each layer's kind
    (Qwen2 and Qwen3 also the first that slides: see _max_window_layers); Mistral and Phi-3
    slide every layer. One window for all, as every such config has."""
    if not c.layer_windows:
        return {}
    windows = sorted(set(c.layer_windows) - {0})
    if len(windows) > 1:
        raise ValueError(f"export writes one sliding window, not one a layer "
                         f"({', '.join(map(str, windows))})")
    if family in ("qwen2", "qwen3", "smollm3"):
        keys = {"use_sliding_window": True, "sliding_window": windows[0],
                "layer_types": ["sliding_attention" if w else "full_attention"
                                for w in c.layer_windows]}
        if family != "smollm3":
            keys["max_window_layers"] = _max_window_layers(c.layer_windows, family)
        return keys
    if 0 in c.layer_windows:
        full = [i for i, w in enumerate(c.layer_windows) if w == 0]
        raise ValueError(f"export writes a {_HF_NAMES[family][0]}, whose config slides "
                         f"every layer's window: this model attends to the whole context in "
                         f"layers {full}")
    return {"sliding_window": windows[0]}


def _max_window_layers(layer_windows: tuple[int, ...], family: str) -> int:
    """Qwen2's and Qwen3's key for the layers that slide, those from this one on: older vLLM
    reads it and not layer_types (as transformers does where layer_types is missing), and
    its default, 28, slides the wrong layers (none of a shorter model)."""
    first = next(i for i, w in enumerate(layer_windows) if w)
    full = [i for i, w in enumerate(layer_windows) if i > first and w == 0]
    if full:
        raise ValueError(f"export writes a {_HF_NAMES[family][0]}, whose max_window_layers "
                         f"slides every layer from the first that slides ({first}) on: this "
                         f"model attends to the whole context in layers {full}")
    return first


def _gemma_keys(c: ModelConfig) -> dict:
    """What a Gemma config says beyond Llama's (see gemma.py), in the keys of Google's
    config.json files; the layers' kinds as transformers >= 4.53 and vLLM read them. (A
    window no query can exceed is written as the context: layer_windows has none then, but
    Gemma 3's local layers still take their own RoPE.)"""
    scalar = c.attention_scale**-2  # query_pre_attn_scalar: an integer in every config
    windows = c.layer_windows or (0,) * c.num_layers
    sliding = [w > 0 or i in c.rope_local_layers for i, w in enumerate(windows)]
    keys = {
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": round(scalar) if abs(scalar - round(scalar)) < 1e-6 else scalar,
        "sliding_window": max(windows) or c.max_context,
        "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
        "final_logit_softcapping": c.logit_softcap or None,
        "attn_logit_softcapping": c.attn_softcap or None,
    }
    if c.arch == "gemma3":
        keys["rope_local_base_freq"] = c.rope_local_theta
    return keys
