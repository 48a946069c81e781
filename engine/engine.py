"""LLMEngine: add_request / step / generate, and a background loop for many callers.

step() reads top to bottom: schedule, run the model, sample, finish. The scheduler and the
request table are guarded by one lock, which is released while the model runs, so other
threads can submit and abort during a step.
"""

from __future__ import annotations

import dataclasses
import gc
import itertools
import logging
import numbers
import operator
import queue
import random
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from . import __version__
from .cache.block_pool import HIDDEN_RATIO, BlockPool
from .cache.kv_cache import KVCache
from .compute import run_on_compute_thread, run_on_device
from .costmodel import engine_cost_model
from .device import default_dtype, device_name, resolve_device
from .hardware import default_threads
from .models import ModelLoadError, load_model
from .models.gemma import GemmaModel
from .models.llama import KERNEL_SETS, LlamaModel
from .models.opt import OPTModel
from .outputs import RequestAborted, RequestResult, Usage
from .params import SamplingParams
from .registry import resolve_model
from .runner import LaunchedStep, ModelRunner, StepOutput
from .sched.policies import Policy, make_policy
from .sched.request import PENDING_TOKEN, Request, Status
from .sched.scheduler import Scheduler
from .stop_strings import StopStringWatch

log = logging.getLogger(__name__)

Prompt = str | list[int] | list[dict[str, Any]]

DEFAULT_KV_CACHE_BYTES = 2 << 30  # on the CPU; a GPU gets most of its free memory
# Of the GPU memory free once the weights are loaded, the share the KV pool takes; the rest
# holds activations, logits and CUDA graphs.
GPU_KV_SHARE = 0.8
GPU_ACTIVATION_RESERVE = 2 << 30


