"""LLMEngine: add_request / step / generate, and a background loop for many callers.

step() reads top to bottom: schedule, run the model, sample, finish. The scheduler and the
request table are guarded by one lock, which is released while the model runs, so other
threads can submit and abort during a step.
"""

from __future__ import annotations

import itertools
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from . import __version__
from .cache.block_pool import BlockPool, KVCache
from .compute import run_on_compute_thread
from .hardware import default_dtype
from .models import load_model
from .models.llama import LlamaModel
from .models.opt import OPTModel
from .outputs import RequestResult, Usage
from .registry import resolve_model
from .runner import ModelRunner
from .sampling import SamplingParams, sample, top_logprobs
from .sched.request import Request
from .sched.scheduler import Scheduler

Prompt = str | list[int] | list[dict[str, Any]]

DEFAULT_KV_CACHE_BYTES = 2 << 30


class LLMEngine:
    """The in-process engine for one model.

    kv_cache_bytes sizes the block pool; max_num_batched_tokens is the per-step token budget
    C (decodes plus prefill chunks), max_prefill_tokens the prefill budget P (<= C),
    max_num_seqs the most requests running at once; policy names the scheduling policy
    (sched/policies: sarathi, fcfs, infermax, rr, ...). RT requests get the rt_slo_* targets.
    dtype None picks bf16 where the CPU has native bf16 and fp32 elsewhere."""

    def __init__(
        self,
        model: str = "smollm2-135m",
        *,
        dtype: str | torch.dtype | None = None,
        kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES,
        block_size: int = 16,
        max_num_batched_tokens: int = 1024,
        max_num_seqs: int = 512,
        attention: str = "fast",
        threads: int | None = None,
        enable_prefix_caching: bool = True,
        policy: str = "sarathi",
        max_prefill_tokens: int | None = None,
        rt_slo_ttft_s: float = 1.0,
        rt_slo_tbt_s: float = 0.25,
    ):
        t0 = time.perf_counter()
        self.model_name = model
        self.dtype = _parse_dtype(dtype)
        # Weights and caches are made on the compute thread, where the steps will run.
        num_blocks = run_on_compute_thread(self._load, model, threads, kv_cache_bytes,
                                           block_size)
        self.pool = BlockPool(num_blocks, block_size, enable_prefix_caching)
        self.scheduler = Scheduler(self.pool, max_num_batched_tokens, max_num_seqs, policy,
                                   max_prefill_tokens)
        self.rt_slos = (rt_slo_ttft_s, rt_slo_tbt_s)
        self.runner = ModelRunner(self.model, self.kv_cache, block_size, attention)
        self.version = __version__
        self.startup_s = time.perf_counter() - t0
        self._ids = itertools.count()
        self._cond = threading.Condition(threading.RLock())
        self._step_lock = threading.Lock()
        self._requests: dict[str, Request] = {}
        self._results: dict[str, RequestResult] = {}
        self._loop: threading.Thread | None = None
        self._stopping = False
        self._default_generator = torch.Generator().manual_seed(0)

    def _load(self, model: str, threads: int | None, kv_cache_bytes: int, block_size: int
              ) -> int:
        torch.set_num_threads(threads or os.cpu_count() or 1)
        loaded = load_model(resolve_model(model))
        self.config, self.tokenizer = loaded.config, loaded.tokenizer
        self.fingerprint = loaded.fingerprint
        model_cls = {"llama": LlamaModel, "opt": OPTModel}[self.config.arch]
        self.model = model_cls(self.config, loaded.weights, self.dtype)
        num_blocks = kv_cache_bytes // KVCache.bytes_per_block(self.config, block_size, self.dtype)
        self.kv_cache = KVCache(self.config, num_blocks, block_size, self.dtype)
        return num_blocks

    # ---- submitting ----------------------------------------------------------------------

    def encode_prompt(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special=True)
        if prompt and all(isinstance(m, dict) for m in prompt):
            return self.tokenizer.encode(self.tokenizer.apply_chat_template(prompt))
        ids = [int(t) for t in prompt]
        bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
        if bad:
            raise ValueError(
                f"token id {bad[0]} is outside the vocabulary (0..{self.config.vocab_size - 1})"
            )
        return ids

    def _check_fits(self, num_tokens: int, what: str) -> None:
        if num_tokens == 0:
            raise ValueError("empty prompt: there is nothing to condition on")
        ctx = self.config.max_context
        if num_tokens > ctx:
            raise ValueError(
                f"{what} is {num_tokens:,} tokens, longer than the model's context of {ctx:,}"
            )
        capacity = self.pool.num_blocks * self.pool.block_size
        if num_tokens > capacity:
            raise ValueError(
                f"{what} needs {num_tokens:,} tokens of KV cache but the whole pool holds "
                f"{capacity:,}; raise kv_cache_bytes"
            )

    def _submit(self, req: Request, priority: str) -> str:
        if priority not in ("RT", "BE"):
            raise ValueError(f"priority must be 'RT' or 'BE', got {priority!r}")
        req.priority = priority
        if priority == "RT":
            req.slo_ttft_s, req.slo_tbt_s = self.rt_slos
        with self._cond:
            if req.request_id in self._requests:
                raise ValueError(f"request id {req.request_id!r} is already in use")
            self._requests[req.request_id] = req
            self.scheduler.add(req)
            self._cond.notify_all()
        return req.request_id

    def add_request(
        self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None,
        on_token: Callable[[int | None], None] | None = None,
        on_finish: Callable[[str], None] | None = None, priority: str = "BE",
    ) -> str:
        """Queue a generation; `on_token(token_id | None)` streams tokens, None at the end;
        `on_finish(request_id)` is called once its result can be collected with wait()."""
        params = params or SamplingParams()
        params.validate()
        ids = self.encode_prompt(prompt)
        self._check_fits(len(ids), "prompt")
        if len(ids) >= self.config.max_context:
            raise ValueError(
                f"prompt is {len(ids):,} tokens: no room to generate in the model's context of "
                f"{self.config.max_context:,}"
            )
        gen = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
        need = min(len(ids) + params.max_tokens, self.config.max_context)
        self._check_fits(need, "prompt plus max_tokens")
        req = Request(
            request_id if request_id is not None else f"req-{next(self._ids)}",
            ids, params, generator=gen, callbacks=[on_token] if on_token else [],
            on_finish=on_finish,
        )
        return self._submit(req, priority)

    def add_score_request(self, prompt: Prompt, continuation: str | list[int],
                          request_id: str | None = None,
                          on_finish: Callable[[str], None] | None = None,
                          priority: str = "BE") -> str:
        """Queue the log-likelihood of `continuation` after `prompt`; no token is generated."""
        ids = self.encode_prompt(prompt)
        cont = (self.tokenizer.encode(continuation) if isinstance(continuation, str)
                else list(continuation))
        if not ids or not cont:
            raise ValueError("scoring needs a non-empty prompt and continuation")
        self._check_fits(len(ids) + len(cont), "prompt plus continuation")
        req = Request(
            request_id if request_id is not None else f"score-{next(self._ids)}",
            ids + cont, SamplingParams(max_tokens=1), generate=False, logits_from=len(ids) - 1,
            on_finish=on_finish,
        )
        return self._submit(req, priority)

    def add_choice_request(self, prompt: Prompt, candidate_ids: list[int],
                           request_id: str | None = None,
                           on_finish: Callable[[str], None] | None = None,
                           priority: str = "BE") -> str:
        """Queue the next-token log-probabilities of `candidate_ids` after `prompt`."""
        ids = self.encode_prompt(prompt)
        self._check_fits(len(ids), "prompt")
        bad = [t for t in candidate_ids if not 0 <= t < self.config.vocab_size]
        if not candidate_ids or bad:
            raise ValueError(f"candidate token ids must be non-empty and in the vocabulary: {bad}")
        req = Request(
            request_id if request_id is not None else f"choice-{next(self._ids)}",
            ids, SamplingParams(max_tokens=1), generate=False, logits_from=len(ids) - 1,
            candidate_ids=list(candidate_ids), on_finish=on_finish,
        )
        return self._submit(req, priority)

    # ---- one iteration -------------------------------------------------------------------

    def step(self) -> list[str]:
        """One scheduler iteration; returns the ids of requests that finished in it."""
        with self._step_lock:  # threads that drive the engine themselves take turns
            return run_on_compute_thread(self._step)

    def _step(self) -> list[str]:
        with self._cond:
            out = self.scheduler.schedule()
        if not out.scheduled:
            return []
        try:
            logits, spans = self.runner.execute(out.scheduled)
        except Exception as e:  # a failed step fails its requests, not the engine
            with self._cond:
                for req, _ in out.scheduled:
                    self._finish(req, "error", error=f"{type(e).__name__}: {e}")
            return [req.request_id for req, _ in out.scheduled]
        finished = []
        with self._cond:
            to_sample, sample_rows = [], []
            for req, n in out.scheduled:
                if req.is_finished:  # aborted while the model ran
                    continue
                start = req.num_computed
                req.num_computed += n
                self.scheduler.register_computed(req)
                first, count = spans.get(req.request_id, (0, 0))
                if req.logits_from is not None and count:
                    self._collect_scores(req, start, logits[first : first + count].float())
                if req.num_computed == req.num_tokens:
                    if req.generate:
                        to_sample.append(req)
                        sample_rows.append(first + count - 1)
                    else:
                        self._finish(req, "stop")
                        finished.append(req.request_id)
            if to_sample:
                rows = logits if sample_rows == list(range(logits.shape[0])) else logits[
                    torch.tensor(sample_rows)]
                tokens = sample(rows, [r.params for r in to_sample],
                                [r.generator or self._default_generator for r in to_sample])
                for i, (req, token) in enumerate(zip(to_sample, tokens, strict=True)):
                    if self._append_token(req, token, rows[i]):
                        finished.append(req.request_id)
        return finished

    def _collect_scores(self, req: Request, start: int, rows: torch.Tensor) -> None:
        first = max(start, req.logits_from)
        if req.keep_logits:
            req.logit_rows.append(rows)
            return
        if req.candidate_ids is not None:  # only the last prompt position is asked for
            lp = rows[-1].log_softmax(-1)
            req.target_logprobs = lp[torch.tensor(req.candidate_ids)].tolist()
            return
        tokens = req.token_ids
        positions = range(first, first + rows.shape[0])
        targets = [tokens[p + 1] for p in positions if p + 1 < len(tokens)]
        lp = rows[: len(targets)].log_softmax(-1)
        req.target_logprobs.extend(lp.gather(1, torch.tensor(targets)[:, None])[:, 0].tolist())

    def _append_token(self, req: Request, token: int, row: torch.Tensor) -> bool:
        now = time.perf_counter()
        req.first_token_time = req.first_token_time or now
        req.last_token_time = now
        req.output_ids.append(token)
        p = req.params
        if p.logprobs is not None:
            req.logprobs.append(top_logprobs(row, token, p.logprobs))
        for cb in req.callbacks:
            cb(token)
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.config.eos_token_ids):
            reason = "stop"
        elif p.stop and any(s in self.tokenizer.decode(req.output_ids) for s in p.stop):
            reason = "stop"
        elif len(req.output_ids) >= p.max_tokens or req.num_tokens >= self.config.max_context:
            reason = "length"
        else:
            return False
        self._finish(req, reason)
        return True

    def _finish(self, req: Request, reason: str, error: str | None = None) -> None:
        if req.is_finished:
            return
        self.scheduler.finish(req)
        req.finish_reason, req.error = reason, error
        req.finish_time = time.perf_counter()
        self._results[req.request_id] = self._result(req)
        del self._requests[req.request_id]
        for cb in req.callbacks:
            cb(None)
        if req.on_finish is not None:
            req.on_finish(req.request_id)
        self._cond.notify_all()

    def _result(self, req: Request) -> RequestResult:
        p, out = req.params, req.output_ids
        text_ids = out
        if req.finish_reason == "stop" and out and (
            out[-1] in p.stop_token_ids or out[-1] in self.config.eos_token_ids
        ):
            text_ids = out[:-1]  # the stop token itself is not part of the answer
        text = self.tokenizer.decode(text_ids) if req.generate else ""
        for s in p.stop:
            if s in text:
                text = text[: text.index(s)]
        return RequestResult(
            request_id=req.request_id,
            text=text,
            token_ids=list(out),
            finish_reason=req.finish_reason,
            usage=Usage(
                prompt_tokens=len(req.prompt_ids),
                generated_tokens=len(out),
                cached_tokens=req.num_cached_tokens or 0,
                ttft_s=req.first_token_time - req.arrival if req.first_token_time else None,
                total_s=req.finish_time - req.arrival,
            ),
            logprobs=req.logprobs if p.logprobs is not None else None,
            continuation_logprobs=req.target_logprobs if req.candidate_ids is None else [],
            candidate_logprobs=req.target_logprobs if req.candidate_ids is not None else [],
            error=req.error,
        )

    # ---- waiting for results -------------------------------------------------------------

    def abort(self, request_id: str) -> None:
        with self._cond:
            req = self._requests.get(request_id)
            if req is not None:
                self._finish(req, "abort")

    @property
    def has_unfinished(self) -> bool:
        with self._cond:
            return self.scheduler.has_work

    def wait(self, request_id: str, timeout: float | None = None) -> RequestResult | None:
        """The request's result (removed from the engine), or None if not done in `timeout`.

        With the background loop running this only waits; without it, the calling thread
        drives the engine."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._cond:
                if request_id in self._results:
                    return self._results.pop(request_id)
                if request_id not in self._requests:
                    raise KeyError(f"unknown request id {request_id!r}")
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return None
                if self._loop is not None:
                    self._cond.wait(left)
                    continue
            self.step()

    def generate(self, prompts: list[Prompt], params: SamplingParams | list[SamplingParams] | None
                 = None) -> list[RequestResult]:
        plist = params if isinstance(params, list) else [params] * len(prompts)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, plist, strict=True)]
        return [self.wait(i) for i in ids]

    def score(self, prompt: Prompt, continuations: list[str | list[int]]) -> list[float]:
        """Log-likelihood of each continuation after the prompt, computed in one batch."""
        ids = [self.add_score_request(prompt, c) for c in continuations]
        results = [self.wait(i) for i in ids]
        for r in results:
            if r.finish_reason == "error":
                raise RuntimeError(f"scoring failed: {r.error}")
        return [r.score for r in results]

    def logits(self, token_ids: list[int]) -> torch.Tensor:
        """Teacher-forced next-token logits [len, vocab] in fp32, through the paged path."""
        ids = self.encode_prompt(list(token_ids))
        self._check_fits(len(ids), "input")
        req = Request(f"logits-{next(self._ids)}", ids, SamplingParams(max_tokens=1),
                      generate=False, logits_from=0, keep_logits=True)
        self._submit(req, "BE")
        result = self.wait(req.request_id)
        if result.finish_reason == "error":
            raise RuntimeError(f"logits failed: {result.error}")
        # On the compute thread: a large copy here would give the caller an OpenMP team.
        return run_on_compute_thread(torch.cat, req.logit_rows)

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[int]:
        """Token ids as they are generated."""
        tokens: queue.SimpleQueue = queue.SimpleQueue()
        rid = self.add_request(prompt, params, on_token=tokens.put)
        try:
            while True:
                if self._loop is None:
                    while tokens.empty():
                        self.step()
                tok = tokens.get()
                if tok is None:
                    return
                yield tok
        finally:
            self.abort(rid)
            with self._cond:
                self._results.pop(rid, None)

    # ---- background loop -----------------------------------------------------------------

    def start_background_loop(self) -> None:
        """Steps the engine on a daemon thread, so that many threads can submit and wait."""
        with self._cond:
            if self._loop is not None:
                return
            self._stopping = False
            self._loop = threading.Thread(target=self._run_loop, name="llmdb-engine", daemon=True)
            self._loop.start()

    def stop_background_loop(self) -> None:
        with self._cond:
            loop, self._stopping = self._loop, True
            self._cond.notify_all()
        if loop is not None:
            loop.join()
        self._loop = None

    def _run_loop(self) -> None:
        while True:
            with self._cond:
                while not self.scheduler.has_work and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    return
            self.step()


def _parse_dtype(dtype: str | torch.dtype | None) -> torch.dtype:
    if dtype is None or dtype == "auto":
        return default_dtype()
    if isinstance(dtype, torch.dtype):
        return dtype
    table = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32,
             "float32": torch.float32}
    if dtype not in table:
        raise ValueError(f"unknown dtype {dtype!r} (use 'auto', 'bf16' or 'fp32')")
    return table[dtype]
