"""The few numbers the engine needs to know about a model, whatever file it came from."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ModelConfig:
    arch: str  # "llama" or "opt"
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_size: int
    max_context: int
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # OPT only: learned positions start at this offset; projection around the decoder stack.
    position_offset: int = 0
    word_embed_proj_dim: int | None = None
    norm_before: bool = True
    extra: dict = field(default_factory=dict, compare=False)

    @property
    def kv_bytes_per_token(self) -> int:
        """Elements of K plus V per token over all layers (multiply by the dtype size)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim

    @property
    def layer_params(self) -> int:
        """Weights of one layer's linear maps (Q, K, V, O, MLP); norms and biases are noise."""
        h, q = self.hidden_size, self.num_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        mlp = (3 if self.arch == "llama" else 2) * h * self.ffn_size  # gated MLP: 3 matrices
        return h * q + 2 * h * kv + q * h + mlp

    @property
    def params(self) -> int:
        embeddings = self.vocab_size * self.hidden_size * (1 if self.tie_embeddings else 2)
        return self.num_layers * self.layer_params + embeddings

    @property
    def hidden_elems_per_token(self) -> int:
        """Elements of the layer-input hidden states per token over all layers."""
        return self.num_layers * self.hidden_size
