"""Turns a scheduled batch into tensors, runs the model, samples and scores.

The engine hands the runner (request, tokens) pairs and gets back host values only: the
token sampled for each generating request whose tokens are all computed, and the numbers
scoring requests asked for. All tensor work, logits, sampling, log-probabilities, happens
here on the engine's device, and the results come to the host in one copy per step.
Decode steps and small mixed steps on CUDA replay a captured graph (cuda_graphs.py).
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from llmdb.kernels.attention import write_kv
from llmdb.kernels.hidden_cache import HiddenBatch, hidden_rows
from llmdb.kernels.transfer import to_device

from .cache.kv_cache import KVCache
from .cuda_graphs import StepGraphs, attention_splits
from .models.hidden_attention import hidden_io
from .sampling import log_softmax, row_key, sample, top_logprobs
from .sched.request import PENDING_TOKEN, Request
from .step_inputs import StepBuffers, StepInputs


@dataclass
class StepOutput:
    """What one step produced, per request id, as host values."""

    sampled: dict[str, int] = field(default_factory=dict)
    # Per sampled token with params.logprobs: (its log-probability, {id: logprob} of top k).
    logprobs: dict[str, tuple[float, dict[int, float]]] = field(default_factory=dict)
    # Scoring requests: log-probabilities of their next tokens at the positions computed now.
    target_logprobs: dict[str, list[float]] = field(default_factory=dict)
    # Choice requests: log-probabilities of their candidate ids after the prompt.
    candidate_logprobs: dict[str, list[float]] = field(default_factory=dict)
    # keep_logits requests: their fp32 logit rows of this step, on the CPU.
    logit_rows: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass
class _Plan:
    """Which logit rows each request needs, in the order of the logit tensor."""

    rows: list[int] = field(default_factory=list)
    sample: list[tuple[Request, int]] = field(default_factory=list)  # (request, logit row)
    score: list[tuple[Request, int, list[int]]] = field(default_factory=list)  # rows, targets
    choice: list[tuple[Request, int]] = field(default_factory=list)
    keep: list[tuple[Request, int, int]] = field(default_factory=list)  # first row, count
    logprobs_k: int | None = None  # the most top log-probabilities a sampled request asked for


@dataclass
class LaunchedStep:
    """A step launched on the device whose results have not been read yet."""

    plan: _Plan
    values: torch.Tensor | None = None  # fp64 results on the host (arriving, on a GPU)
    keep: list[tuple[str, torch.Tensor]] = field(default_factory=list)  # keep_logits rows
    tokens: torch.Tensor | None = None  # the sampled ids, on the device
    done: torch.cuda.Event | None = None  # recorded after the copy to the host (GPU only)
    started: torch.cuda.Event | None = None
    kind: str = "eager"  # or "graph" (a captured decode step), "mixed graph"

    @functools.cached_property
    def sample_index(self) -> dict[str, int]:
        """Request id -> its row of tokens (built when the next launch has pending tokens)."""
        return {r.request_id: i for i, (r, _) in enumerate(self.plan.sample)}


class ModelRunner:
    def __init__(self, model, kv_cache: KVCache, block_size: int, device: torch.device,
                 max_num_batched_tokens: int, max_num_seqs: int, max_context: int,
                 cuda_graphs: bool = True):
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.device = device
        # Whole-prompt policies run a prompt longer than the token budget alone: the buffers
        # take any step up to the model's context (a few MB).
        self.buffers = StepBuffers(device, max(max_num_batched_tokens, max_context) + max_num_seqs,
                                   max_num_seqs, -(-max_context // block_size))
        self.graphs = (StepGraphs(self, max_num_seqs)
                       if cuda_graphs and device.type == "cuda" else None)
        self.steps = 0
        self.last_wait_s = 0.0  # the last collect's wait for the device (its one sync)
        # The GPU's idle time between steps: the host work no launch ahead covered.
        self.device_idle_s = 0.0
        self._last_done: torch.cuda.Event | None = None
        self._copy_stream: torch.cuda.Stream | None = None  # (keep_logits rows, GPU only)
        self._last = LaunchedStep(_Plan())  # the last launch: pending tokens come from it

    def capture_graphs(self) -> None:
        if self.graphs is not None:
            self.graphs.capture_all()

    @torch.inference_mode()
    def forward(self, inputs: StepInputs) -> torch.Tensor:
        """Final hidden states [T, hidden] of the packed tokens."""
        if inputs.hidden is None:
            return self.model.forward(inputs.input_ids, inputs.positions, inputs.batch,
                                      self.kv_cache.layers)
        return self.model.forward(inputs.input_ids, inputs.positions, inputs.batch,
                                  self.kv_cache.layers, inputs.hidden, self.kv_cache.hidden)

    @torch.inference_mode()
    def convert_to_kv(self, converted: list[tuple[Request, list[int], int]]) -> None:
        """K/V projected from the hidden states in the old blocks of requests switched to the
        KV cache (Scheduler.convert_to_kv), written into their new blocks: one gather and one
        projection per layer for all of them."""
        bs = self.block_size
        rows, slots, positions = [], [], []
        for req, old_units, first in converted:
            pos = np.arange(first, req.num_computed, dtype=np.int64)
            rows.append(hidden_rows(old_units, pos - first, bs))
            table = np.asarray(req.block_ids, dtype=np.int64)
            slots.append(table[pos // bs] * bs + pos % bs)
            positions.append(pos)
        rows_t, slots_t, pos_t = (to_device(np.concatenate(x), self.device)
                                  for x in (rows, slots, positions))
        gather_hidden = hidden_io(self.model.kernels == "triton")[1]
        for layer, (store, (k_cache, v_cache)) in enumerate(
                zip(self.kv_cache.hidden, self.kv_cache.layers, strict=True)):
            k, v = self.model.reproject_kv(layer, gather_hidden(store, rows_t), pos_t)
            write_kv(k_cache, v_cache, k, v, slots_t)

    def execute(self, scheduled: list[tuple[Request, int]],
                converted: list[tuple[Request, list[int], int]] = ()) -> StepOutput:
        """Run one step and read its results (launch, then collect)."""
        return self.collect(self.launch(scheduled, converted))

    @torch.inference_mode()
    def launch(self, scheduled: list[tuple[Request, int]],
               converted: list[tuple[Request, list[int], int]] = ()) -> LaunchedStep:
        """Start one step (after the KV conversions the scheduler decided, if any): on a GPU
        everything is queued and this returns at once. A token still pending on the host
        (PENDING_TOKEN) is the previous launch's sample, taken on the device."""
        started = self._event()
        if converted:
            self.convert_to_kv(converted)
        if not scheduled:
            return LaunchedStep(_Plan(), started=started)
        hidden = [x for x in scheduled if x[0].cache_type == "hidden"]
        if hidden:
            if not self.kv_cache.hidden:
                raise ValueError("a hidden-cache request for a model without a hidden cache")
            # KV-cache sequences first: the attention batch is a prefix of the step.
            scheduled = [x for x in scheduled if x[0].cache_type != "hidden"] + hidden
        num_kv = len(scheduled) - len(hidden)
        ids, starts, plan = [], [], _Plan()
        pending_rows, pending_from = [], []
        base = 0
        prev = self._last
        for req, n in scheduled:
            start = req.num_computed
            out = req.output_ids
            if n == 1 and out and start == len(req.prompt_ids) + len(out) - 1:
                # A decode (its last token; every step's common case, kept short)
                last = out[-1]
                ids.append(last)
                if last == PENDING_TOKEN:
                    pending_rows.append(base)
                    pending_from.append(prev.sample_index[req.request_id])
                plan.sample.append((req, len(plan.rows)))
                plan.rows.append(base)
            else:
                ids += req.token_slice(start, n)
                if start + n == req.num_tokens and out and out[-1] == PENDING_TOKEN:
                    pending_rows.append(base + n - 1)
                    pending_from.append(prev.sample_index[req.request_id])
                self._plan_rows(plan, req, start, n, base)
            starts.append(start)
            base += n
        qlens = [n for _, n in scheduled]
        tables = [req.block_ids for req, _ in scheduled]
        owners = [req.request_id for req, _ in scheduled]
        pending = (prev.tokens, pending_rows, pending_from) if pending_rows else None
        graph = (self.graphs.pick(scheduled, plan, base)
                 if self.graphs is not None and num_kv == len(scheduled) else None)
        if graph is not None:
            self.graphs.fill(graph, ids, qlens, starts, owners, tables, plan.rows, pending)
            logits = graph.replay()[: len(plan.rows)]
        else:
            inputs = self.buffers.fill(ids, qlens, starts, owners, tables, plan.rows,
                                       self.block_size, num_kv_seqs=num_kv, pending=pending)
            if num_kv < len(scheduled):
                hidden_qlens = qlens[num_kv:]
                inputs.hidden = HiddenBatch.build(
                    sum(qlens[:num_kv]), hidden_qlens,
                    [a + q for a, q in zip(starts[num_kv:], hidden_qlens, strict=True)],
                    tables[num_kv:], self.block_size, self.device,
                    [req.num_kv_prefix for req, _ in scheduled[num_kv:]])
            if self.device.type == "cuda" and inputs.batch.max_query_len == 1:
                inputs.batch.num_splits = attention_splits(
                    len(scheduled), self.model.config.num_kv_heads, self.device,
                    inputs.batch.max_seq_len)
            hidden = self.forward(inputs)
            logits = (self.model.logits(hidden.index_select(0, inputs.logit_rows))
                      if plan.rows else None)
        step = self._results_to_host(logits, plan)
        step.started = started
        if graph is not None:
            step.kind = "mixed graph" if graph.rows else "graph"
        self._last = step
        self.steps += 1
        return step

    @staticmethod
    def _plan_rows(plan: _Plan, req: Request, start: int, n: int, base: int) -> None:
        if req.logits_from is not None:
            first = max(start, req.logits_from)
            if first >= start + n:
                return
            row0, count = len(plan.rows), start + n - first
            plan.rows.extend(range(base + first - start, base + n))
            if req.keep_logits:
                plan.keep.append((req, row0, count))
            elif req.candidate_ids is not None:  # only the last prompt position is asked for
                plan.choice.append((req, row0 + count - 1))
            else:
                tk = req.token_ids
                targets = [tk[p + 1] for p in range(first, first + count) if p + 1 < len(tk)]
                plan.score.append((req, row0, targets))
        elif req.generate and start + n == req.num_tokens:
            plan.sample.append((req, len(plan.rows)))
            plan.rows.append(base + n - 1)

    def _results_to_host(self, logits: torch.Tensor | None, plan: _Plan) -> LaunchedStep:
        """Samples and scores on the device, and one copy of all of them to the host, started
        (on a GPU into pinned memory, not waited for)."""
        if logits is None:
            return LaunchedStep(plan)
        parts, tokens = self._device_results(logits, plan,
                                             self.model.config.batch_invariant)
        values = None if not parts else parts[0] if len(parts) == 1 else torch.cat(parts)
        if values is not None and values.device.type != "cpu":
            host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            values = host.copy_(values, non_blocking=True)
        keep = [(req.request_id, logits[row0 : row0 + count].float())
                for req, row0, count in plan.keep]
        return LaunchedStep(plan, values, keep, tokens, done=self._event())

    def collect(self, step: LaunchedStep) -> StepOutput:
        """Wait for a launched step and read its results: the step's one device sync."""
        t_wait = time.perf_counter()
        if step.done is not None:
            step.done.synchronize()
            if step.started is not None and self._last_done is not None:
                self.device_idle_s += self._last_done.elapsed_time(step.started) / 1e3
            self._last_done = step.done
        values = step.values.tolist() if step.values is not None else []
        keep = {rid: self._read_rows(rows) for rid, rows in step.keep}
        step.keep = []  # (the next launch still reads this step's sampled ids)
        if step is self._last:
            # Read, its samples become the requests' tokens: no launch takes one from the
            # device any more. Kept, its plan held the step's requests and what their
            # callbacks hold (a finished query's batch, rows, cache file) until the next.
            self._last = LaunchedStep(_Plan())
        self.last_wait_s = time.perf_counter() - t_wait
        out = _unpack(values, step.plan)
        out.logit_rows = keep
        return out

    def _read_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """keep_logits rows of a step already done, to the host. On a GPU through a stream
        of their own: on the step's stream the copy would also wait for the step launched
        after it. (Not copied at launch into pinned memory like `values`: a scoring
        request's rows of a long prompt can be gigabytes.)"""
        if rows.device.type != "cuda":
            return rows
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(rows.device)
        with torch.cuda.stream(self._copy_stream):
            return rows.cpu()

    def _event(self) -> torch.cuda.Event | None:
        """A timed event on the device's stream (None on the CPU, where steps run inline)."""
        if self.device.type != "cuda":
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    @staticmethod
    def _device_results(logits: torch.Tensor, plan: _Plan, invariant: bool = False
                        ) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """fp64 vectors in _unpack's order: sampled ids; with logprobs the chosen ones' and
        the top k's values and ids; scoring targets' log-probs; candidates' log-probs. And
        the sampled ids as they are (in plan.sample order), or None. invariant: the model's
        batch-invariant mode, for the sampler's and log-softmax's reductions (sampling.py)."""
        dev = logits.device
        parts: list[torch.Tensor] = []
        tokens = None
        if plan.sample:
            reqs = [r for r, _ in plan.sample]
            if len(plan.sample) == len(plan.rows) == logits.shape[0]:
                picked = logits  # every logit row is sampled, in order
            else:
                picked = logits[to_device([i for _, i in plan.sample], dev)]
            drawn = [i for i, r in enumerate(reqs) if r.params.temperature]  # not greedy
            drawn_reqs = [reqs[i] for i in drawn]
            tokens = sample(picked, drawn, [r.params for r in drawn_reqs],
                            [row_key(r.seed, len(r.output_ids)) for r in drawn_reqs], invariant)
            parts.append(tokens.double())
            wanted = [r.params.logprobs for r in reqs]
            if wanted.count(None) < len(wanted):
                ks = [x or 0 for x in wanted]
                plan.logprobs_k = max(ks)
                chosen, top_v, top_i = top_logprobs(picked, tokens, ks, invariant)
                parts += [chosen.double(), top_v.double().flatten(), top_i.double().flatten()]
        rows = [row0 + j for _, row0, tg in plan.score for j in range(len(tg))]
        if rows:
            lp = log_softmax(logits[to_device(rows, dev)], invariant)
            targets = to_device([t for _, _, tg in plan.score for t in tg], dev)
            parts.append(lp.gather(1, targets[:, None])[:, 0].double())
        if plan.choice:
            lp = log_softmax(logits[to_device([i for _, i in plan.choice], dev)], invariant)
            cands = [r.candidate_ids for r, _ in plan.choice]
            width = max(map(len, cands))
            idx = to_device([c + [0] * (width - len(c)) for c in cands], dev)
            parts.append(lp.gather(1, idx).double().flatten())
        return parts, tokens


def _unpack(values: list[float], plan: _Plan) -> StepOutput:
    """The host side of ModelRunner._device_results: the same order, read back."""
    n = pos = len(plan.sample)
    out = StepOutput(dict(zip([r.request_id for r, _ in plan.sample], map(int, values[:n]),
                              strict=True)))
    if plan.logprobs_k is not None:
        k = plan.logprobs_k
        chosen = values[pos : pos + n]
        top_v = values[pos + n : pos + n + n * k]
        top_i = values[pos + n + n * k : pos + n + 2 * n * k]
        pos += n + 2 * n * k
        for j, (req, _) in enumerate(plan.sample):
            if req.params.logprobs is not None:
                top = {int(top_i[j * k + m]): top_v[j * k + m] for m in range(req.params.logprobs)}
                out.logprobs[req.request_id] = (chosen[j], top)
    for req, _, targets in plan.score:
        out.target_logprobs[req.request_id] = values[pos : pos + len(targets)]
        pos += len(targets)
    if plan.choice:
        width = max(len(r.candidate_ids) for r, _ in plan.choice)
        for req, _ in plan.choice:
            out.candidate_logprobs[req.request_id] = values[pos : pos + len(req.candidate_ids)]
            pos += width
    return out
