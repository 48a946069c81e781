"""CUDA graphs for decode-only steps, at bucketed batch sizes.

A decode step of a small model is a few hundred short kernels: launched one by one from
Python the host, not the GPU, sets the pace (HF generate is launch-bound; DESIGN.md "GPUs").
A graph replays the whole forward and the vocabulary projection in one launch. Each graph is
captured once, at start-up, over the persistent step buffers (step_inputs.py) laid out for its
batch size; a step of n decodes fills those buffers, pads to the next bucket with padding
sequences (no context, K/V not written) and replays. Prefill and mixed steps run eagerly.
Graphs share one memory pool, captured largest first so the smaller ones reuse its blocks.
"""

from __future__ import annotations

import bisect
import functools
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .runner import ModelRunner, _Plan
    from .sched.request import Request

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)


@functools.cache
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def attention_splits(num_seqs: int, kv_heads: int, device: torch.device,
                     max_seq_len: int) -> int:
    """Split-KV for decode steps that would leave most of the GPU's SMs idle."""
    from llmdb.kernels.gpu.attention import choose_num_splits

    return choose_num_splits(num_seqs, kv_heads, max_seq_len, _num_sms(device))


class DecodeGraph:
    def __init__(self, batch_size: int, graph: torch.cuda.CUDAGraph, logits: torch.Tensor):
        self.batch_size, self.graph, self.logits = batch_size, graph, logits

    def replay(self) -> torch.Tensor:
        self.graph.replay()
        return self.logits


class DecodeGraphs:
    def __init__(self, runner: ModelRunner, max_num_seqs: int):
        self.runner = runner
        self.sizes = [b for b in BUCKETS if b < max_num_seqs] + [max_num_seqs]
        self.graphs: dict[int, DecodeGraph] = {}
        self.pool = None

    def pick(self, scheduled: list[tuple[Request, int]], plan: _Plan) -> DecodeGraph | None:
        """The graph for this step, if it is one token per request, each sampled."""
        n = len(scheduled)
        if not self.graphs or n > self.sizes[-1] or len(plan.sample) != n:
            return None
        if plan.score or plan.choice or plan.keep or any(k != 1 for _, k in scheduled):
            return None
        return self.graphs.get(self.sizes[bisect.bisect_left(self.sizes, n)])

    @torch.inference_mode()
    def capture_all(self) -> None:
        for bs in reversed(self.sizes):
            self.graphs[bs] = self._capture(bs)
        torch.cuda.synchronize(self.runner.device)

    def _capture(self, bs: int) -> DecodeGraph:
        r = self.runner
        model = r.model
        inputs = r.buffers.fill([], [], [], [], [], [], r.block_size, pad_to=bs)
        inputs.batch.max_query_len, inputs.batch.max_seq_len = 1, model.config.max_context
        inputs.batch.num_splits = attention_splits(bs, model.config.num_kv_heads, r.device,
                                                   model.config.max_context)

        def run() -> torch.Tensor:
            return model.logits(r.forward(inputs))

        side = torch.cuda.Stream(r.device)
        side.wait_stream(torch.cuda.current_stream(r.device))
        with torch.cuda.stream(side):  # warm-up: kernels compiled, allocator primed
            run()
        torch.cuda.current_stream(r.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = run()
        self.pool = graph.pool()
        return DecodeGraph(bs, graph, logits)