class LLMEngine:
    """The in-process engine for one model.

    device: "auto" (a CUDA GPU when torch sees one, else the CPU), "cpu", "cuda" or "cuda:N".
    kv_cache_bytes sizes the block pool (None: 2 GiB on the CPU, most of the free memory on a
    GPU); max_num_batched_tokens is the per-step token budget C (decodes plus prefill
    chunks), max_prefill_tokens the prefill budget P (<= C), max_num_seqs the most requests
    running at once; policy is the scheduling policy, by name (sched/policies: priority, the
    default: sarathi with RT requests first; sarathi, fcfs, infermax, apt, bros, rr) or as a
    Policy object. RT requests get the rt_slo_* targets. dtype
    None picks bf16 on GPUs (fp16 where bf16 is missing) and on CPUs with native bf16, fp32
    elsewhere. attention picks the kernel set: "auto" (C++ on the CPU, Triton on GPUs),
    "cpu", "triton" or "reference". cuda_graphs replays decode steps and small mixed steps
    from captured graphs on GPUs.
    hidden_cache lets the scheduler keep a request's hidden states instead of its K/V
    (Apt-Serve; only the apt policy chooses it): None turns it on where the model's hidden
    states are smaller than its K/V (MHA models such as OPT), True insists (an error where
    they are not), False turns it off.
    launch_ahead (None: on GPUs) schedules and launches each step before reading the one
    before, so the host's work overlaps the device's; a request that stops then computes one
    token more, discarded. On the CPU a step runs inline, so there is nothing to overlap.
    max_context: the longest prompt plus output served (None: the model's context, for a
    LongRoPE model such as Phi-3.5 its pretrained one: models/rope.py says why).
    batch_invariant: a request's tokens and log-probabilities do not depend on the requests
    batched with it (GPU kernels: Triton matmuls of one tile shape instead of cuBLAS's,
    attention without split-KV, row-wise log-softmax and top-p sums; kernels/gpu/matmul.py
    and rowwise.py say why; on a GPU it needs the Triton kernels, attention "auto" or
    "triton"). The CPU kernels always are (kernels/linear.py)."""

    def __init__(
        self,
        model: str = "smollm2-135m",
        *,
        device: str | torch.device | None = "auto",
        dtype: str | torch.dtype | None = None,
        kv_cache_bytes: int | None = None,
        block_size: int = 16,
        max_num_batched_tokens: int | None = None,
        max_num_seqs: int = 512,
        attention: str = "auto",
        threads: int | None = None,
        enable_prefix_caching: bool = True,
        policy: str | Policy = "priority",
        max_prefill_tokens: int | None = None,
        rt_slo_ttft_s: float = 1.0,
        rt_slo_tbt_s: float = 0.25,
        cuda_graphs: bool = True,
        hidden_cache: bool | None = None,
        launch_ahead: bool | None = None,
        max_context: int | None = None,
        batch_invariant: bool = False,
    ):
        t0 = time.perf_counter()
        _check_positive(max_num_batched_tokens=max_num_batched_tokens,
                        max_num_seqs=max_num_seqs, max_prefill_tokens=max_prefill_tokens,
                        block_size=block_size)
        self.model_name = model
        self.device = resolve_device(device)
        self.dtype = _parse_dtype(dtype, self.device)
        self.kernels = _kernel_set(attention, self.device, self.dtype)
        if batch_invariant:
            _check_batch_invariant(self.kernels, self.device)
        if max_num_batched_tokens is None:  # GPUs take larger steps at little extra time
            max_num_batched_tokens = 8192 if self.device.type == "cuda" else 1024
        # Weights and caches are made on the compute thread, where the steps will run.
        num_blocks = run_on_device(self.device, self._load, model, threads, kv_cache_bytes,
                                   block_size, max_context, hidden_cache, batch_invariant)
        self.pool = BlockPool(num_blocks, block_size, enable_prefix_caching)
        self._context, self._eos = self.config.max_context, self.config.eos_token_ids
        self.hidden_cache, self.hidden_cache_reason = self.config.hidden_cache_support()
        if hidden_cache and not self.hidden_cache:
            raise ValueError(f"no hidden cache for {model}: {self.hidden_cache_reason}")
        # This model's, dtype's and device's calibration, or a labelled estimate.
        self.cost_model = engine_cost_model(self)
        self.scheduler = Scheduler(self.pool, max_num_batched_tokens, max_num_seqs,
                                   make_policy(policy) if isinstance(policy, str) else policy,
                                   max_prefill_tokens, cost_model=self.cost_model,
                                   hidden_ratio=HIDDEN_RATIO if self.hidden_cache else None)
        self.rt_slos = (rt_slo_ttft_s, rt_slo_tbt_s)
        # On the compute thread too: zero-filling its buffers here would start an OpenMP
        # team on the caller's thread (engine/compute.py).
        self.runner = run_on_device(
            self.device, ModelRunner, self.model, self.kv_cache, block_size, self.device,
            max_num_batched_tokens, max_num_seqs, self.config.max_context,
            cuda_graphs=cuda_graphs and self.kernels == "triton",
        )
        run_on_device(self.device, self.runner.capture_graphs)
        self.launch_ahead = self.device.type == "cuda" if launch_ahead is None else launch_ahead
        self._in_flight: _InFlight | None = None
        self._aborts: set[str] = set()  # aborted while a step was under way (see abort)
        self._step_threads: set[int] = set()  # the threads running the step under way
        self.version = __version__
        self.startup_s = time.perf_counter() - t0
        self._ids = itertools.count()
        self._cond = threading.Condition(threading.RLock())
        self._step_lock = threading.Lock()
        self._requests: dict[str, Request] = {}
        self._stop_watches: dict[str, StopStringWatch] = {}  # of requests with stop strings
        self._results: dict[str, RequestResult] = {}
        self._loop: threading.Thread | None = None
        self._stopping = False
        # Seeds of unseeded sampling requests: reproducible per engine, different per request.
        self._seeds = random.Random(0)
        self._host_s = 0.0
        self.tokens_generated = 0  # since start, for metrics
        self._wall_s = 0.0
        # Set to a list to have each step call append (kind, wall_s, host_s), kind being what
        # it launched: "graph" (a captured decode step), "mixed graph", "eager", or "none" (it
        # only read the last step). Benchmarks use it to tell the kinds' costs apart.
        self.step_log: list[tuple[str, float, float]] | None = None

    def _load(self, model: str, threads: int | None, kv_cache_bytes: int | None,
              block_size: int, max_context: int | None, hidden_cache: bool | None,
              batch_invariant: bool) -> int:
        self.threads = threads or default_threads()
        torch.set_num_threads(self.threads)
        loaded = load_model(resolve_model(model))
        self.config, self.tokenizer = loaded.config.serving(max_context), loaded.tokenizer
        if hidden_cache is False:  # (no re-projection weights: a copy of K/V's on the CPU)
            self.config = dataclasses.replace(self.config, hidden_cache=False)
        if batch_invariant and self.kernels == "triton":  # (the CPU kernels already are)
            self.config = dataclasses.replace(self.config, batch_invariant=True)
        self.model_context = loaded.config.max_context  # (what max_context may go up to)
        self.fingerprint = loaded.fingerprint
        model_cls = {"llama": LlamaModel, "opt": OPTModel, "gemma2": GemmaModel,
                     "gemma3": GemmaModel}[self.config.arch]
        try:
            self.model = model_cls(self.config, loaded.weights, self.dtype, self.device,
                                   self.kernels)
        except ModelLoadError as e:
            raise ModelLoadError(f"{loaded.path}: {e}") from None
        del loaded
        if kv_cache_bytes is None:
            kv_cache_bytes = DEFAULT_KV_CACHE_BYTES
            if self.device.type == "cuda":
                # What loading freed (dequantized and transposed copies) stays in torch's
                # allocator, counted as used, until it is given back.
                gc.collect()
                torch.cuda.empty_cache()
                free, _ = torch.cuda.mem_get_info(self.device)
                kv_cache_bytes = int(free * GPU_KV_SHARE) - GPU_ACTIVATION_RESERVE
        num_blocks = kv_cache_bytes // KVCache.bytes_per_block(self.config, block_size, self.dtype)
        self.kv_cache = KVCache(self.config, max(num_blocks, 0), block_size, self.dtype,
                                self.device)
        return num_blocks

    def describe(self) -> dict[str, Any]:
        """What runs where: EXPLAIN and `llmdb` print this."""
        c = self.config
        kv_bytes = self.pool.num_blocks * KVCache.bytes_per_block(c, self.pool.block_size,
                                                                  self.dtype)
        graphs = self.runner.graphs
        return {
            "model": self.model_name,
            "arch": c.arch,
            "layers": c.num_layers,
            "device": device_name(self.device),
            "threads": self.threads,  # torch's, on the compute thread
            "dtype": str(self.dtype).removeprefix("torch."),
            "kernels": self.kernels,
            "cuda_graphs": sorted(graphs.graphs) if graphs is not None else [],
            # Token buckets of mixed steps captured so far (a copy: the compute thread may
            # be adding one).
            "mixed_cuda_graphs": (sorted(graphs.mixed.copy())
                                  if graphs is not None and graphs.mixed_on else []),
            "kv_cache": {"blocks": self.pool.num_blocks, "block_size": self.pool.block_size,
                         "bytes": kv_bytes, "prefix_caching": self.pool.enable_prefix_caching},
            "hidden_cache": {
                "enabled": self.hidden_cache,
                "why": self.hidden_cache_reason,
                # A hidden request takes a block half by half, block_size tokens a half.
                "tokens_per_block": 2 * self.pool.block_size if self.hidden_cache else 0,
            },
            # Does a request's answer depend on the requests batched with it? Not where this
            # is True (the CPU kernels pad their matmuls to agree: kernels/linear.py).
            "batch_invariant": c.batch_invariant or (self.device.type == "cpu"
                                                     and self.kernels != "triton"),
            "policy": self.scheduler.policy.name,
            "launch_ahead": self.launch_ahead,
            "max_num_seqs": self.scheduler.max_num_seqs,
            "max_num_batched_tokens": self.scheduler.max_num_batched_tokens,
            "startup_s": round(self.startup_s, 2),
        }

    def step_timing(self) -> dict[str, float]:
        """Steps run, and the host's time in them (scheduling, inputs, launches, outputs;
        not the waits for the device) beside their wall time, since the engine started; on
        a GPU also its idle time between steps (host work the launch ahead did not hide)."""
        graphs = self.runner.graphs
        return {"steps": self.runner.steps, "host_s": self._host_s, "wall_s": self._wall_s,
                "device_idle_s": self.runner.device_idle_s,
                # (included in host_s: mixed graphs captured when first needed)
                "graph_capture_s": graphs.capture_s if graphs is not None else 0.0}

    # ---- submitting ----------------------------------------------------------------------

    def encode_prompt(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special=True)
        if not isinstance(prompt, list | tuple):
            raise TypeError(f"a prompt is a string, a list of token ids or a list of chat "
                            f"messages (dicts), not {type(prompt).__name__}")
        if prompt and all(isinstance(m, dict) for m in prompt):
            _check_contents(prompt)
            # Message text is data: it cannot forge the template's turn markers.
            return self.tokenizer.encode_chat(prompt)
        return self._token_ids(prompt)

    def _token_ids(self, items: Sequence[Any]) -> list[int]:
        """Ints of token ids given by a caller, each checked: a bad one in a step's batch
        failed every request of the step."""
        ids = [_token_id(t) for t in items]
        bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
        if bad:
            raise ValueError(
                f"token id {bad[0]} is outside the vocabulary (0..{self.config.vocab_size - 1})"
            )
        return ids

    def cached_prefix_tokens(self, token_ids: Sequence[int]) -> int:
        """Tokens of a new request for token_ids that the prefix cache holds now (its last
        token is always computed): what EXPLAIN LLM counts as already computed."""
        with self._cond:
            return self.scheduler.cached_prefix_tokens(token_ids)

    def _check_fits(self, num_tokens: int, what: str) -> None:
        if num_tokens == 0:
            raise ValueError("empty prompt: there is nothing to condition on")
        ctx = self.config.max_context
        if num_tokens > ctx:
            raise ValueError(
                f"{what} is {num_tokens:,} tokens, longer than {self._context_served()}"
            )
        # More than its K/V hold where the policy keeps hidden states (Apt-Serve).
        capacity = self.scheduler.max_request_tokens()
        if num_tokens > capacity:
            kv = capacity == self.pool.num_blocks * self.pool.block_size
            form = "K/V" if kv else "hidden states"
            raise ValueError(
                f"{what} needs {num_tokens:,} tokens of cache but the whole pool holds "
                f"{capacity:,} tokens as {form}; raise kv_cache_bytes"
            )

    def _context_served(self) -> str:
        ctx = self.config.max_context
        if ctx == self.model_context:
            return f"the model's context of {ctx:,}"
        return (f"the context of {ctx:,} served (LLMEngine(max_context=...) serves up to the "
                f"model's {self.model_context:,})")

    def _submit(self, req: Request, priority: str, watch: StopStringWatch | None = None) -> str:
        if priority not in ("RT", "BE"):
            raise ValueError(f"priority must be 'RT' or 'BE', got {priority!r}")
        req.priority = priority
        if priority == "RT":
            req.slo_ttft_s, req.slo_tbt_s = self.rt_slos
        with self._cond:
            if req.request_id in self._requests or req.request_id in self._results:
                raise ValueError("the id is already in use by a request running, or finished "
                                 "and not collected by wait()")
            self._requests[req.request_id] = req
            if watch is not None:  # (before its first step: it has seen resumed text)
                self._stop_watches[req.request_id] = watch
            self.scheduler.add(req)
            self._cond.notify_all()
        return req.request_id

    def add_request(
        self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None,
        on_token: Callable[[int | None], None] | None = None,
        on_finish: Callable[[str], None] | None = None, priority: str = "BE",
        on_logprobs: Callable[[tuple[float, dict[int, float]]], None] | None = None,
        resume_from: Sequence[int] = (),
    ) -> str:
        """Queue a generation; `on_token(token_id | None)` streams tokens, None at the end;
        `on_logprobs((logprob, top logprobs))` each token's, just before on_token gets it
        (with params.logprobs set); `on_finish(request_id)` is called once its result can be
        collected with wait().

        resume_from: tokens an earlier run of this same request generated (output_so_far()
        of one that was cut short): they are computed as prompt and the request goes on
        after them, as a preempted request does, so its result (text, token_ids) is the
        uninterrupted run's; seeded draws too, since a draw's noise depends on its index.
        They count against max_tokens, not as generated tokens, and are not streamed."""
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        with _naming(rid):
            params = params or SamplingParams()
            params.validate()
            if params.logprobs is not None and params.logprobs > self.config.vocab_size:
                raise ValueError(f"logprobs must be at most the vocabulary's "
                                 f"{self.config.vocab_size:,} tokens, got {params.logprobs:,}")
            ids = self.encode_prompt(prompt)
            self._check_fits(len(ids), "prompt")
            resumed = self._resumed_tokens(resume_from, params)
            if len(ids) + len(resumed) >= self.config.max_context:
                what = "prompt" if not resumed else "prompt plus resume_from"
                raise ValueError(
                    f"{what} is {len(ids) + len(resumed):,} tokens: no room to generate in "
                    f"{self._context_served()}"
                )
            seed = params.seed if params.seed is not None else self._seeds.getrandbits(63)
            need = min(len(ids) + params.max_tokens, self.config.max_context)
            self._check_fits(need, "prompt plus max_tokens")
            req = Request(
                rid, ids, params, seed=seed, callbacks=[on_token] if on_token else [],
                on_finish=on_finish, on_logprobs=on_logprobs, output_ids=resumed,
                num_resumed=len(resumed),
            )
            watch = None
            if resumed and params.stop:
                watch = StopStringWatch(self.tokenizer.decode, params.stop)
                if any(watch.add(t) for t in resumed):
                    raise ValueError("resume_from's text holds a stop string: that run had "
                                     "ended")
            return self._submit(req, priority, watch)

    def _resumed_tokens(self, resume_from: Sequence[int], params: SamplingParams) -> list[int]:
        """resume_from checked: tokens a run of this request could have generated without
        ending."""
        if isinstance(resume_from, str | bytes):
            raise TypeError("resume_from is a list of token ids, not text")
        resumed = self._token_ids(resume_from)
        if not resumed:
            return resumed
        if params.logprobs is not None:
            raise ValueError("resume_from cannot be combined with logprobs: the resumed "
                             "tokens' log-probabilities are not known")
        if len(resumed) >= params.max_tokens:
            raise ValueError(f"resume_from holds {len(resumed):,} tokens: nothing is left "
                             f"to generate within max_tokens={params.max_tokens:,}")
        stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self._eos))
        if stops & set(resumed):
            raise ValueError("resume_from holds a stop token: that run had ended")
        return resumed

    def add_score_request(self, prompt: Prompt, continuation: str | list[int],
                          request_id: str | None = None,
                          on_finish: Callable[[str], None] | None = None,
                          priority: str = "BE") -> str:
        """Queue the log-likelihood of `continuation` after `prompt`; no token is generated."""
        rid = request_id if request_id is not None else f"score-{next(self._ids)}"
        with _naming(rid):
            ids = self.encode_prompt(prompt)
            if isinstance(continuation, str):
                cont = self.tokenizer.encode(continuation)
            elif isinstance(continuation, list | tuple):
                cont = self._token_ids(continuation)
            else:
                raise TypeError(f"a continuation is a string or a list of token ids, not "
                                f"{type(continuation).__name__}")
            if not ids or not cont:
                raise ValueError("scoring needs a non-empty prompt and continuation")
            self._check_fits(len(ids) + len(cont), "prompt plus continuation")
            req = Request(
                rid, ids + cont, SamplingParams(max_tokens=1), generate=False,
                logits_from=len(ids) - 1, on_finish=on_finish,
            )
            return self._submit(req, priority)

    def add_choice_request(self, prompt: Prompt, candidate_ids: list[int],
                           request_id: str | None = None,
                           on_finish: Callable[[str], None] | None = None,
                           priority: str = "BE") -> str:
        """Queue the next-token log-probabilities of `candidate_ids` after `prompt`."""
        rid = request_id if request_id is not None else f"choice-{next(self._ids)}"
        with _naming(rid):
            ids = self.encode_prompt(prompt)
            self._check_fits(len(ids), "prompt")
            candidate_ids = self._token_ids(candidate_ids)
            if not candidate_ids:
                raise ValueError("a choice needs at least one candidate token id")
            req = Request(
                rid, ids, SamplingParams(max_tokens=1), generate=False, logits_from=len(ids) - 1,
                candidate_ids=candidate_ids, on_finish=on_finish,
            )
            return self._submit(req, priority)

    def add_logits_request(self, prompt: Prompt, request_id: str | None = None,
                           on_finish: Callable[[str], None] | None = None,
                           priority: str = "BE") -> str:
        """Queue the teacher-forced next-token logits of every position of `prompt`, for
        collect_logits(); no token is generated. Like any request, abort(request_id) stops
        it and frees its blocks: a long prompt's job is seconds of work nobody may want."""
        rid = request_id if request_id is not None else f"logits-{next(self._ids)}"
        with _naming(rid):
            ids = self.encode_prompt(prompt)
            self._check_fits(len(ids), "input")
            req = Request(
                rid, ids, SamplingParams(max_tokens=1), generate=False, logits_from=0,
                keep_logits=True, on_finish=on_finish,
            )
            return self._submit(req, priority)

    # ---- one iteration -------------------------------------------------------------------

    def step(self) -> list[str]:
        """One scheduler iteration; returns the ids of requests that finished in it."""
        self._refuse_inside_step("step()")
        with self._step_lock:  # threads that drive the engine themselves take turns
            self._finish_aborted()
            self._step_threads = {threading.get_ident()}
            try:
                return run_on_device(self.device, self._step)
            except Exception as e:  # noqa: BLE001 (a bug, see _fail_under_way)
                return self._fail_under_way(e)
            finally:
                self._step_threads = set()
                self._finish_aborted()

    def _refuse_inside_step(self, what: str) -> None:
        """A request's callback runs inside a step: waiting there for the engine (a result,
        another step) waits for itself, for ever."""
        if threading.get_ident() in self._step_threads:
            raise RuntimeError(f"{what} was called from inside the engine's step (a "
                               f"request's callback?), which it would wait for")

    def _fail_under_way(self, e: Exception) -> list[str]:
        """A step that raised outside the model's launch and read (which fail their own
        requests) fails every request under way, not the engine. Raised instead, it left its
        step in flight: each later step read it again and raised the same, and their waiters
        (or the background loop's) never got an answer."""
        log.exception("the engine's step failed; the requests under way fail")
        with self._cond:
            self._in_flight = None
            failed = list(self._requests.values())
            for req in failed:
                self._finish(req, "error",
                             error=f"the engine's step failed: {type(e).__name__}: {e}")
        return [req.request_id for req in failed]

    def _step(self) -> list[str]:
        """Schedule, launch, then read the step before: with launch-ahead on (GPUs) the
        device runs this step while the host reads the last one and, in the next call,
        schedules the one after, its pending tokens taken from this step's samples on the
        device. Without it the step is read at once. A failed step fails its requests, not
        the engine."""
        self._step_threads.add(threading.get_ident())  # (the compute thread, on the CPU)
        t0 = time.perf_counter()
        with self._cond:
            out = self.scheduler.schedule()
        finished: list[str] = []
        launched = None
        if out.scheduled or out.converted:
            try:
                launched = self.runner.launch(out.scheduled, out.converted)
            except Exception as e:
                finished += self._fail(out.scheduled, e)
        wait, read = 0.0, self._in_flight
        if read is not None:
            finished += self._read(read)
            wait, self._in_flight = self.runner.last_wait_s, None
        if launched is not None:
            with self._cond:
                caught_up = self.scheduler.advance(out.scheduled)
                if self.launch_ahead:  # (step by step, they finish before the next schedule)
                    # Those that compute nothing after their pending token (scoring requests:
                    # after this step) finish when it is read.
                    at_length = self._at_length
                    for req in caught_up:
                        if not req.generate or at_length(req):
                            self.scheduler.hold(req)
            plan = launched.plan
            self._in_flight = _InFlight(out.scheduled, caught_up, launched,
                                        [r.num_preemptions for r, _ in out.scheduled]
                                        if plan.score or plan.choice or plan.keep else [])
            if not self.launch_ahead or all(r.is_finished for r, _ in out.scheduled):
                # (Launching ahead, every request of this step may have finished on the read
                # before it, on a stop token say: nothing would come back to read it.)
                finished += self._read(self._in_flight)
                wait, self._in_flight = wait + self.runner.last_wait_s, None
        if launched is None and read is None:
            return finished
        wall = time.perf_counter() - t0
        self._wall_s += wall
        self._host_s += wall - wait
        if self.step_log is not None:
            kind = "none" if launched is None else launched.kind
            self.step_log.append((kind, wall, wall - wait))
        return finished

    def _at_length(self, req: Request) -> bool:
        """Its last token is its max_tokens-th, or fills the model's context."""
        out = req.output_ids
        return len(out) >= req.params.max_tokens or len(req.prompt_ids) + len(out) >= self._context

    def _read(self, step: _InFlight) -> list[str]:
        """Wait for a launched step's results; its requests take their tokens and scores,
        and those that stop are finished."""
        try:
            result = self.runner.collect(step.launched)
        except Exception as e:
            return self._fail(step.scheduled, e)
        finished = []
        now = time.perf_counter()
        plan = step.launched.plan
        with self._cond:
            if plan.score or plan.choice or plan.keep:
                # Scores of a request preempted since the launch are computed again.
                self._collect_scores([x for x, n in zip(step.scheduled, step.preemptions,
                                                        strict=True)
                                      if x[0].num_preemptions == n], result)
            sampled, take_token = result.sampled, self.scheduler.take_token
            after_token, done = self._after_token, Status.FINISHED
            for req in step.caught_up:
                if req.status is done:  # aborted, or failed, while the step ran
                    continue
                if not req.generate:
                    self._finish(req, "stop")
                    finished.append(req.request_id)
                    continue
                token = sampled[req.request_id]
                take_token(req, token, now)
                self.tokens_generated += 1
                if after_token(req, token, result):
                    finished.append(req.request_id)
        return finished

    def _fail(self, scheduled: list[tuple[Request, int]], e: Exception) -> list[str]:
        with self._cond:
            for req, _ in scheduled:
                self._finish(req, "error", error=f"{type(e).__name__}: {e}")
        return [req.request_id for req, _ in scheduled]

    @staticmethod
    def _collect_scores(scheduled: list[tuple[Request, int]], result: StepOutput) -> None:
        for req, _ in scheduled:
            rid = req.request_id
            if req.is_finished or req.logits_from is None:
                continue
            if rid in result.logit_rows:
                req.logit_rows.append(result.logit_rows[rid])
            elif rid in result.candidate_logprobs:
                req.target_logprobs = result.candidate_logprobs[rid]
            elif rid in result.target_logprobs:
                req.target_logprobs.extend(result.target_logprobs[rid])

    def _after_token(self, req: Request, token: int, result: StepOutput) -> bool:
        """Stream the new token and finish the request if it stops here."""
        p = req.params
        failed = None
        if p.logprobs is not None:
            req.logprobs.append(result.logprobs[req.request_id])
            if req.on_logprobs is not None:
                failed = self._notify(req, req.on_logprobs, req.logprobs[-1])
        for cb in req.callbacks:  # (no list built per token: this is the hot path)
            failed = failed or self._notify(req, cb, token)
        if failed is not None:
            self._finish(req, "error", error=failed)
            return True
        if token in p.stop_token_ids or (not p.ignore_eos and token in self._eos):
            reason = "stop"
        elif p.stop and self._stop_watch(req).add(token):
            reason = "stop"
        elif (req.request_id in self.scheduler.held) if self.launch_ahead else (
                self._at_length(req)):
            # Launching ahead, a request was held at launch exactly when its pending token
            # (now this one) was its last: the length check is not made twice.
            reason = "length"
        else:
            return False
        self._finish(req, reason)
        return True

    def _stop_watch(self, req: Request) -> StopStringWatch:
        watch = self._stop_watches.get(req.request_id)
        if watch is None:  # from its first token on
            watch = StopStringWatch(self.tokenizer.decode, req.params.stop)
            self._stop_watches[req.request_id] = watch
        return watch

    def _finish(self, req: Request, reason: str, error: str | None = None) -> None:
        if req.is_finished:
            return
        if req.output_ids[-1:] == [PENDING_TOKEN]:  # aborted or failed with a step in flight
            req.output_ids.pop()
        self._stop_watches.pop(req.request_id, None)
        self.scheduler.finish(req)
        req.finish_reason, req.error = reason, error
        req.finish_time = time.perf_counter()
        self._results[req.request_id] = self._result(req)
        del self._requests[req.request_id]
        for cb in req.callbacks:
            self._notify(req, cb, None)
        if req.on_finish is not None:
            self._notify(req, req.on_finish, req.request_id)
        self._cond.notify_all()

    @staticmethod
    def _notify(req: Request, callback: Callable, value: Any) -> str | None:
        """Call one of a request's callbacks. One that raises (its reader is gone: a server
        whose event loop has closed) must not end the step, the other requests or the
        background loop, which died of it and left every later caller waiting: it is
        logged, and the error is returned for the caller to end this request with."""
        try:
            callback(value)
        except Exception as e:  # noqa: BLE001 (the caller's code, not the engine's)
            log.exception("request %s: its callback raised; the request ends", req.request_id)
            return f"its callback raised {type(e).__name__}: {e}"
        return None

    def _result(self, req: Request) -> RequestResult:
        p, out = req.params, req.output_ids
        text_ids = out
        if req.finish_reason == "stop" and out and (
            out[-1] in p.stop_token_ids or out[-1] in self.config.eos_token_ids
        ):
            text_ids = out[:-1]  # the stop token itself is not part of the answer
        text = self.tokenizer.decode(text_ids) if req.generate else ""
        if req.finish_reason in ("length", "abort"):
            text = without_partial_char(text)
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
                generated_tokens=len(out) - req.num_resumed,
                resumed_tokens=req.num_resumed,
                # (a resumed request's own tokens may be cached too: prompt tokens only)
                cached_tokens=min(req.num_cached_tokens or 0, len(req.prompt_ids)),
                ttft_s=req.first_token_time - req.arrival if req.first_token_time else None,
                total_s=req.finish_time - req.arrival,
            ),
            logprobs=req.logprobs if p.logprobs is not None else None,
            continuation_logprobs=req.target_logprobs if req.candidate_ids is None else [],
            candidate_logprobs=req.target_logprobs if req.candidate_ids is not None else [],
            logit_rows=req.logit_rows,
            error=req.error,
        )

    # ---- waiting for results -------------------------------------------------------------

    def abort(self, *request_ids: str) -> None:
        """End these requests; they are finished when this returns (but see below).

        A step under way may be launching their K/V writes into their blocks: freed then,
        the prefix cache could hand them to another request first. So a step under way
        finishes them as it ends (_finish_aborted), and this waits for that (not by taking
        the step lock: a busy loop takes it back first, every time). Pass every request to
        end in one call: one at a time, each would wait for a step of its own. Called by the
        step itself (a token callback), it returns at once and the step ends them."""
        own = threading.get_ident() in self._step_threads
        with self._cond:
            while left := [r for r in request_ids if r in self._requests]:
                if not own and self._step_lock.acquire(blocking=False):
                    try:
                        for r in left:
                            self._finish(self._requests[r], "abort")
                    finally:
                        self._step_lock.release()
                    return
                self._aborts.update(left)
                if own:
                    return
                self._cond.wait(0.05)

    def _finish_aborted(self) -> None:
        if not self._aborts:  # (every step passes here: no lock taken for nothing)
            return
        with self._cond:
            for rid in self._aborts:
                req = self._requests.get(rid)
                if req is not None:
                    self._finish(req, "abort")
            self._aborts.clear()

    @property
    def has_unfinished(self) -> bool:
        with self._cond:
            return self._has_work()

    def _has_work(self) -> bool:
        """Requests to serve, or a launched step still to read: aborting the last running
        request while its step is in flight leaves that step for the next call to read
        (an engine idle with an unread step keeps its results and, on a GPU, its
        buffers)."""
        return self.scheduler.has_work or self._in_flight is not None

    def num_generated(self, request_id: str) -> int:
        """Tokens a request has generated so far (0 once collected): progress for callers."""
        req = self._requests.get(request_id)
        if req is not None:
            return len(req.output_ids) - (req.output_ids[-1:] == [PENDING_TOKEN])
        done = self._results.get(request_id)  # finished, not yet collected
        return len(done.token_ids) if done is not None else 0

    def output_so_far(self, request_id: str) -> list[int]:
        """The tokens an unfinished request has generated so far ([] once it has finished):
        what add_request's resume_from takes to go on from here in another run."""
        req = self._requests.get(request_id)
        if req is None:
            return []
        out = list(req.output_ids)  # (one copy: the step thread appends to it)
        return out[:-1] if out[-1:] == [PENDING_TOKEN] else out

    def wait(self, request_id: str, timeout: float | None = None) -> RequestResult | None:
        """The request's result (removed from the engine), or None if not done in `timeout`.

        With the background loop running this only waits; without it, the calling thread
        drives the engine."""
        self._refuse_inside_step("wait()")
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
        """One result per prompt, in order. A prompt or params refused raises naming the
        prompt's index, and the prompts queued before it are aborted."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(plist)} SamplingParams")
        ids: list[str] = []
        results: list[RequestResult] = []
        try:
            for i, (p, sp) in enumerate(zip(prompts, plist, strict=True)):
                try:
                    ids.append(self.add_request(p, sp))
                except (ValueError, TypeError) as e:  # (of its kind: a subclass's own
                    # constructor may take other arguments)
                    kind = TypeError if isinstance(e, TypeError) else ValueError
                    raise kind(f"prompt {i} of {len(prompts)}: {e}") from e
            for rid in ids:
                results.append(self.wait(rid))
            return results
        finally:
            self._drop(ids[len(results):])

    def score(self, prompt: Prompt, continuations: list[str | list[int]]) -> list[float]:
        """Log-likelihood of each continuation after the prompt, computed in one batch.
        RequestAborted, naming it, if one of its requests was aborted (its sum would be of
        the tokens scored so far), RuntimeError if one failed; the others are then aborted."""
        if isinstance(continuations, str):  # (scored each of its characters)
            raise TypeError("continuations is a list of strings or of token-id lists, not a "
                            "string")
        ids: list[str] = []
        collected = 0  # of ids, those whose results were taken
        try:
            for c in continuations:
                ids.append(self.add_score_request(prompt, c))
            scores = []
            for rid in ids:
                result = self.wait(rid)
                collected += 1
                if result.finish_reason == "abort":
                    raise RequestAborted(rid, "score request")
                if result.finish_reason == "error":
                    raise RuntimeError(f"score request {rid!r} failed: {result.error}")
                scores.append(result.score)
            return scores
        finally:
            self._drop(ids[collected:])

    def _drop(self, request_ids: list[str]) -> None:
        """Abort these requests and discard their results: what a call that raised had
        queued, so that nothing of it runs on or stays in the engine."""
        self.abort(*request_ids)
        for rid in request_ids:
            self.wait(rid)

    def logits(self, token_ids: list[int], request_id: str | None = None) -> torch.Tensor:
        """Teacher-forced next-token logits [len, vocab] in fp32, through the paged path.
        request_id names the job, so that another thread can abort it (this call then
        raises RequestAborted)."""
        return self.collect_logits(self.add_logits_request(list(token_ids), request_id))

    def collect_logits(self, request_id: str) -> torch.Tensor:
        """Wait for a logits request (add_logits_request) and take its [len, vocab] logits;
        RequestAborted, naming it, if it was aborted (there are no logits to give: the rows
        so far are dropped), RuntimeError if its step failed."""
        result = self.wait(request_id)
        if result.finish_reason == "abort":
            raise RequestAborted(request_id, "logits request")
        if result.finish_reason == "error":
            raise RuntimeError(f"logits request {request_id!r} failed: {result.error}")
        # On the compute thread: a large copy here would give the caller an OpenMP team.
        return run_on_compute_thread(torch.cat, result.logit_rows)

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[int]:
        """Token ids as they are generated. RuntimeError, naming the request, if it failed
        on the way, RequestAborted if another caller aborted it: without them a stream cut
        short looked like a whole answer."""
        tokens: queue.SimpleQueue = queue.SimpleQueue()
        rid = self.add_request(prompt, params, on_token=tokens.put)
        try:
            while True:
                if self._loop is None:
                    while tokens.empty():
                        self.step()
                tok = tokens.get()
                if tok is None:
                    break
                yield tok
        finally:  # (also when the caller stops reading: the request is aborted)
            self.abort(rid)
            with self._cond:
                result = self._results.pop(rid, None)
        if result is not None and result.finish_reason == "error":
            raise RuntimeError(f"request {rid!r} failed: {result.error}")
        if result is not None and result.finish_reason == "abort":
            raise RequestAborted(rid)

    # ---- background loop -----------------------------------------------------------------

    def start_background_loop(self) -> None:
        """Steps the engine on a daemon thread, so that many threads can submit and wait."""
        with self._cond:
            if self._loop is not None:
                return
            self._stopping = False
            self._loop = threading.Thread(target=self._run_loop, name="llmdb-engine", daemon=True)
            self._loop.start()

    @property
    def background_loop_running(self) -> bool:
        return self._loop is not None

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
                while not self._has_work() and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    return
            self.step()  # (a step that fails ends its requests, not this thread)


@dataclass
class _InFlight:
    """A launched step not read yet: what it ran, who caught up, and (when it computes
    scores) each request's count of preemptions at launch."""

    scheduled: list[tuple[Request, int]]
    caught_up: list[Request]
    launched: LaunchedStep
    preemptions: list[int]


