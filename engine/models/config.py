"""The few numbers the engine needs to know about a model, whatever file it came from."""

from __future__ import annotations

from dataclasses import dataclass, replace


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
    # The first rotary_dim dimensions of each head rotate, the rest pass (0: all of them;
    # Phi-4-mini rotates 96 of 128).
    rotary_dim: int = 0
    # One divisor per rotary frequency where the model extends its context by rescaling
    # them (linear, Llama 3's scheme: see rope.py); empty: unscaled.
    rope_divisors: tuple[float, ...] = ()
    # LongRoPE (rope.py): the divisors for contexts longer than rope_original_context (then
    # rope_divisors are its short ones), and the factor on cos and sin.
    rope_long_divisors: tuple[float, ...] = ()
    rope_original_context: int = 0
    rope_attention_factor: float = 1.0
    tie_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    position_offset: int = 0  # OPT only: learned positions start at this offset
    norm_before: bool = True

    def serving(self, max_context: int | None = None) -> ModelConfig:
        """This config for an engine that serves sequences of at most max_context tokens
        (None: the model's context; a LongRoPE model's pretrained one, see rope.py)."""
        if max_context is None:
            return self.serving(self.rope_original_context if self.rope_long_divisors
                                else self.max_context)
        if not 0 < max_context <= self.max_context:
            raise ValueError(f"max_context {max_context:,} is not within the model's context "
                             f"(1 to {self.max_context:,})")
        return replace(self, max_context=max_context)

    def served_rope(self) -> tuple[tuple[float, ...], float]:
        """(the divisor of each rotary frequency, the factor on cos and sin) for the context
        this config serves: LongRoPE's long set only past its pretrained context."""
        long = self.rope_long_divisors and self.max_context > self.rope_original_context
        return (self.rope_long_divisors if long else self.rope_divisors,
                self.rope_attention_factor)

    @property
    def kv_elems_per_token(self) -> int:
        """Elements of K plus V per token over all layers (times the dtype's size: bytes)."""
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

    def hidden_cache_support(self) -> tuple[bool, str]:
        """Can the engine keep this model's hidden states instead of K/V (Apt-Serve), and
        does that save memory? With the reason, for describe().

        A hidden-state row (hidden_size values) is stored in one K or V slot (kv_heads x
        head_dim values), so a block holds 2 x block_size tokens as hidden states instead of
        block_size as K/V: half the memory per token, where the row fits a slot. That is
        every MHA model (OPT, GPT-2, Llama-2-7B/13B: hidden_size = kv_heads x head_dim). GQA
        models (SmolLM2, Llama-3) have hidden states larger than a token's K and V together:
        re-projecting them would cost memory, not save it."""
        kv_dim = self.num_kv_heads * self.head_dim
        if self.hidden_size >= 2 * kv_dim:
            return False, (f"hidden states ({self.hidden_size} values a token and layer) are "
                           f"not smaller than K and V ({2 * kv_dim})")
        if self.hidden_size > kv_dim:
            return False, (f"hidden states ({self.hidden_size}) do not fit one K/V slot "
                           f"({kv_dim})")
        return True, (f"hidden states ({self.hidden_size} values a token and layer) take half "
                      f"the memory of K and V ({2 * kv_dim})")
