"""The simulator's prefix caching (SimConfig.prefix_caching / cached_prefixes, RequestSpec.
prompt_ids) and the scheduler's seeding of cached blocks (Scheduler.seed_cached).

Proved, with InferMax's llama2-7b-a100 cost model (linear, no floor, so times are exact sums)
and blocks of 16 tokens: requests sharing a 256-token prefix compute it once with caching (the
exact chunks the cost model is charged, the step count and the end time are those of "the
first request computes its whole prompt, the others their 16-token suffix over 256 cached
tokens"), versus every prompt in full without; a seeded prefix makes the first request hit
too, and a suffix is charged exactly its cached tokens as context; without prompt_ids caching
changes nothing; seed_cached leaves every block free yet findable by the scheduler's own
chained hashes, and seeding twice takes no more blocks.
"""

from __future__ import annotations

import random

import pytest

from llmdb.engine.cache.block_pool import BlockPool
from llmdb.engine.costmodel import Chunk, preset
from llmdb.engine.params import SamplingParams
from llmdb.engine.research.sim import SimConfig, simulate
from llmdb.engine.research.workloads import RequestSpec, dataset
from llmdb.engine.sched.policies import make_policy
from llmdb.engine.sched.request import Request
from llmdb.engine.sched.scheduler import Scheduler

BS = 16
N = 4
PREFIX = tuple(random.Random(0).sample(range(1, 30_000), 256))
SUFFIXES = [tuple(range(40_000 + 100 * i, 40_000 + 100 * i + 16)) for i in range(N)]


def _specs(with_ids: bool = True) -> list[RequestSpec]:
    return [RequestSpec(0.0, 272, 1, "RT", f"r{i}", PREFIX + s if with_ids else None)
            for i, s in enumerate(SUFFIXES)]


def _recording_cost_model():
    """The llama2 preset, with every batch it is charged for recorded."""
    cm = preset("llama2-7b-a100")
    log: list[list[Chunk]] = []
    step_time = cm.step_time

    def recording(chunks):
        log.append(list(chunks))
        return step_time(chunks)

    cm.step_time = recording
    return cm, step_time, log


def _run(specs, num_blocks: int = 256, **cfg):
    cm, step_time, log = _recording_cost_model()
    result = simulate(specs, "sarathi", cm, SimConfig(num_blocks, block_size=BS, **cfg))
    assert all(m.finished for m in result.requests)
    return result, log, step_time


def _prefill_tokens(log) -> int:
    return sum(c.tokens for batch in log for c in batch if not c.decode)


def test_shared_prefix_is_computed_once():
    cold, cold_log, step_time = _run(_specs(), prefix_caching=False)
    warm, warm_log, _ = _run(_specs(), prefix_caching=True)
    # Without caching every prompt is computed in full.
    assert _prefill_tokens(cold_log) == N * 272
    # With it: the first request computes its whole prompt (the others wait for the prefix
    # blocks it is computing), then each other one its suffix over the 256 cached tokens.
    expected = [[Chunk(0, 272, False)], [Chunk(256, 16, False)] * (N - 1)]
    assert warm_log == expected
    assert _prefill_tokens(warm_log) == 256 + N * 16
    assert warm.steps == len(expected) == len(warm_log)
    assert len(cold_log) == cold.steps
    assert warm.end_time == pytest.approx(sum(step_time(b) for b in expected), rel=1e-12)
    assert warm.end_time < cold.end_time


def test_seeded_prefix_makes_the_first_request_hit_too():
    unseeded, _, _ = _run(_specs(), prefix_caching=True)
    seeded, log, step_time = _run(_specs(), prefix_caching=True, cached_prefixes=[PREFIX])
    # Every request's first chunk is its suffix, charged the 256 cached tokens as context.
    assert log == [[Chunk(256, 16, False)] * N]
    assert seeded.steps == 1
    assert seeded.end_time == pytest.approx(step_time(log[0]), rel=1e-12)
    assert seeded.end_time < unseeded.end_time


def test_partly_seeded_prefix_is_charged_its_cached_tokens():
    # 100 seeded tokens leave 6 full blocks (96 tokens) cached; one request only.
    spec = [RequestSpec(0.0, 272, 1, "RT", "r0", PREFIX + SUFFIXES[0])]
    _, log, _ = _run(spec, prefix_caching=True, cached_prefixes=[PREFIX[:100]])
    assert log == [[Chunk(96, 272 - 96, False)]]