def refusal_text(e: Exception, request_id: str) -> str:
    """An add_*_request refusal's message without the request id _naming put at its end: for
    a caller whose ids are its own business (a server's, a row's), not its user's."""
    return str(e).removesuffix(f" (request {request_id!r})")


@contextmanager
def _naming(request_id: str) -> Iterator[None]:
    """An add_*_request refusal names its request at the end of its message (the exception
    itself, of its type): a caller that submitted many can tell which one was refused."""
    try:
        yield
    except (TypeError, ValueError) as e:
        if e.args and isinstance(e.args[0], str):
            e.args = (f"{e.args[0]} (request {request_id!r})", *e.args[1:])
        raise


def _check_contents(messages: Sequence[dict[str, Any]]) -> None:
    """OpenAI's rule for a chat message's content: null (or missing) only in an assistant
    message that makes tool_calls, which a template that writes tool calls renders. Other
    null contents reached the template, whose error (a TypeError adding None to text, or
    a missing attribute) named neither the message nor the field."""
    for i, m in enumerate(messages):
        if m.get("content") is None and not (m.get("role") == "assistant" and m.get("tool_calls")):
            state = "null" if "content" in m else "missing"
            raise ValueError(f"chat message {i} ({m.get('role')}): content is {state}; it must "
                             f"be text (null only in an assistant message with tool_calls)")


