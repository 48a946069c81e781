"""A seeded differential fuzz test of the engine: random configurations and workloads, each
request's answer compared with the same request served alone, and the pool checked.

Each seed draws
- an engine: a tiny random model (Llama GQA, Llama MHA or OPT, the last two with the
  hidden cache unless it is turned off), fp32 or bf16, a block size of 1 to 16 tokens, a
  pool from exactly the largest request's blocks (preemption all the time) to roomy, a step
  budget C from 1 token up and a prefill budget P <= C, max_num_seqs, prefix caching on or
  off, any policy of POLICIES, launch-ahead on or off;
- a workload: requests whose prompts share prefixes (ending on, one before and one past a
  block boundary, whole prompts repeated, prompts that continue another request's prompt
  and answer), greedy or seeded sampling (temperature, top_p, top_k), stop token ids and
  stop strings (some taken from the answer, so that they hit, some across tokens),
  log-probabilities, scoring, choice and logits (every position's) requests, a few prompts
  that run into the model's context, RT or BE, submitted at once or across steps, some
  aborted; a third of the seeds put many long requests at once on a pool about the size
  of the largest one.

and checks
- every request not aborted gets the tokens it gets alone on a fresh default engine
  (prefix caching off, block 16, sarathi, step by step), up to a near-tie of the reference
  logits at the first difference (tests/helpers.py's rule; for a sampled token, a near-tie
  of the Gumbel-perturbed scores or of the top-p cut); with equal tokens, the same finish
  reason, text and log-probabilities (to float noise); scores and logits likewise;
- an aborted request's tokens are a prefix of its answer alone, and it frees its blocks;
- finish reasons follow the tokens (length: max_tokens of them, or the context full;
  stop: the last is a stop token or EOS, or the text holds a stop string, and nothing
  stopped earlier);
- each step as the scheduler hands it over keeps to C, P and max_num_seqs (a prompt longer
  than C may run alone) and holds each request once, running, not evicted in that step;
- after every step the pool agrees with the requests: reference counts equal the block
  tables' uses, free blocks are exactly the unreferenced ones, a shared block is a published
  full block whose tokens are each sharer's own, a block still to be written is its
  request's alone, hidden halves match the pool's masks (a hidden request's KV prefix is
  published blocks it shares), waiting requests hold nothing, no
  block table covers less than its computed tokens;
- in the end every block is free, every reference count zero, the scheduler's queues and
  in-flight prefix claims empty; no request is lost or duplicated (one result each, one
  on_finish, its stream equal to its tokens and then None); no step fails (an overflowing
  allocation would fail its step), and no workload stalls.

Time is a fake clock that advances by a drawn tick per step, so that apt's pending times and
bros's deadlines (RT requests miss some) make a seed's run reproducible.

Not covered: the Triton and CUDA-graph paths (GPU only; the interpreter is too slow for
this), fp16, the background thread loop, callers on other threads.

CI runs CI_SEEDS; offline, as many as wanted:

    python -m tests.test_engine_fuzz --seeds 0:2000 [--verbose] [--show]
"""

from __future__ import annotations

import argparse
import contextlib
import random
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest
import torch

from llmdb.engine.cache.kv_cache import KVCache
from llmdb.engine.engine import LLMEngine
from llmdb.engine.params import SamplingParams
from llmdb.engine.sampling import gumbel_noise, row_key
from llmdb.engine.sched.policies import POLICIES
from llmdb.engine.sched.request import PENDING_TOKEN, Status

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from random_model import write_random_model  # noqa: E402

CI_SEEDS = range(50)
SHAPES = ["tiny-llama", "tiny-llama-mha", "tiny-opt"]
MODEL_SEED = 5
# The near-tie margin of the reference's logits (tests/helpers.py's in fp32), and how far
# log-probabilities, scores and logits may move. On this CPU none moved at all (950 jobs:
# the kernels give a row the same bits whatever the batch, chunking, block size or cache
# type); the margins leave room for kernels that do not, a few bf16 ulps in bf16.
NEAR_TIE = {"float32": 1e-4, "bfloat16": 1e-2}
LOGPROB_TOL = {"float32": 1e-5, "bfloat16": 1e-2}
MAX_CONTEXT = 512  # the tiny shapes'; a few prompts run into it


# ---- what a seed draws ----------------------------------------------------------------------

@dataclass
class Config:
    shape: str
    dtype: str
    block_size: int
    extra_blocks: int  # the pool: the largest request's blocks plus these
    max_num_batched_tokens: int
    max_prefill_tokens: int | None
    max_num_seqs: int
    prefix_caching: bool
    policy: str
    launch_ahead: bool
    hidden_cache: bool | None
    tick_s: float  # the fake clock's advance per step
    pressure: bool  # many long requests at once on a pool about the largest one's size


@dataclass
class Job:
    name: str
    kind: str  # "generate", "score", "choice" or "logits" (every position's, as logits())
    prompt: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    extra: list[int] = field(default_factory=list)  # the continuation or the candidates
    priority: str = "BE"
    submit_at: int = 0  # the step before which it is submitted
    abort_at: int | None = None  # the step before which it is aborted (if still running)

    @property
    def num_tokens(self) -> int:
        """What the engine admits it on: prompt plus max_tokens, or prompt plus continuation."""
        if self.kind == "generate":  # (the context ends a generation)
            return min(len(self.prompt) + self.params.max_tokens, MAX_CONTEXT)
        return len(self.prompt) + len(self.extra)