def test_seeding_is_ignored_without_prefix_caching():
    _, log, _ = _run(_specs()[:1], prefix_caching=False, cached_prefixes=[PREFIX])
    assert log == [[Chunk(0, 272, False)]]


def test_without_prompt_ids_prefix_caching_changes_nothing():
    # A pool that never preempts: a preempted request would legitimately find its own
    # blocks in the cache when it is recomputed, which is a change caching should make.
    specs = dataset("sharegpt", 40, rate=8.0, context=2048, seed=5)
    runs = []
    for caching in (False, True):
        result, log, _ = _run(specs, num_blocks=2000, prefix_caching=caching)
        assert result.evictions == 0
        runs.append((result.end_time, result.steps, log,
                     [(m.request_id, m.token_times) for m in result.requests]))
    assert runs[0] == runs[1]


def _scheduler(num_blocks: int = 64) -> Scheduler:
    return Scheduler(BlockPool(num_blocks, BS, enable_prefix_caching=True), 4096, 64,
                     make_policy("sarathi"))


def _request(rid: str, ids) -> Request:
    return Request(rid, list(ids), SamplingParams(max_tokens=1))


def test_seed_cached_leaves_blocks_free_but_findable():
    sched = _scheduler()
    pool = sched.pool
    seed = PREFIX[:100]  # 6 full blocks and 4 tokens, which are not kept
    sched.seed_cached(seed)
    assert pool.num_free == pool.num_blocks
    assert pool.num_cached == 6
    assert all(c == 0 for c in pool.ref_count)

    same = _request("same", seed)  # leaves its last token to compute: (100 - 1) // 16 = 6
    hits = sched.prefix_hit(same)
    assert len(hits) == (len(seed) - 1) // BS == 6
    for i, h in enumerate(same.block_hashes[:6]):  # the scheduler's chained hashes
        assert pool.lookup(h, tuple(seed[i * BS:(i + 1) * BS])) == hits[i]

    longer = _request("longer", PREFIX)  # extends the seed: all 6 seeded blocks, no more
    assert sched.prefix_hit(longer) == hits
    exact = _request("exact", PREFIX[:96])  # 6 full blocks: the last one is recomputed
    assert sched.prefix_hit(exact) == hits[:5]
    forked = list(PREFIX[:100])
    forked[40] += 1  # differs in block 2: blocks 0 and 1 hit
    assert sched.prefix_hit(_request("forked", forked)) == hits[:2]

    # Seeding the same ids again takes no more blocks; a longer seed only adds its new ones.
    sched.seed_cached(seed)
    assert pool.num_cached == 6 and pool.num_free == pool.num_blocks
    assert sched.prefix_hit(_request("again", seed)) == hits
    sched.seed_cached(PREFIX)
    assert pool.num_cached == 16 and pool.num_free == pool.num_blocks
    assert sched.prefix_hit(_request("all", PREFIX + (1,)))[:6] == hits

    # The seeded blocks are recycled last: the other 48 blocks go first.
    pool.allocate(pool.num_blocks - 16)
    assert pool.num_cached == 16
    assert len(sched.prefix_hit(_request("still", PREFIX + (1,)))) == 16


def test_token_slice_is_a_slice_of_prompt_and_output():
    """What block hashing reads instead of building prompt + output for every block."""
    req = _request("r", range(100, 137))
    req.output_ids = list(range(7))
    whole = req.prompt_ids + req.output_ids
    for start in range(len(whole) + 2):
        for n in (1, 5, 16, 50):
            assert req.token_slice(start, n) == whole[start : start + n], (start, n)


def test_a_free_block_without_a_prefix_is_taken_before_a_cached_one():
    """A freed block that caches nothing is handed out before one that caches a prefix,
    however they were freed: the prefix stays for the next request that shares it."""
    pool = BlockPool(4, BS, enable_prefix_caching=True)
    blocks = pool.allocate(4)
    tokens = tuple(range(BS))
    pool.register(blocks[0], 7, tokens)
    pool.free([blocks[0]])  # cached prefix first,
    pool.free([blocks[1]])  # then a partial tail block that caches nothing
    assert pool.allocate(1) == [blocks[1]]
    assert pool.lookup(7, tokens) == blocks[0]
