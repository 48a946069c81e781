"""CUDA graphs for decode steps and for mixed steps, at bucketed sizes.

A step of a small model is a few hundred short kernels: launched one by one from Python the
host, not the GPU, sets the pace (HF generate is launch-bound; DESIGN.md "GPUs"). A graph
replays the whole forward and the vocabulary projection in one launch, over the persistent
step buffers (step_inputs.py), whose layout for a given size it bakes in.

- Decode graphs, one per batch-size bucket, captured at start-up: a step of n decodes fills
  the buffers and pads to the bucket with padding sequences (one token, no context, K/V not
  written).
- Mixed graphs, one per token-count bucket, captured when a step first needs one: prefill
  chunks among decodes. That is every step of a SQL job whose rows outnumber the running
  slots (rows end and new ones start each step; bench/RESULTS.md counts 79% of them), which
  would otherwise run eagerly, a launch per kernel. The step pads its tokens to the bucket
  (rows past the last sequence, which attention gives zeros) and its sequences to a fixed
  count with empty ones; its logit rows are gathered inside the graph from a padded list.
  The attention kernel's grid depends only on the token and sequence counts
  (kernels/gpu/attention.py), so one graph serves every mix of lengths.

Steps with hidden-cache sequences or scores, and prefills larger than the largest bucket
(compute-bound: a launch per kernel costs them little), run eagerly. Graphs share one memory
pool; the decode graphs are captured largest first so the smaller ones reuse its blocks. They
share one logits buffer too, of max_num_seqs rows, each writing its first rows: a graph's own
output would stay allocated in the pool, one [rows, vocab] tensor per graph: for Llama-3.2-1B
at 512 slots 0.75 GB for the decode graphs and up to 1.1 GB more for the mixed ones, where one
shared buffer takes 0.13 GB. Sharing is safe because steps
run in one stream's order: a step's sampling reads its logits before the next step replays. A
mixed graph that fails to capture (out of memory, say) turns mixed graphs off with a warning:
those steps run eagerly, as they did before.
"""

from __future__ import annotations

import bisect
import functools
import time
import warnings
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .runner import ModelRunner, _Plan
    from .sched.request import Request
    from .step_inputs import StepInputs

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)
# Tokens of a mixed step. Steps of a job at 512 running slots hold ~700 tokens (512 decodes
# and the prompts of the rows that replace the finished ones); the padding wasted is at most
# one 256-token step above 512.
MIXED_BUCKETS = (64, 128, 256, 384, 512, 768, 1024, 1280, 1536, 1792, 2048)


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1  # (graphs emulated on the CPU in tests: no split)
    return torch.cuda.get_device_properties(device).multi_processor_count


def attention_splits(num_seqs: int, kv_heads: int, device: torch.device,
                     max_seq_len: int) -> int:
    """Split-KV for decode steps that would leave most of the GPU's SMs idle."""
    from llmdb.kernels.gpu.attention import choose_num_splits

    return choose_num_splits(num_seqs, kv_heads, max_seq_len, _num_sms(device))


class StepGraph:
    """A captured step: `tokens` and `seqs` are the sizes its buffers are laid out for,
    `rows` the logit rows it gathers (0: one per sequence, in order)."""

    def __init__(self, tokens: int, seqs: int, rows: int, replay, logits: torch.Tensor):
        self.tokens, self.seqs, self.rows = tokens, seqs, rows
        self._replay, self.logits = replay, logits

    def replay(self) -> torch.Tensor:
        self._replay()
        return self.logits