def draw_config(rng: random.Random) -> Config:
    policy = rng.choice(sorted(POLICIES))
    # The policies that choose hidden caches mostly get a model that has one.
    hybrid = policy in ("apt", "fcfs-hybrid") and rng.random() < 0.8
    shape = rng.choice(SHAPES[1:] if hybrid else SHAPES)
    c = rng.choice([1, 2, 3, 5, 8, 16, 33, 64, 1024])
    pressure = rng.random() < 0.3
    return Config(
        shape=shape,
        dtype="bfloat16" if rng.random() < 0.2 else "float32",
        block_size=rng.choice([1, 2, 3, 4, 4, 8, 16]),
        extra_blocks=rng.choice([0, 0, 1, 2] if pressure else [0, 1, 2, 4, 8, 32, 1000]),
        max_num_batched_tokens=c,
        max_prefill_tokens=rng.choice([None, None, max(1, c // 2), rng.randint(1, c)]),
        max_num_seqs=rng.choice([5, 64] if pressure else [1, 2, 3, 5, 64]),
        prefix_caching=rng.random() < 0.75,
        policy=policy,
        launch_ahead=rng.random() < 0.4,
        hidden_cache=None if shape == "tiny-llama" or rng.random() < 0.8 else False,
        tick_s=rng.choice([0.001, 0.02, 0.3]),
        pressure=pressure,
    )


def _tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    # Now and then an EOS or another special id inside a prompt.
    return [rng.randrange(0, vocab) if rng.random() < 0.03 else rng.randrange(3, vocab)
            for _ in range(n)]


def draw_jobs(rng: random.Random, cfg: Config, vocab: int, ref: Reference) -> list[Job]:
    """The workload; `ref` answers prompts alone, to take stop strings and tokens from an
    answer and to continue a prompt with its own answer."""
    bs = cfg.block_size
    prefixes = []
    for _ in range(rng.randint(1, 3)):
        k = rng.randint(1, max(1, 24 // bs))
        n = rng.choice([k * bs, k * bs + 1, max(1, k * bs - 1), rng.randint(1, 40)])
        prefixes.append(_tokens(rng, n, vocab))
    jobs: list[Job] = []
    n_jobs = rng.choice([14, 20] if cfg.pressure else [1, 2, 4, 6, 9, 14])
    staggered = rng.random() < (0.2 if cfg.pressure else 0.5)
    for i in range(n_jobs):
        r = rng.random()
        if jobs and r < 0.1:  # the same prompt again
            prompt = list(rng.choice(jobs).prompt)
        elif jobs and r < 0.2 and jobs[-1].kind == "generate":
            # Another prompt followed by its own answer: blocks of generated tokens are
            # published too.
            prev = rng.choice([j for j in jobs if j.kind == "generate"])
            answer = ref.tokens(replace(prev, params=SamplingParams(
                max_tokens=prev.params.max_tokens, ignore_eos=True)))
            prompt = prev.prompt + answer[: rng.randint(0, len(answer))]
            if rng.random() < 0.5:
                prompt += _tokens(rng, rng.randint(1, 6), vocab)
        elif r < 0.8:
            prompt = rng.choice(prefixes) + _tokens(rng, rng.choice([0, 0, 1, 2, 5, 13]), vocab)
        elif r < 0.985:
            prompt = _tokens(rng, rng.randint(1, rng.choice([8, 40, 90])), vocab)
        else:  # the model's context ends it
            prompt = _tokens(rng, rng.randint(MAX_CONTEXT - 40, MAX_CONTEXT - 1), vocab)
        prompt = prompt[: MAX_CONTEXT - 1] or _tokens(rng, 1, vocab)
        job = Job(f"j{i}", "generate", prompt, priority=rng.choice(["RT", "BE", "BE"]),
                  submit_at=rng.choice([0, 0, 1, 2, 5, 11, 30]) if staggered else 0)
        kind = rng.random()
        if kind < 0.08:
            job.kind, job.extra = "score", _tokens(rng, rng.randint(1, 12), vocab)
        elif kind < 0.13:
            job.kind = "choice"
            job.extra = rng.sample(range(vocab), rng.randint(1, 5))
        elif kind < 0.16:
            job.kind = "logits"
        else:
            job.params = _draw_params(rng, job, ref)
            if cfg.pressure and rng.random() < 0.7:
                job.params.max_tokens = rng.choice([24, 40, 64])
                job.params.ignore_eos = True
        if rng.random() < 0.12:
            job.abort_at = job.submit_at + rng.choice([0, 1, 2, 3, 6, 15])
        if job.kind == "generate" or job.num_tokens <= MAX_CONTEXT:
            jobs.append(job)
    return jobs


def _draw_params(rng: random.Random, job: Job, ref: Reference) -> SamplingParams:
    p = SamplingParams(max_tokens=rng.choice([1, 1, 2, 3, 5, 8, 13, 24, 40, 64]),
                       ignore_eos=rng.random() < 0.5)
    if rng.random() < 0.3:
        p.temperature = rng.choice([0.5, 1.0, 1.7])
        p.top_p = rng.choice([1.0, 1.0, 0.9, 0.5])
        p.top_k = rng.choice([0, 0, 1, 5, 40])
        p.seed = None if rng.random() < 0.1 else rng.randrange(1 << 40)
    if rng.random() < 0.5:
        p.logprobs = rng.choice([0, 1, 3])
    r = rng.random()
    if r < 0.3 and p.max_tokens > 1 and (p.seed is not None or p.greedy):
        # Stops taken from its answer alone, so that they hit (when the answer is long).
        answer = ref.tokens(replace(job, params=replace(p, stop=[], stop_token_ids=[])))
        if answer:
            at = rng.randrange(len(answer))
            if rng.random() < 0.5:
                p.stop_token_ids = [answer[at]]
            else:
                text = ref.engine(job).tokenizer.decode(answer[: at + 1])
                tail = text[-rng.randint(1, 10):].strip()  # (tokens are " w123")
                if tail:
                    p.stop = [tail]
    elif r < 0.4:
        p.stop_token_ids = rng.sample(range(3, 64), 2)
    elif r < 0.45:
        p.stop = ["w1", "zzz"]
    return p


# ---- the reference --------------------------------------------------------------------------

class Reference:
    """Tiny models written once, a default engine per model and dtype, and the answers of
    requests served alone on it (memoized: workloads repeat prompts)."""

    def __init__(self, root: Path):
        self.paths = {s: write_random_model(s, root / s, seed=MODEL_SEED, dtype=torch.float32,
                                            device="cpu") for s in SHAPES}
        self.shape, self.dtype = SHAPES[0], "float32"
        self._engines: dict[tuple[str, str], LLMEngine] = {}
        self._answers: dict[tuple, object] = {}

    def use(self, cfg: Config) -> None:
        self.shape, self.dtype = cfg.shape, cfg.dtype

    def engine(self, job: Job | None = None) -> LLMEngine:
        key = (self.shape, self.dtype)
        if key not in self._engines:
            # Prefix caching off: each answer is computed from scratch, whatever came before.
            self._engines[key] = LLMEngine(
                str(self.paths[self.shape]), device="cpu", dtype=self.dtype, threads=1,
                kv_cache_bytes=4 << 20, enable_prefix_caching=False, launch_ahead=False)
        return self._engines[key]

    def result(self, job: Job):
        p = job.params
        key = (self.shape, self.dtype, job.kind, tuple(job.prompt), tuple(job.extra),
               p.max_tokens, p.temperature, p.top_p, p.top_k, p.seed, tuple(p.stop),
               tuple(p.stop_token_ids), p.ignore_eos, p.logprobs)
        if key not in self._answers:
            eng = self.engine()
            if job.kind == "logits":
                self._answers[key] = eng.logits(job.prompt)
                return self._answers[key]
            if job.kind == "score":
                rid = eng.add_score_request(job.prompt, job.extra)
            elif job.kind == "choice":
                rid = eng.add_choice_request(job.prompt, job.extra)
            else:
                rid = eng.add_request(job.prompt, replace(p, stop=list(p.stop),
                                                          stop_token_ids=list(p.stop_token_ids)))
            self._answers[key] = eng.wait(rid)
        return self._answers[key]

    def tokens(self, job: Job) -> list[int]:
        return self.result(job).token_ids

    def logits(self, ids: list[int]) -> torch.Tensor:
        return self.engine().logits(ids)[-1].float()


def near_tie(ref: Reference, job: Job, want: list[int], got: list[int]) -> str | None:
    """None if got == want, or if at the first difference the reference's choice was a
    near-tie (greedy: its top-2 logits; sampled: its perturbed scores or its top-p cut);
    else what differs."""
    if want == got:
        return None
    i = next((k for k, (a, b) in enumerate(zip(want, got, strict=False)) if a != b),
             min(len(want), len(got)))
    logits = ref.logits(job.prompt + want[:i])
    tol = NEAR_TIE[ref.dtype]
    p = job.params
    if p.greedy:
        top2 = logits.topk(2).values
        margin = float(top2[0] - top2[1])
    else:
        margin = _sampling_margin(logits, p, row_key(p.seed, i))
        tol /= p.temperature
    if margin < tol:
        return None
    return (f"tokens differ at generated position {i}: alone {want[i:i + 3]} got "
            f"{got[i:i + 3]} (lengths {len(want)}, {len(got)}), reference margin {margin:.3g}")


def _sampling_margin(logits: torch.Tensor, p: SamplingParams, key: int) -> float:
    """How far the sampler's draw from these logits is from going another way: the gap
    between the best two perturbed scores left after top-k / top-p, or between the top-p
    cut and the nearest cumulative probability."""
    scaled = logits / p.temperature
    vocab = scaled.shape[-1]
    sorted_logits, order = scaled.sort(descending=True)
    rank = torch.arange(vocab)
    drop = rank >= (p.top_k or vocab)
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(-1)
    before = probs.cumsum(-1) - probs
    drop |= before >= p.top_p
    cut = float((before[~drop] - p.top_p).abs().min()) if p.top_p < 1 else float("inf")
    noise = gumbel_noise(torch.tensor([key]), vocab)[0][order]
    scores = (sorted_logits + noise).masked_fill(drop, float("-inf"))
    top2 = scores.topk(2).values
    gap = float(top2[0] - top2[1]) if torch.isfinite(top2[1]) else float("inf")
    return min(gap, cut * p.temperature)


# ---- running a seed -------------------------------------------------------------------------

class FakeClock:
    """time.perf_counter while a seed runs: advanced by the driver only."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@contextlib.contextmanager
def fake_time(clock: FakeClock):
    real = time.perf_counter
    time.perf_counter = clock
    try:
        yield
    finally:
        time.perf_counter = real


@dataclass
class Outcome:
    results: dict[str, object] = field(default_factory=dict)
    streamed: dict[str, list] = field(default_factory=dict)
    finished: Counter = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)
    stats: Counter = field(default_factory=Counter)


def make_engine(ref: Reference, cfg: Config, jobs: list[Job]) -> LLMEngine:
    path = ref.paths[cfg.shape]
    probe = ref.engine()
    per_block = KVCache.bytes_per_block(probe.config, cfg.block_size,
                                        getattr(torch, cfg.dtype))
    largest = max(-(-j.num_tokens // cfg.block_size) for j in jobs)
    return LLMEngine(
        str(path), device="cpu", dtype=cfg.dtype, threads=1,
        kv_cache_bytes=(largest + cfg.extra_blocks) * per_block, block_size=cfg.block_size,
        max_num_batched_tokens=cfg.max_num_batched_tokens,
        max_prefill_tokens=cfg.max_prefill_tokens, max_num_seqs=cfg.max_num_seqs,
        enable_prefix_caching=cfg.prefix_caching, policy=cfg.policy,
        launch_ahead=cfg.launch_ahead, hidden_cache=cfg.hidden_cache)


def submit(eng: LLMEngine, job: Job, out: Outcome) -> None:
    streamed = out.streamed.setdefault(job.name, [])

    def finished(rid: str) -> None:
        out.finished[rid] += 1

    if job.kind == "logits":
        eng.add_logits_request(job.prompt, request_id=job.name, on_finish=finished,
                               priority=job.priority)
    elif job.kind == "score":
        eng.add_score_request(job.prompt, job.extra, request_id=job.name, on_finish=finished,
                              priority=job.priority)
    elif job.kind == "choice":
        eng.add_choice_request(job.prompt, job.extra, request_id=job.name, on_finish=finished,
                               priority=job.priority)
    else:
        p = job.params
        eng.add_request(job.prompt, replace(p, stop=list(p.stop),
                                            stop_token_ids=list(p.stop_token_ids)),
                        request_id=job.name, on_token=streamed.append, on_finish=finished,
                        priority=job.priority)


def drive(eng: LLMEngine, cfg: Config, jobs: list[Job]) -> Outcome:
    """Submit, abort and step as the jobs say, checking the pool after every step."""
    out = Outcome()
    clock = FakeClock()

    def observe(sched_out) -> None:
        out.stats["preemptions"] += len(sched_out.preempted)
        out.stats["conversions"] += len(sched_out.converted)
        out.stats["chunks"] += sum(1 for r, n in sched_out.scheduled
                                   if not r.is_decode and r.num_computed + n < r.num_tokens)
        out.stats["hidden steps"] += any(r.cache_type == "hidden"
                                         for r, _ in sched_out.scheduled)
        out.problems += [f"step {out.stats['steps'] + 1}: {p}"
                         for p in batch_problems(eng, sched_out)]

    eng.scheduler.observers.append(observe)
    total = sum(j.num_tokens for j in jobs)
    limit = 40 * total + 200 + max(j.submit_at for j in jobs)
    step = 0
    with fake_time(clock):
        while True:
            for job in jobs:
                if job.submit_at == step:
                    submit(eng, job, out)
                    eng._requests[job.name].arrival = clock.now
            for job in jobs:
                if job.abort_at == step and job.name in eng._requests:
                    eng.abort(job.name)
                    out.stats["aborted"] += 1
            if not eng.has_unfinished and step > max(j.submit_at for j in jobs):
                break
            if step > limit:
                out.problems.append(f"stalled: {step} steps for {total} tokens "
                                    f"({len(eng.scheduler.waiting)} waiting, "
                                    f"{len(eng.scheduler.running)} running)")
                return out
            clock.now += cfg.tick_s
            eng.step()
            step += 1
            out.stats["steps"] += 1
            if out.problems:
                return out
            problems = pool_problems(eng)
            if problems:
                out.problems += [f"after step {step}: {p}" for p in problems]
                return out
    for job in jobs:
        try:
            out.results[job.name] = eng.wait(job.name, timeout=0)
        except KeyError:
            out.problems.append(f"{job.name}: lost (no result)")
    for job in jobs:
        with contextlib.suppress(KeyError):
            eng.wait(job.name, timeout=0)
            out.problems.append(f"{job.name}: a second result")
    out.problems += end_problems(eng)
    return out


def batch_problems(eng: LLMEngine, sched_out) -> list[str]:
    """A step as the scheduler hands it over (before it runs): within C, P and
    max_num_seqs (a whole-prompt policy runs a prompt longer than C alone), each request
    once, running, with tokens left to compute."""
    s = eng.scheduler
    batch = sched_out.scheduled
    problems = []
    ids = [r.request_id for r, _ in batch]
    if len(set(ids)) != len(ids):
        problems.append(f"a request twice in one step: {ids}")
    if len(batch) > s.max_num_seqs or len(s.running) > s.max_num_seqs:
        problems.append(f"{len(batch)} scheduled, {len(s.running)} running, max_num_seqs "
                        f"{s.max_num_seqs}")
    tokens = sum(n for _, n in batch)
    prefill = sum(n for r, n in batch if not r.is_decode)
    if len(batch) > 1 and (tokens > s.max_num_batched_tokens
                           or prefill > s.max_prefill_tokens):
        problems.append(f"{tokens} tokens ({prefill} prefill) in a step of "
                        f"{len(batch)}; C {s.max_num_batched_tokens}, P {s.max_prefill_tokens}")
    preempted = {id(r) for r in sched_out.preempted}
    for r, n in batch:
        if r.status is not Status.RUNNING or id(r) in preempted:
            problems.append(f"{r.request_id} scheduled as {r.status} (preempted: "
                            f"{id(r) in preempted})")
        if n < 1 or r.num_computed + n > r.num_tokens:
            problems.append(f"{r.request_id}: {n} tokens from {r.num_computed} of "
                            f"{r.num_tokens}")
    return problems


def pool_problems(eng: LLMEngine) -> list[str]:
    """The pool against the requests that hold blocks (between steps)."""
    pool, s = eng.pool, eng.scheduler
    bs, nb = pool.block_size, pool.num_blocks
    problems = []
    holders = list(s.running) + list(s.held.values())
    if len({id(r) for r in holders}) != len(holders):
        problems.append("a request is both running and held, or twice running")
    refs = [0] * nb
    masks: dict[int, int] = {}
    users: dict[int, list[tuple]] = {}
    for r in holders:
        if r.status is not Status.RUNNING:
            problems.append(f"{r.request_id} holds blocks as {r.status}")
        if r.cache_type == "hidden":
            # Its KV prefix: published blocks, read and never written.
            for i, b in enumerate(r.block_ids[: r.num_kv_prefix]):
                refs[b] += 1
                users.setdefault(b, []).append((r, i))
                if b not in pool._hash_of:
                    problems.append(f"{r.request_id}'s KV prefix block {b} is unpublished")
            if r.num_kv_prefix * bs > r.num_computed:
                problems.append(f"{r.request_id}: a KV prefix of {r.num_kv_prefix} blocks "
                                f"with {r.num_computed} tokens computed")
            for u in r.block_ids[r.num_kv_prefix :]:
                half, b = divmod(u, nb)
                if masks.get(b, 0) & (1 << half):
                    problems.append(f"half {u} used twice")
                masks[b] = masks.get(b, 0) | (1 << half)
        else:
            for i, b in enumerate(r.block_ids):
                refs[b] += 1
                users.setdefault(b, []).append((r, i))
            # The block the next token goes into is this request's alone and unpublished
            # (a block is published only once full, and then never written again).
            for i in range(r.num_computed // bs, len(r.block_ids)):
                b = r.block_ids[i]
                if b in pool._hash_of:
                    problems.append(f"{r.request_id} will write into published block {b}")
        if len(r.block_ids) < pool.blocks_for(r.num_computed):
            problems.append(f"{r.request_id}: {len(r.block_ids)} blocks for {r.num_computed} "
                            "computed tokens")
        if r.num_computed > r.num_tokens:
            problems.append(f"{r.request_id}: computed {r.num_computed} of {r.num_tokens}")
    for b, mask in masks.items():
        refs[b] += 1
        if pool._halves_used.get(b) != mask:
            problems.append(f"block {b}: halves {pool._halves_used.get(b)} in the pool, "
                            f"{mask} in the tables")
    if set(pool._halves_used) != set(masks):
        problems.append(f"hidden blocks {sorted(set(pool._halves_used) - set(masks))} "
                        "held by nobody")
    if refs != pool.ref_count:
        bad = [b for b in range(nb) if refs[b] != pool.ref_count[b]][:5]
        problems.append("reference counts differ from the tables at blocks " + ", ".join(
            f"{b} (pool {pool.ref_count[b]}, tables {refs[b]})" for b in bad))
    free = {b for b in range(nb) if pool.ref_count[b] == 0}
    if set(pool._free) != free:
        problems.append(f"free list {len(pool._free)} blocks, unreferenced {len(free)}")
    for b, sharers in users.items():
        if b in pool._hash_of:
            want = pool._tokens_of[b]
            for r, i in sharers:
                if i >= r.num_computed // bs:
                    continue  # (checked above)
                if tuple(r.token_slice(i * bs, bs)) != want:
                    problems.append(f"{r.request_id} block {i} is published block {b} of "
                                    "other tokens")
        elif len(sharers) > 1:
            problems.append(f"unpublished block {b} shared by "
                            f"{[r.request_id for r, _ in sharers]}")
    for h, b in pool._cached.items():
        if pool._hash_of.get(b) != h or len(pool._tokens_of.get(b, ())) != bs:
            problems.append(f"prefix cache entry {b} is inconsistent")
    for r in s.waiting:
        if r.block_ids or r.num_computed or r.num_kv_prefix:
            problems.append(f"waiting {r.request_id} holds {len(r.block_ids)} blocks, "
                            f"{r.num_computed} computed, a KV prefix of {r.num_kv_prefix}")
        if r.status is not Status.WAITING:
            problems.append(f"{r.request_id} is {r.status} in the waiting queue")
    return problems


def end_problems(eng: LLMEngine) -> list[str]:
    pool, s = eng.pool, eng.scheduler
    problems = []
    if pool.num_free != pool.num_blocks or any(pool.ref_count):
        problems.append(f"{pool.num_blocks - pool.num_free} blocks not freed "
                        f"(reference counts sum {sum(pool.ref_count)})")
    if pool._halves_used or pool._half_free:
        problems.append("hidden halves left in use")
    if s.waiting or s.running or s.held or s._computing:
        problems.append(f"scheduler not empty: {len(s.waiting)} waiting, {len(s.running)} "
                        f"running, {len(s.held)} held, {len(s._computing)} prefix claims")
    if eng._requests or eng._results or eng._stop_watches or eng._in_flight is not None:
        problems.append("engine tables not empty")
    return problems


def job_problems(ref: Reference, cfg: Config, job: Job, out: Outcome) -> list[str]:
    r = out.results.get(job.name)
    if r is None:
        return []
    where = f"{job.name} ({job.kind}, {len(job.prompt)} prompt tokens)"
    problems = []
    if out.finished[job.name] != 1:
        problems.append(f"{where}: on_finish called {out.finished[job.name]} times")
    if r.finish_reason == "error":
        return [f"{where}: error {r.error}"]
    aborted = r.finish_reason == "abort"
    if aborted and job.abort_at is None:
        problems.append(f"{where}: aborted without an abort")
    u = r.usage
    if u.prompt_tokens != len(job.prompt) + (len(job.extra) if job.kind == "score" else 0):
        problems.append(f"{where}: prompt_tokens {u.prompt_tokens}")
    if u.cached_tokens % cfg.block_size or u.cached_tokens >= max(u.prompt_tokens, 1) or (
            u.cached_tokens and not cfg.prefix_caching):
        problems.append(f"{where}: cached_tokens {u.cached_tokens} of {u.prompt_tokens}")
    if job.kind != "generate":
        if aborted:
            return problems
        want = ref.result(job)
        if r.finish_reason != "stop" or r.token_ids:
            problems.append(f"{where}: finish {r.finish_reason}, tokens {r.token_ids}")
        if job.kind == "logits":
            rows = r.logit_rows
            got = torch.cat(rows) if rows else torch.zeros(0, want.shape[1])
            if got.shape != want.shape:
                return problems + [f"{where}: logits {tuple(got.shape)}, alone "
                                   f"{tuple(want.shape)}"]
            return problems + _close(where, "logits", want.flatten().tolist(),
                                     got.flatten().tolist(), LOGPROB_TOL[cfg.dtype])
        got_lp = r.continuation_logprobs if job.kind == "score" else r.candidate_logprobs
        want_lp = (want.continuation_logprobs if job.kind == "score"
                   else want.candidate_logprobs)
        problems += _close(where, "scores", want_lp, got_lp, LOGPROB_TOL[cfg.dtype])
        return problems
    p = job.params
    tokens = r.token_ids
    if u.generated_tokens != len(tokens) or PENDING_TOKEN in tokens:
        problems.append(f"{where}: generated_tokens {u.generated_tokens}, tokens {tokens}")
    if out.streamed[job.name] != tokens + [None]:
        problems.append(f"{where}: streamed {out.streamed[job.name]} for {tokens}")
    if p.logprobs is not None and len(r.logprobs or []) != len(tokens):
        problems.append(f"{where}: {len(r.logprobs or [])} logprobs for {len(tokens)} tokens")
    problems += _finish_problems(ref.engine(), where, job, r)
    if p.seed is None and not p.greedy:
        return problems  # drawn with the engine's own seed: nothing to compare
    want = ref.result(job)
    if aborted:
        diff = near_tie(ref, job, want.token_ids[: len(tokens)], tokens)
        if len(tokens) > len(want.token_ids):
            diff = f"aborted with {len(tokens)} tokens, alone it stops at {len(want.token_ids)}"
        if diff:
            problems.append(f"{where}: aborted: {diff}")
        return problems
    diff = near_tie(ref, job, want.token_ids, tokens)
    if diff:
        problems.append(f"{where}: {diff} [{p}]")
    elif tokens != want.token_ids:
        out.stats[f"near-ties taken ({cfg.dtype})"] += 1
    else:
        if (r.finish_reason, r.text) != (want.finish_reason, want.text):
            problems.append(f"{where}: finish {r.finish_reason} {r.text!r}, alone "
                            f"{want.finish_reason} {want.text!r}")
        if p.logprobs is not None:
            tol = LOGPROB_TOL[cfg.dtype]
            problems += _close(where, "logprobs", [x for x, _ in want.logprobs],
                               [x for x, _ in r.logprobs], tol)
            problems += _close(where, "top logprobs",
                               [v for _, top in want.logprobs for v in sorted(top.values())],
                               [v for _, top in r.logprobs for v in sorted(top.values())], tol)
    return problems


def _close(where: str, what: str, want: list[float], got: list[float], tol: float) -> list[str]:
    if len(want) != len(got):
        return [f"{where}: {len(got)} {what}, alone {len(want)}"]
    worst = max((abs(a - b) for a, b in zip(want, got, strict=True)), default=0.0)
    return [f"{where}: {what} differ by {worst:.3g} from alone"] if worst > tol else []


def _finish_problems(eng: LLMEngine, where: str, job: Job, r) -> list[str]:
    """The finish reason the tokens call for."""
    p, tokens = job.params, r.token_ids
    stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eng.config.eos_token_ids))
    decode = eng.tokenizer.decode
    if any(t in stops for t in tokens[:-1]):
        return [f"{where}: went on after a stop token: {tokens}"]
    if p.stop and any(s in decode(tokens[:k]) for k in range(len(tokens))
                      for s in p.stop):
        return [f"{where}: went on after a stop string {p.stop}: {decode(tokens)!r}"]
    if len(job.prompt) + len(tokens) > job.num_tokens:
        return [f"{where}: {len(tokens)} tokens, max_tokens {p.max_tokens}"]
    if r.finish_reason == "abort":
        return []
    stopped = bool(tokens) and (tokens[-1] in stops
                                or any(s in decode(tokens) for s in p.stop))
    at_length = len(job.prompt) + len(tokens) == job.num_tokens  # max_tokens or the context
    want = "stop" if stopped else "length" if at_length else None
    if r.finish_reason != want:
        return [f"{where}: finish {r.finish_reason} after {len(tokens)} tokens "
                f"(max_tokens {p.max_tokens}, stops {p.stop_token_ids} {p.stop}), want {want}"]
    if any(s in r.text for s in p.stop):
        return [f"{where}: text {r.text!r} holds a stop string"]
    return []


def generate(seed: int, ref: Reference) -> tuple[Config, list[Job]]:
    rng = random.Random(seed)
    cfg = draw_config(rng)
    ref.use(cfg)
    jobs = draw_jobs(rng, cfg, ref.engine().config.vocab_size, ref)
    return cfg, jobs


def check(seed: int, ref: Reference) -> tuple[list[str], Outcome]:
    cfg, jobs = generate(seed, ref)
    eng = make_engine(ref, cfg, jobs)
    out = drive(eng, cfg, jobs)
    if not out.problems:
        for job in jobs:
            out.problems += job_problems(ref, cfg, job, out)
    for job in jobs:  # what the seed exercised, for the offline summary
        r = out.results.get(job.name)
        out.stats[f"{job.kind} jobs"] += 1
        if r is not None:
            out.stats[f"finished: {r.finish_reason}"] += 1
            out.stats["prefix hits"] += r.usage.cached_tokens > 0
    return out.problems, out


def describe(seed: int, ref: Reference) -> str:
    cfg, jobs = generate(seed, ref)
    lines = [f"seed {seed}: {cfg}"]
    for j in jobs:
        lines.append(f"  {j.name} {j.kind} {j.priority} at {j.submit_at} abort {j.abort_at} "
                     f"prompt[{len(j.prompt)}]={j.prompt} extra={j.extra} {j.params}")
    return "\n".join(lines)


# ---- CI ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ref(tmp_path_factory) -> Reference:
    return Reference(tmp_path_factory.mktemp("fuzz_models"))


@pytest.mark.parametrize("seed", CI_SEEDS)
def test_random_workload(ref, seed):
    problems, _ = check(seed, ref)
    assert not problems, describe(seed, ref) + "\n" + "\n".join(problems)


# ---- regressions: minimized seeds --------------------------------------------------------------

def _tiny(ref: Reference, shape: str = "tiny-llama", **kw) -> LLMEngine:
    kw.setdefault("kv_cache_bytes", 1 << 20)
    return LLMEngine(str(ref.paths[shape]), device="cpu", dtype="float32", threads=1, **kw)


def test_aborting_the_last_request_with_its_step_in_flight_leaves_no_step_unread(ref):
    """Seeds 16 and 29: launching ahead, the only request is aborted while its step is in
    flight. has_unfinished said False, so nothing read that step: the engine sat idle with
    it (the background loop too)."""
    eng = _tiny(ref, launch_ahead=True)
    rid = eng.add_request(list(range(5, 22)), SamplingParams(max_tokens=3))
    eng.step()
    assert eng._in_flight is not None
    eng.abort(rid)
    assert eng.has_unfinished
    eng.step()
    assert not eng.has_unfinished and eng._in_flight is None
    assert eng.wait(rid).finish_reason == "abort"


def _serve(eng: LLMEngine, jobs: list[Job], tick_s: float = 0.02) -> list:
    """The jobs' results, stepped on the fake clock; a stall fails."""
    out = drive(eng, replace(draw_config(random.Random(0)), tick_s=tick_s), jobs)
    assert not out.problems, out.problems
    return [out.results[j.name] for j in jobs]


def _check_alone(ref: Reference, shape: str, jobs: list[Job], results: list) -> None:
    ref.shape, ref.dtype = shape, "float32"
    for job, r in zip(jobs, results, strict=True):
        assert near_tie(ref, job, ref.tokens(job), r.token_ids) is None, job.name


def test_bros_requests_that_cannot_evict_each_other_do_not_deadlock(ref):
    """Seed 187: two RT requests fill the pool, a decode (the more urgent) and a prefill
    (further along), each needing a block. bros lets a request evict only less urgent RT
    work that is not further along, so neither could evict the other, and every step came
    out empty for ever. Now the request furthest along runs alone, evicting the other."""
    rng = random.Random(1)
    jobs = [Job("decode", "generate", _tokens(rng, 23, 300), priority="RT",
                params=SamplingParams(max_tokens=24, ignore_eos=True)),
            Job("prefill", "generate", _tokens(rng, 48, 300), priority="RT",
                params=SamplingParams(max_tokens=3, ignore_eos=True))]
    eng = _tiny(ref, "tiny-llama-mha", policy="bros", block_size=2, kv_cache_bytes=34 * 2 * 1536,
                max_num_batched_tokens=64, max_prefill_tokens=32, enable_prefix_caching=False)
    assert eng.pool.num_blocks == 34
    _check_alone(ref, "tiny-llama-mha", jobs, _serve(eng, jobs))


def test_bros_at_one_token_a_step_serves_the_request_holding_the_memory(ref):
    """Seed 1073: one token a step, three RT prompts that do not fit the pool together.
    When nothing could run, evicting the least advanced request was not enough: at C = 1
    the more urgent prompts (more chunks left) took every step, and the one holding most
    of the pool, the least urgent, never ran; the others could not finish without its
    blocks. The request furthest along now runs alone in such a step."""
    rng = random.Random(3)
    jobs = [Job(f"r{i}", "generate", _tokens(rng, p, 300), priority="RT",
                params=SamplingParams(max_tokens=m, ignore_eos=True))
            for i, (p, m) in enumerate([(26, 1), (26, 8), (18, 8)])]
    eng = _tiny(ref, "tiny-llama-mha", policy="bros", block_size=4, kv_cache_bytes=11 * 4 * 1536,
                max_num_batched_tokens=1, enable_prefix_caching=False)
    assert eng.pool.num_blocks == 11
    _check_alone(ref, "tiny-llama-mha", jobs, _serve(eng, jobs))


def test_bros_evicting_the_holder_of_a_prefix_hit_counts_its_blocks_again(ref):
    """Seed 3 (pressure): an RT request whose prefix hit lay in the blocks of a running BE
    request evicted that request to make room, on its block count from before the
    eviction. The hit's blocks were then unreferenced, to be taken off the free list too,
    and the allocation overflowed the pool (RuntimeError out of step())."""
    rng = random.Random(4)
    shared = _tokens(rng, 8, 300)  # two full blocks
    jobs = [Job("be", "generate", shared + [5], priority="BE",
                params=SamplingParams(max_tokens=3, ignore_eos=True)),
            Job("rt-long", "generate", _tokens(rng, 35, 300), priority="RT",
                params=SamplingParams(max_tokens=2, ignore_eos=True)),
            Job("rt-hit", "generate", shared + _tokens(rng, 9, 300), priority="RT",
                submit_at=1, params=SamplingParams(max_tokens=4, ignore_eos=True))]
    eng = _tiny(ref, policy="bros", block_size=4, kv_cache_bytes=12 * 4 * 768)
    assert eng.pool.num_blocks == 12
    _check_alone(ref, "tiny-llama", jobs, _serve(eng, jobs))


def test_bros_keeps_decodes_within_the_step_budget(ref):
    """Seeds 1, 90, 117, 143: bros gave a decode its token whatever the step had left: at
    C = 1 a late prompt's 1-token chunk and a decode ran together."""
    rng = random.Random(5)
    jobs = [Job("decode", "generate", _tokens(rng, 3, 300), priority="RT",
                params=SamplingParams(max_tokens=6, ignore_eos=True)),
            Job("late", "generate", _tokens(rng, 5, 300), priority="RT", submit_at=2,
                params=SamplingParams(max_tokens=6, ignore_eos=True))]
    eng = _tiny(ref, policy="bros", max_num_batched_tokens=1)
    _check_alone(ref, "tiny-llama", jobs, _serve(eng, jobs, tick_s=0.3))


def test_bros_does_not_readmit_a_request_it_evicted_in_the_same_step(ref):
    """Seed 39: a decode needing a block evicted a less urgent RT request, which the RT
    loop then found waiting and admitted again in the same step: its cache thrown away
    and its recompute started at once, in memory the eviction was meant to free."""
    rng = random.Random(6)
    jobs = [Job("a", "generate", _tokens(rng, 8, 300), priority="RT",
                params=SamplingParams(max_tokens=12, ignore_eos=True)),
            Job("b", "generate", _tokens(rng, 13, 300), priority="RT",
                params=SamplingParams(max_tokens=12, ignore_eos=True))]
    eng = _tiny(ref, policy="bros", block_size=4, kv_cache_bytes=10 * 4 * 768,
                max_num_batched_tokens=16, enable_prefix_caching=False)
    _check_alone(ref, "tiny-llama", jobs, _serve(eng, jobs))


def test_rr_requests_of_two_classes_do_not_evict_each_other_for_ever(ref):
    """Seed 354: an RT and a BE request that do not fit the pool together. rr's batches
    hold one class, and each turn's request evicted the newest other running request, the
    other class's, which came back on its own turn and evicted it in turn: no request
    finished in 6,800 steps. Now only newer work is evicted, and a newer request yields."""
    rng = random.Random(2)
    jobs = [Job("be", "generate", _tokens(rng, 22, 300), priority="BE",
                params=SamplingParams(max_tokens=8, ignore_eos=True)),
            Job("rt", "generate", _tokens(rng, 30, 300), priority="RT",
                params=SamplingParams(max_tokens=5, ignore_eos=True))]
    eng = _tiny(ref, policy="rr", block_size=1, kv_cache_bytes=36 * 768,
                max_num_batched_tokens=5, enable_prefix_caching=False)
    assert eng.pool.num_blocks == 36
    _check_alone(ref, "tiny-llama", jobs, _serve(eng, jobs))


# ---- offline ----------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", default="0:200", help="START:STOP")
    ap.add_argument("--verbose", action="store_true")
    ap.add_argument("--show", action="store_true", help="print the workloads only")
    ap.add_argument("--models", default=None, help="where the tiny models are written")
    args = ap.parse_args(argv)
    start, stop = (int(x) for x in args.seeds.split(":"))
    root = Path(args.models or tempfile.mkdtemp(prefix="engine_fuzz_"))
    ref = Reference(root)
    if args.show:
        for seed in range(start, stop):
            print(describe(seed, ref))
        return 0
    stats: Counter = Counter()
    t0 = time.time()
    bad = 0
    for seed in range(start, stop):
        try:
            problems, out = check(seed, ref)
            stats.update(out.stats)
        except Exception as e:  # noqa: BLE001 - the harness's or the engine's, reported
            problems = [f"exception: {e!r}"]
        stats["seeds"] += 1
        if problems:
            bad += 1
            print(f"--- {describe(seed, ref)}")
            for p in problems[:8]:
                print("   ", p)
            sys.stdout.flush()
        elif args.verbose:
            print(seed, "ok", dict(out.stats))
    for k, n in stats.most_common():
        print(f"{n:8d}  {k}")
    print(f"{stats['seeds']} seeds, {bad} with problems, {time.time() - t0:.0f} s")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
