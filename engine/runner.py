"""Turns a scheduled batch into tensors, runs the model and returns the logits it needs."""

from __future__ import annotations

import torch

from llmdb.kernels.attention import AttentionBatch, paged_attention, paged_attention_reference

from .cache.block_pool import KVCache
from .sched.request import Request


class ModelRunner:
    def __init__(self, model, kv_cache: KVCache, block_size: int, attention: str = "fast"):
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.attention = {"fast": paged_attention, "reference": paged_attention_reference}[
            attention
        ]

    @torch.inference_mode()
    def execute(
        self, scheduled: list[tuple[Request, int]]
    ) -> tuple[torch.Tensor | None, dict[str, tuple[int, int]]]:
        """Runs one step. Returns logits (model dtype) for the positions requests need: the
        last one when a generating request's tokens are all computed (to sample), and every
        position >= logits_from for scoring requests; and per request id its (first row,
        row count) in them."""
        ids, positions, rows, spans = [], [], [], {}
        for req, n in scheduled:
            start = req.num_computed
            tokens = req.token_ids
            ids.extend(tokens[start : start + n])
            positions.extend(range(start, start + n))
            base = len(ids) - n
            if req.logits_from is not None:
                first = max(start, req.logits_from)
                wanted = range(first - start, n) if first < start + n else range(0)
            elif req.generate and start + n == req.num_tokens:
                wanted = range(n - 1, n)
            else:
                wanted = range(0)
            if len(wanted):
                spans[req.request_id] = (len(rows), len(wanted))
                rows.extend(base + j for j in wanted)
        batch = AttentionBatch.build(
            query_lens=[n for _, n in scheduled],
            context_lens=[req.num_computed + n for req, n in scheduled],
            block_tables=[req.block_ids for req, _ in scheduled],
            block_size=self.block_size,
        )
        hidden = self.model.forward(
            torch.tensor(ids, dtype=torch.long),
            torch.tensor(positions, dtype=torch.long),
            batch,
            self.kv_cache.layers,
            self.attention,
        )
        if not rows:
            return None, spans
        # The vocabulary projection is the largest matmul: only on the rows that need it.
        return self.model.logits(hidden[torch.tensor(rows, dtype=torch.long)]), spans
