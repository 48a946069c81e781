"""A checkpoint's tensors as the decoders (llama.py, gemma.py, opt.py) take them: each on the
model's device, in its dtype, when the model asks for it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmdb.kernels.linear import Linear, linear

from .errors import ModelLoadError


@dataclass(frozen=True)
class Checkpoint:
    """tensors: HF names and layout, as the loader read them (as stored from an HF directory,
    fp32 from a GGUF). A model keeps what this hands out (the loader's own tensor where its
    device and dtype are the model's already), never this: the rest is freed with the
    loader's dict."""

    tensors: dict[str, torch.Tensor]
    dtype: torch.dtype
    device: torch.device

    def __call__(self, name: str) -> torch.Tensor:
        tensor = self.tensors.get(name)
        if tensor is None:  # (a truncated file, or an untied model saved without its head)
            raise ModelLoadError(f"the weights have no tensor {name!r}, which the "
                                 "model's config needs")
        return tensor.to(self.device, self.dtype).contiguous()

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def get(self, name: str) -> torch.Tensor | None:
        """A tensor some checkpoints lack (OPT-350m's projections), or None."""
        return self(name) if name in self else None

    def fused(self, names: list[str], stored_as: str | None = None
              ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The weights of projections that share an input, concatenated (one GEMM instead of
        several), and their biases so concatenated, or None where the checkpoint has none
        (Llama; Qwen2 has them on Q, K and V). stored_as: the name under which a checkpoint
        may hold them concatenated already (Phi-3's qkv_proj and gate_up_proj)."""
        if stored_as is not None and stored_as + ".weight" in self:
            names = [stored_as]
        weight = (self(names[0] + ".weight") if len(names) == 1
                  else torch.cat([self(n + ".weight") for n in names]))
        if names[0] + ".bias" not in self:
            return weight, None
        return weight, torch.cat([self(n + ".bias") for n in names])


def kv_projection(qkv: torch.Tensor, bias: torch.Tensor | None, q_rows: int,
                  batch_invariant: bool = False) -> Linear:
    """K and V alone from a fused QKV projection's weight and bias (rows q_rows on), for
    re-projecting hidden-cache states (a view of the weight, except on the CPU where packing
    copies it)."""
    return linear(qkv[q_rows:], None if bias is None else bias[q_rows:],
                  batch_invariant=batch_invariant)
