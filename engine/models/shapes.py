"""The shapes a Llama-style or Gemma decoder's tensors must have, from its config.

A checkpoint whose tensors disagree with its config.json (a layer edited by hand, a config
from another size of the model) failed in torch.cat while the model was built, naming no
tensor; an embedding table shorter than the vocabulary did not fail at all until a row's
token fell past its end. Checked with the metadata (safetensors headers, GGUF tensor
infos), so when a model is registered and before a load reads its weights."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from .config import ModelConfig
from .errors import ModelLoadError

# Norms of the hidden state (Llama's two a layer; Gemma's four).
_LAYER_NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                "post_feedforward_layernorm")


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF name -> shape, for every tensor a checkpoint of this config may hold, in either
    layout (q/k/v_proj or Phi-3's fused qkv_proj). OPT's (projected embeddings) are not
    listed."""
    c = config
    if c.arch == "opt":
        return {}
    h, f, d = c.hidden_size, c.ffn_size, c.head_dim
    q, kv = c.num_heads * d, c.num_kv_heads * d
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (c.vocab_size, h), "lm_head.weight": (c.vocab_size, h),
        "model.norm.weight": (h,)}
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "self_attn.q_proj.weight": (q, h), p + "self_attn.q_proj.bias": (q,),
            p + "self_attn.k_proj.weight": (kv, h), p + "self_attn.k_proj.bias": (kv,),
            p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.v_proj.bias": (kv,),
            p + "self_attn.qkv_proj.weight": (q + 2 * kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,),
            p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h),
            p + "mlp.gate_up_proj.weight": (2 * f, h), p + "mlp.down_proj.weight": (h, f),
            **{p + f"{n}.weight": (h,) for n in _LAYER_NORMS},
        })
    return shapes


def check_shapes(shapes: Mapping[str, Sequence[int]], config: ModelConfig) -> None:
    """Raises ModelLoadError naming the first tensor whose shape is not its config's."""
    for name, want in expected_shapes(config).items():
        got = shapes.get(name)
        if got is not None and tuple(got) != want:
            raise ModelLoadError(f"tensor {name!r} has shape {list(got)}, but the model's "
                                 f"config gives {list(want)} (hidden size {config.hidden_size}, "
                                 f"{config.num_heads} heads of {config.head_dim}, "
                                 f"{config.num_kv_heads} KV heads, FFN {config.ffn_size}, "
                                 f"vocabulary {config.vocab_size})")