class StepGraphs:
    def __init__(self, runner: ModelRunner, max_num_seqs: int, emulate: bool = False):
        """emulate (tests on the CPU): a "graph" runs its forward over the padded buffers
        when replayed, so everything but the capture itself can be checked without a GPU."""
        self.runner = runner
        self.max_num_seqs = max_num_seqs
        self.sizes = [b for b in BUCKETS if b < max_num_seqs] + [max_num_seqs]
        limit = runner.buffers.max_tokens
        self.mixed_sizes = [b for b in MIXED_BUCKETS if b <= limit]
        self.graphs: dict[int, StepGraph] = {}  # decode graphs by batch size
        self.mixed: dict[int, StepGraph] = {}  # mixed graphs by tokens
        self.mixed_on = True
        self.capture_s = 0.0  # spent capturing mixed graphs while serving
        self.emulate = emulate
        if emulate:
            runner.buffers.fix_table_stride()
        self.pool = None
        self.logits_out: torch.Tensor | None = None  # every graph's logit rows

    def pick(self, scheduled: list[tuple[Request, int]], plan: _Plan,
             num_tokens: int) -> StepGraph | None:
        """The graph for this step: each request samples at most its last row and scores
        nothing; decodes only, or few enough tokens for a mixed bucket."""
        n = len(scheduled)
        if plan.score or plan.choice or plan.keep or len(plan.sample) != len(plan.rows):
            return None
        if num_tokens == n:  # decodes only
            if n > self.sizes[-1] or len(plan.sample) != n:
                return None
            return self.graphs.get(self.sizes[bisect.bisect_left(self.sizes, n)])
        if not (self.mixed_on and self.mixed_sizes) or num_tokens > self.mixed_sizes[-1]:
            return None
        tokens = self.mixed_sizes[bisect.bisect_left(self.mixed_sizes, num_tokens)]
        if tokens not in self.mixed:
            self._capture_mixed(tokens)
        return self.mixed.get(tokens)

    def fill(self, graph: StepGraph, ids: list[int], qlens: list[int], starts: list[int],
             owners: list[str], tables: list[list[int]], rows: list[int],
             pending) -> StepInputs:
        """The step's inputs, laid out as the graph was captured over."""
        r = self.runner
        if not graph.rows:  # a decode graph: every sequence's one token is sampled
            return r.buffers.fill(ids, qlens, starts, owners, tables, [], r.block_size,
                                  pad_to=graph.seqs, pending=pending)
        return r.buffers.fill(ids, qlens, starts, owners, tables,
                              rows + [0] * (graph.rows - len(rows)), r.block_size,
                              pad_to=graph.seqs, pending=pending, pad_tokens=graph.tokens)

    def capture_all(self) -> None:
        """The decode graphs (mixed ones are captured when first needed)."""
        for bs in reversed(self.sizes):
            self.graphs[bs] = self._capture(bs, bs, 0)
        if not self.emulate:
            torch.cuda.synchronize(self.runner.device)

    def _capture_mixed(self, tokens: int) -> None:
        t0 = time.perf_counter()
        try:
            if not self.emulate:  # steps in flight use the buffers the capture fills
                torch.cuda.synchronize(self.runner.device)
            seqs = min(tokens, self.max_num_seqs)
            self.mixed[tokens] = self._capture(tokens, seqs, seqs)
        except Exception as e:  # noqa: BLE001 (any failure: eager steps still work)
            self.mixed_on = False
            if not self.emulate:  # a capture that failed at its end leaves its stream on
                torch.cuda.set_stream(torch.cuda.default_stream(self.runner.device))
                torch.cuda.synchronize(self.runner.device)
            warnings.warn(f"a CUDA graph for mixed steps of {tokens} tokens failed to capture "
                          f"({type(e).__name__}: {e}); such steps run eagerly", stacklevel=2)
        self.capture_s += time.perf_counter() - t0

    @torch.inference_mode()
    def _capture(self, tokens: int, seqs: int, rows: int) -> StepGraph:
        r = self.runner
        model = r.model
        pad_tokens = tokens if rows else None
        inputs = r.buffers.fill([], [], [], [], [], [0] * rows, r.block_size, pad_to=seqs,
                                pad_tokens=pad_tokens)
        decode = not rows
        # Only the attention tile follows max_query_len: decodes' short one, or prefills'.
        inputs.batch.max_query_len = 1 if decode else tokens
        inputs.batch.max_seq_len = model.config.max_context
        inputs.batch.num_splits = (attention_splits(seqs, model.config.num_kv_heads, r.device,
                                                    model.config.max_context)
                                   if decode else 1)
        if self.logits_out is None:  # (outside the graphs' pool: allocated once, never freed)
            self.logits_out = torch.empty(self.max_num_seqs, model.lm_head.out_features,
                                          dtype=model.dtype, device=r.device)
        out = self.logits_out[: rows or seqs]

        def run() -> None:
            hidden = r.forward(inputs)
            model.logits(hidden if decode else hidden.index_select(0, inputs.logit_rows), out)

        if self.emulate:
            run()
            return StepGraph(tokens, seqs, rows, run, out)
        return StepGraph(tokens, seqs, rows, self._record(run), out)

    def _record(self, run):
        """The captured graph's replay."""
        device = self.runner.device
        with torch.cuda.device(device):  # (an engine on cuda:1 captures on cuda:1)
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):  # warm-up: kernels compiled, allocator primed
                run()
            torch.cuda.current_stream(device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            # thread_local: a capture made while serving is not spoiled by another thread's
            # CUDA call (the server's threads make none, but a user's may). stream: torch's
            # default capture stream is one per process, made on the device current at the
            # first capture, so a second engine on another GPU would capture on the first's.
            with torch.cuda.graph(graph, pool=self.pool, stream=side,
                                  capture_error_mode="thread_local"):
                run()
        self.pool = graph.pool()
        return graph.replay