def _token_id(t: Any) -> int:
    """An int of an integer (numpy's and 0-d torch tensors' too); never of a float (int()
    made 1.5 token 1) or a chat message in a list of ids."""
    try:
        return operator.index(t)
    except TypeError:
        what = "a chat message" if isinstance(t, dict) else repr(t)
        raise TypeError(f"a prompt's token ids must be integers, got {what} (a chat prompt "
                        f"is a list of messages only)") from None


def without_partial_char(text: str) -> str:
    """An output cut at max_tokens can end inside a multi-byte character, which decodes to
    U+FFFD: the incomplete tail is dropped (never a whole character)."""
    return text.rstrip("\ufffd")


def _check_positive(**limits: int | None) -> None:
    """Limits of None are defaults; any other must be a positive integer: a step budget or
    sequence limit of 0 scheduled nothing, and the engine stepped for ever."""
    for name, v in limits.items():
        if v is not None and (not isinstance(v, numbers.Integral) or isinstance(v, bool)
                              or v < 1):
            raise ValueError(f"{name} must be a positive integer, got {v!r}")


def _parse_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    if dtype is None or dtype == "auto":
        return default_dtype(device)
    if isinstance(dtype, torch.dtype):
        return dtype
    table = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32,
             "float32": torch.float32, "fp16": torch.float16, "float16": torch.float16}
    if dtype not in table:
        raise ValueError(f"unknown dtype {dtype!r} (use 'auto', 'bf16', 'fp16' or 'fp32')")
    return table[dtype]


