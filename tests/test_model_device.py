"""A model built for a device keeps every tensor its forward reads on that device.

CI has no GPU, so the models are built on torch's "meta" device (shapes only, no memory, no
kernels): an op that mixes in a CPU tensor fails there as it does on a GPU. Found so: with
attention="reference" on a CUDA device every step failed, the RoPE tables of that kernel
set having stayed on the CPU. The attention itself reads its batch on the host (.tolist(),
which "meta" cannot do), so a stand-in of the right shape takes its place here.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from llmdb.engine.cache.kv_cache import KVCache
from llmdb.engine.models import gemma, llama, opt
from llmdb.engine.models.loader import load_model
from llmdb.kernels.attention import AttentionBatch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from random_model import write_random_model  # noqa: E402

META = torch.device("meta")
MODELS = {"llama": (llama, llama.LlamaModel), "opt": (opt, opt.OPTModel),
          "gemma2": (gemma, gemma.GemmaModel), "gemma3": (gemma, gemma.GemmaModel)}


def _attention_stand_in(q: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    return torch.empty_like(q)


# Llama (one RoPE table), Phi-3 (LongRoPE's scaled table; its hidden cache re-projects K with
# it), Gemma 3 (a global and a local table), OPT (no RoPE).
@pytest.mark.parametrize("shape", ["tiny-llama", "tiny-phi3", "tiny-gemma3", "tiny-opt"])
def test_reference_kernels_read_nothing_off_the_models_device(tmp_path, monkeypatch, shape):
    loaded = load_model(write_random_model(shape, tmp_path / shape, dtype=torch.float32,
                                           device="cpu"))
    c = loaded.config
    module, model_cls = MODELS[c.arch]
    model = model_cls(c, loaded.weights, torch.float32, META, "reference")
    monkeypatch.setattr(module, "cpu_attention", lambda kernels: _attention_stand_in)
    block_size, t = 4, 6
    cache = KVCache(c, 4, block_size, torch.float32, META)
    batch = AttentionBatch(  # one sequence of six tokens in blocks 0 and 1
        query_start_loc=torch.tensor([0, t], dtype=torch.int32, device=META),
        seq_lens=torch.tensor([t], dtype=torch.int32, device=META),
        block_tables=torch.tensor([[0, 1]], dtype=torch.int32, device=META),
        slot_mapping=torch.arange(t, device=META), block_size=block_size, max_query_len=t,
        max_seq_len=t)
    positions = torch.arange(t, device=META)
    hidden = model.forward(torch.zeros(t, dtype=torch.long, device=META), positions, batch,
                           cache.layers)
    assert hidden.device == META and hidden.shape == (t, c.hidden_size)
    if getattr(model, "kv_projs", None):  # the hidden cache's K/V re-projection
        k, v = model.reproject_kv(0, torch.empty(t, c.hidden_size, device=META), positions)
        assert k.device == v.device == META
