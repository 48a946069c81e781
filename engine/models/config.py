"""The few numbers the engine needs to know about a model, whatever file it came from."""

from __future__ import annotations

from dataclasses import dataclass, replace


def sliding_windows(sliding: list[bool], window: int | None, max_context: int
                    ) -> tuple[int, ...]:
    """ModelConfig.layer_windows from which layers slide and the window they share: () where
    no layer is left with a window (none given, or one not smaller than the context, which
    no query can exceed)."""
    if not window or window >= max_context or not any(sliding):
        return ()
    return tuple(window if s else 0 for s in sliding)


@dataclass(frozen=True)
class ModelConfig:
    arch: str  # "llama", "opt", "gemma2" or "gemma3"
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
    # Sliding-window attention, per layer: empty, every layer attends to its whole context;
    # else one entry a layer, 0 for the whole context and w > 0 for a query at position p
    # seeing keys p - w + 1 .. p only (transformers' `sliding_window`, llama.cpp's n_swa).
    # (The cache keeps every block of a sequence all the same: engine/cache/block_pool.py.)
    layer_windows: tuple[int, ...] = ()
    # Attention logit soft-capping (Gemma 2's attn_logit_softcapping): the scaled scores s
    # become attn_softcap * tanh(s / attn_softcap) before the softmax; 0: none.
    attn_softcap: float = 0.0
    # The attention scores' scale; None: head_dim ** -0.5 (Gemma: query_pre_attn_scalar **
    # -0.5).
    attn_scale: float | None = None
    # Gemma 2: the logits are capped as cap * tanh(logits / cap); 0: not capped.
    logit_softcap: float = 0.0
    # Gemma 3: the layers that rotate with a RoPE of their own, base rope_local_theta and
    # unscaled (its sliding-window layers, whatever their window: layer_windows is empty where
    # no window binds); the others take rope_theta and rope_divisors. Empty: one RoPE.
    rope_local_layers: tuple[int, ...] = ()
    rope_local_theta: float = 0.0
    # Layers whose Q and K take no RoPE at all (SmolLM3's NoPE layers, every fourth one):
    # their attention sees no positions but the causal mask's. Empty: every layer rotates.
    nope_layers: tuple[int, ...] = ()
    # Serving: False where the engine keeps no hidden states (LLMEngine(hidden_cache=False)),
    # so the model builds no K/V re-projection and the cache no hidden-state views.
    hidden_cache: bool = True
    # Serving: a row's result does not depend on the rows computed beside it (GPU kernels:
    # LLMEngine(batch_invariant=True); the CPU kernels always are).
    batch_invariant: bool = False

    def layer_window(self, layer: int) -> int:
        """The window of one layer (0: its whole context)."""
        return self.layer_windows[layer] if self.layer_windows else 0

    @property
    def attention_scale(self) -> float:
        return self.attn_scale if self.attn_scale is not None else self.head_dim**-0.5

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
        mlp = (2 if self.arch == "opt" else 3) * h * self.ffn_size  # gated MLP: 3 matrices
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
        if self.arch.startswith("gemma"):  # (every published Gemma is refused above)
            return False, "Gemma's K/V re-projection from hidden states is not implemented"
        if not self.hidden_cache:
            return False, "turned off (hidden_cache=False)"
        return True, (f"hidden states ({self.hidden_size} values a token and layer) take half "
                      f"the memory of K and V ({2 * kv_dim})")