def _check_batch_invariant(kernels: str, device: torch.device) -> None:
    """batch_invariant=True takes the Triton kernels' invariant forms; on a GPU the others
    run cuBLAS's matmuls and torch's attention, whose reductions follow the batch's shape."""
    if device.type != "cpu" and kernels != "triton":
        raise ValueError(f"batch_invariant=True on {device} needs the Triton kernels "
                         f"(attention='auto' or 'triton'), not attention={kernels!r}: its "
                         "matmuls are cuBLAS's, which round a row by the batch's size")


def _kernel_set(attention: str, device: torch.device, dtype: torch.dtype) -> str:
    if attention == "fast":  # the name from before there were two fast paths
        warnings.warn("attention='fast' is deprecated: use 'auto' (the device's fast path) or "
                      "'cpu'", DeprecationWarning, stacklevel=3)
        attention = "auto"
    # The C++ kernels read bf16 and fp32 (fp16 has no fast path on a CPU, the torch reference
    # runs it).
    cpp = "cpu" if dtype in (torch.bfloat16, torch.float32) else "reference"
    if attention == "auto":
        return "triton" if device.type == "cuda" else cpp
    if attention not in KERNEL_SETS:
        raise ValueError(f"unknown attention {attention!r} (use 'auto' or one of "
                         f"{', '.join(KERNEL_SETS)})")
    if attention == "cpu" and device.type != "cpu":
        raise ValueError(f"the 'cpu' kernels cannot run on {device}")
    if attention == "cpu" and cpp != "cpu":
        raise ValueError(f"the 'cpu' kernels run bf16 and fp32, not {dtype} (use "
                         "attention='reference' or 'auto')")
    return attention
