"""Triton kernels for the engine's GPU path.

- attention: `paged_attention`, one launch per step over the varlen `AttentionBatch` layout
  (prefill chunks and decodes together, optional split-KV), and `choose_num_splits`.
- cache_write: `rope_and_write_kv`, RoPE on Q and K fused with the KV-cache write.
- norm: `rms_norm`, `add_rms_norm` (residual add fused into the norm), `silu_mul`.

The modules import triton; this package does not, so importing it is free on machines
without one. CI runs the kernels under TRITON_INTERPRET=1 on CPU tensors.
"""
