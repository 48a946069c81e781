"""Apt-Serve's hidden cache: kernels against their reference, and the engine's tokens.

A request served from hidden states (K/V re-projected at attention time) must produce the
same greedy tokens in fp32 as the same request served from its KV cache: alone, in mixed
batches, and when switched between the two mid-generation; and no block may leak. The
models are tiny random MHA ones (OPT, and a Llama with kv_heads = heads) built by
bench/random_model.py.
"""

from __future__ import annotations

import os
import random
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from llmdb.engine.cache.block_pool import BlockPool, FreeSpace
from llmdb.engine.engine import LLMEngine
from llmdb.engine.params import SamplingParams
from llmdb.engine.sched.request import Status
from llmdb.engine.sched.scheduler import SchedulerOutput
from llmdb.kernels.attention import AttentionBatch, paged_attention_reference, write_kv
from llmdb.kernels.hidden_cache import (
    HiddenBatch,
    gather_hidden,
    gather_hidden_reference,
    hidden_rows,
    write_hidden,
)

from .helpers import as_windowed_mistral

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from random_model import write_random_model  # noqa: E402

MODELS = ["tiny-opt", "tiny-llama-mha"]
BLOCK = 4
TRITON = (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1")
WINDOW = 5  # of the sliding-window model


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hidden_models")
    dirs = {name: write_random_model(name, root / name, seed=5, dtype=torch.float32,
                                     device="cpu")
            for name in [*MODELS, "tiny-llama", "tiny-qwen2-mha", "tiny-qwen3-mha"]}
    dirs["tiny-mistral-window-mha"] = as_windowed_mistral(
        dirs["tiny-llama-mha"], root / "tiny-mistral-window-mha", WINDOW)
    return dirs


def _engine(path: Path, **kw) -> LLMEngine:
    return LLMEngine(str(path), device="cpu", dtype="float32", kv_cache_bytes=1 << 21,
                     block_size=BLOCK, **kw)


def _prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, vocab) for _ in range(rng.randrange(2, 30))] for _ in range(n)]


GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


def _generate(eng: LLMEngine, prompts: list[list[int]], types: list[str],
              switch: dict[int, list[str]] | None = None,
              params: SamplingParams = GREEDY, project: bool = False,
              logprobs: bool = False) -> list:
    """Greedy tokens of each prompt served with the given cache types (with `logprobs`, and
    each token's log-probability); switch maps a step number to the types running requests
    switch to then: by discard and recompute, or for hidden -> KV with `project`, by
    projecting their hidden states (Scheduler.convert_to_kv)."""
    ids = [eng.add_request(p, params) for p in prompts]
    reqs = [eng._requests[i] for i in ids]
    for req, kind in zip(reqs, types, strict=True):
        req.cache_type = kind
    step = switched = 0
    while eng.has_unfinished:
        out = SchedulerOutput()
        for k, kind in enumerate((switch or {}).get(step, [])):
            req = reqs[k]
            if req.status is not Status.RUNNING or req.cache_type == kind:
                continue
            switched += 1
            if kind == "kv" and project:
                assert eng.scheduler.convert_to_kv(out, req)
            else:  # discard and recompute in the new type
                eng.scheduler.preempt(out, req)
                req.cache_type = kind
        if out.converted:
            eng.runner.convert_to_kv(out.converted)
        eng.step()
        step += 1
        for r in eng.scheduler.running:  # hidden states take a half block per BLOCK tokens
            if r.cache_type == "hidden":
                assert len(r.block_ids) == -(-r.num_computed // BLOCK), r.request_id
    if switch:
        assert switched, "nothing was switched"
    assert eng.pool.num_free == eng.pool.num_blocks, "blocks leaked"
    results = [eng.wait(i) for i in ids]
    if logprobs:
        return [(r.token_ids, [lp for lp, _ in r.logprobs]) for r in results]
    return [r.token_ids for r in results]


# ---- kernels ----------------------------------------------------------------------------------

def _store_and_tables(hidden: int, slot_width: int, seed: int):
    torch.manual_seed(seed)
    num_blocks = 24
    kv = torch.zeros(2, num_blocks * BLOCK, slot_width)
    store = kv.view(2 * num_blocks * BLOCK, slot_width)[:, :hidden]
    units = list(range(2 * num_blocks))  # half blocks
    random.Random(seed).shuffle(units)
    ctx = [5, 17, 8, 1]
    tables = [[units.pop() for _ in range(-(-c // BLOCK))] for c in ctx]
    return store, tables, ctx


@pytest.mark.parametrize("triton", [False, True] if TRITON else [False])
# hidden = a slot, hidden < a slot; rows wider than the Triton kernel's column tile (two
# tiles, the second ragged)
@pytest.mark.parametrize(("hidden", "slot_width"), [(32, 32), (32, 48), (296, 320)])
def test_write_then_gather_reads_the_block_layout(triton, hidden, slot_width):
    if triton:
        from llmdb.kernels.gpu.hidden_cache import gather_hidden as gather
        from llmdb.kernels.gpu.hidden_cache import write_hidden as write
    else:
        gather, write = gather_hidden, write_hidden
    store, tables, ctx = _store_and_tables(hidden, slot_width, seed=1)
    states = [torch.randn(c, hidden) for c in ctx]
    # Written in two steps (a prefill chunk, then the rest), as a request grows.
    for s, table, c in zip(states, tables, ctx, strict=True):
        for lo, hi in ((0, c // 2), (c // 2, c)):
            rows = hidden_rows(table, np.arange(lo, hi), BLOCK)
            write(store, s[lo:hi], torch.from_numpy(rows))
    want = gather_hidden_reference(store, tables, ctx, BLOCK)
    for s, w in zip(states, want, strict=True):
        torch.testing.assert_close(w, s, rtol=0, atol=0)
    hb = HiddenBatch.build(0, [1] * len(ctx), ctx, tables, BLOCK)
    got = gather(store, hb.context_rows)
    start = 0
    for c, w in zip(ctx, want, strict=True):
        torch.testing.assert_close(got[start : start + c], w, rtol=0, atol=0)
        start += -(-c // BLOCK) * BLOCK  # each sequence padded to whole blocks


def test_no_hidden_row_is_shared():
    num_blocks = 16
    rows = [hidden_rows([u], np.arange(BLOCK), BLOCK) for u in range(2 * num_blocks)]
    flat = np.concatenate(rows)
    assert len(set(flat.tolist())) == len(flat) and flat.max() < 2 * num_blocks * BLOCK


def test_pool_hands_out_halves_and_keeps_whole_blocks_for_kv():
    pool = BlockPool(4, BLOCK)
    a = pool.allocate_halves(3)  # one whole block split, then its other half, then another
    assert sorted(u % 4 for u in a) == [a[0] % 4, a[0] % 4, a[2] % 4]
    assert pool.num_free == 2 and pool.num_free_halves == 5
    assert pool.free_space() == FreeSpace(2, 1)
    b = pool.allocate_halves(1)  # the half-used block's free half, not a whole block
    assert b[0] % 4 == a[2] % 4 and pool.num_free == 2
    assert pool.blocks_freed_by(a[:2]) == 1 and pool.blocks_freed_by(a[2:]) == 0
    pool.free_halves(a)
    assert pool.num_free == 3 and pool.num_free_halves == 7  # b's partner half is free
    pool.free_halves(b)
    assert pool.num_free == pool.num_blocks and pool.num_free_halves == 8
    with pytest.raises(RuntimeError, match="halves"):
        pool.allocate_halves(9)


@pytest.mark.parametrize("seed", range(5))
def test_free_space_plans_as_the_pool_allocates(seed):
    rng = random.Random(seed)
    pool, held = BlockPool(12, BLOCK), []
    for _ in range(40):
        if held and rng.random() < 0.4:
            kind, ids = held.pop(rng.randrange(len(held)))
            (pool.free_halves if kind == "h" else pool.free)(ids)
            continue
        kind, n = rng.choice("hk"), rng.randrange(1, 5)
        plan = pool.free_space()
        ok = plan.take_halves(n) if kind == "h" else plan.take_blocks(n)
        assert ok == (n <= (pool.num_free_halves if kind == "h" else pool.num_free))
        if ok:
            held.append((kind, (pool.allocate_halves if kind == "h" else pool.allocate)(n)))
            assert plan == pool.free_space()


def test_attention_over_reprojected_kv_equals_kv_cache():
    """Queries over K/V re-projected from stored hidden states = over the same K/V cached."""
    from llmdb.engine.models.hidden_attention import mixed_attention

    torch.manual_seed(0)
    heads, d, hidden = 4, 8, 32
    wk, wv = torch.randn(heads * d, hidden) / 6, torch.randn(heads * d, hidden) / 6
    store, tables, ctx = _store_and_tables(hidden, heads * d, seed=2)
    qlens = [3, 17, 2, 1]
    states = [torch.randn(c, hidden) for c in ctx]
    for s, table, c, q in zip(states, tables, ctx, qlens, strict=True):  # the cached part
        write_hidden(store, s[: c - q], torch.from_numpy(
            hidden_rows(table, np.arange(c - q), BLOCK)))
    q = torch.randn(sum(qlens), heads, d)
    new = torch.cat([s[c - ql :] for s, c, ql in zip(states, ctx, qlens, strict=True)])
    hb = HiddenBatch.build(0, qlens, ctx, tables, BLOCK)

    def reproject(h, _pos):
        return (h @ wk.T).view(-1, heads, d), (h @ wv.T).view(-1, heads, d)

    empty = AttentionBatch.build([], [], [], BLOCK)
    got = mixed_attention(q, new, (None, None), empty, d**-0.5, paged_attention_reference, hb,
                          store, reproject)
    # The same sequences from a KV cache.
    k_cache, v_cache = torch.zeros(256, heads, d), torch.zeros(256, heads, d)
    kv_tables = [list(range(i * 16, i * 16 + -(-c // BLOCK))) for i, c in enumerate(ctx)]
    batch = AttentionBatch.build(qlens, ctx, kv_tables, BLOCK)
    for i, s in enumerate(states):
        write_kv(k_cache, v_cache, *reproject(s, None), batch.context_slots(i))
    want = paged_attention_reference(q, k_cache, v_cache, batch, d**-0.5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_attention_over_a_kv_prefix_and_reprojected_kv_equals_kv_cache():
    """Sequences whose first blocks are KV blocks (a prefix-cache hit) and the rest hidden
    states: their K/V come from the KV cache for the prefix and are re-projected, at their
    own positions, for the rest only; the queries' attention equals that over the same K/V
    cached. Beside them, sequences without a prefix."""
    from llmdb.engine.models.hidden_attention import mixed_attention

    torch.manual_seed(0)
    heads, d, hidden, num_blocks = 4, 8, 32, 24
    wk, wv = torch.randn(heads * d, hidden) / 6, torch.randn(heads * d, hidden) / 6

    def reproject(h, pos):  # (position-dependent, as RoPE is)
        shift = pos.to(h.dtype)[:, None, None] / 10
        return (h @ wk.T).view(-1, heads, d) + shift, (h @ wv.T).view(-1, heads, d) - shift

    ctx, qlens, prefixes = [13, 17, 8, 9], [3, 1, 2, 9], [2, 4, 0, 0]
    store = torch.zeros(2 * num_blocks * BLOCK, hidden)
    k_main, v_main = (torch.zeros(num_blocks * BLOCK, heads, d) for _ in "kv")
    free = list(range(num_blocks))
    random.Random(3).shuffle(free)
    states = [torch.randn(c, hidden) for c in ctx]
    tables = []
    for s, c, q, npre in zip(states, ctx, qlens, prefixes, strict=True):
        first = npre * BLOCK
        kv_blocks = [free.pop() for _ in range(npre)]
        units = [num_blocks + free.pop() for _ in range(-(-(c - first) // BLOCK))]  # K halves
        pos = torch.arange(first)
        slots = torch.tensor(kv_blocks, dtype=torch.int64)[pos // BLOCK] * BLOCK + pos % BLOCK
        write_kv(k_main, v_main, *reproject(s[:first], pos), slots)
        write_hidden(store, s[first : c - q], torch.from_numpy(
            hidden_rows(units, np.arange(c - q - first), BLOCK)))
        tables.append(kv_blocks + units)
    q = torch.randn(sum(qlens), heads, d)
    new = torch.cat([s[c - ql :] for s, c, ql in zip(states, ctx, qlens, strict=True)])
    hb = HiddenBatch.build(0, qlens, ctx, tables, BLOCK, kv_prefixes=prefixes)
    assert len(hb.context_rows) == sum(-(-c // BLOCK) * BLOCK for c in ctx) - 6 * BLOCK
    empty = AttentionBatch.build([], [], [], BLOCK)
    got = mixed_attention(q, new, (k_main, v_main), empty, d**-0.5, paged_attention_reference,
                          hb, store, reproject)
    k_cache, v_cache = torch.zeros(256, heads, d), torch.zeros(256, heads, d)
    kv_tables = [list(range(i * 16, i * 16 + -(-c // BLOCK))) for i, c in enumerate(ctx)]
    batch = AttentionBatch.build(qlens, ctx, kv_tables, BLOCK)
    for i, s in enumerate(states):
        write_kv(k_cache, v_cache, *reproject(s, torch.arange(len(s))),
                 batch.context_slots(i))
    want = paged_attention_reference(q, k_cache, v_cache, batch, d**-0.5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# ---- the engine ------------------------------------------------------------------------------

@pytest.mark.parametrize("name", [*MODELS, "tiny-qwen2-mha", "tiny-qwen3-mha",
                                  "tiny-mistral-window-mha"])
def test_hidden_mode_generates_the_kv_tokens(name, model_dirs):
    eng = _engine(model_dirs[name])
    assert eng.describe()["hidden_cache"]["enabled"]
    prompts = _prompts(6, 280)
    want = _generate(eng, prompts, ["kv"] * 6)
    assert _generate(eng, prompts, ["hidden"] * 6) == want
    assert _generate(eng, prompts, ["kv", "hidden"] * 3) == want  # mixed batches
    # Switched mid-generation: KV -> hidden after 3 steps, back to KV after 7.
    to_hidden_and_back = {3: ["hidden"] * 6, 7: ["kv"] * 6}
    assert _generate(eng, prompts, ["kv"] * 6, switch=to_hidden_and_back) == want
    assert _generate(eng, prompts, ["kv"] * 6, switch=to_hidden_and_back, project=True) == want
    # Projection, with half of the requests still in hidden mode beside them.
    assert _generate(eng, prompts, ["hidden"] * 6, switch={5: ["kv", "hidden"] * 3},
                     project=True) == want


@pytest.mark.parametrize("name", MODELS)
def test_hidden_requests_read_a_shared_prefix_where_it_is_cached(name, model_dirs):
    """Six prompts share 24 tokens (6 blocks). The first, in KV form, computes and publishes
    them; the others, in hidden form, find them in use in the prefix cache and read their K/V
    there: they hold those 6 blocks shared and half blocks for their own tokens only, and
    generate the tokens of an engine without a hidden cache. Also when KV requests are
    switched to hidden form (discarded and readmitted: they find the prefix again) and back
    (by projection, keeping the prefix; or discarded and recomputed)."""
    rng = random.Random(6)
    shared = [rng.randrange(4, 280) for _ in range(24)]
    prompts = [shared + [rng.randrange(4, 280) for _ in range(rng.randrange(1, 9))]
               for _ in range(6)]
    want = [r.token_ids for r in _engine(model_dirs[name], hidden_cache=False).generate(
        prompts, GREEDY)]
    eng = _engine(model_dirs[name])
    prefixes: dict[str, int] = {}

    def watch(out: SchedulerOutput) -> None:
        for r, _ in out.scheduled:
            if r.cache_type == "hidden":
                prefixes[r.request_id] = max(prefixes.get(r.request_id, 0), r.num_kv_prefix)
                assert r.num_kv_prefix == 0 or eng.pool.shared_refs > 0

    eng.scheduler.observers.append(watch)
    five_hidden = ["kv"] + ["hidden"] * 5
    for types, switch, project in [
            (five_hidden, None, False),
            (five_hidden, {4: ["kv"] * 3}, True),
            (five_hidden, {4: ["kv"] * 3}, False),
            (["kv"] * 6, {3: five_hidden}, False)]:
        prefixes.clear()
        assert _generate(eng, prompts, types, switch, project=project) == want
        assert sorted(prefixes.values()) == [6] * 5, prefixes


def test_reference_attention_serves_hidden_mode(model_dirs):
    eng = _engine(model_dirs["tiny-opt"], attention="reference")
    prompts = _prompts(3, 280, seed=1)
    assert _generate(eng, prompts, ["hidden"] * 3) == _generate(eng, prompts, ["kv"] * 3)


def test_window_changes_the_tokens_hidden_mode_serves(model_dirs):
    """The windowed model's prompts and generations run to several windows, and the window
    changes their tokens: the test above is not passed by attending to everything."""
    windowed = _engine(model_dirs["tiny-mistral-window-mha"])
    assert windowed.config.layer_windows == (WINDOW,) * 3
    prompts = _prompts(6, 280)
    assert max(map(len, prompts)) + GREEDY.max_tokens > 4 * WINDOW
    full = _generate(_engine(model_dirs["tiny-llama-mha"]), prompts, ["kv"] * 6)
    assert _generate(windowed, prompts, ["kv"] * 6) != full


@pytest.mark.skipif(not TRITON, reason="triton needs a GPU or TRITON_INTERPRET=1")
@pytest.mark.parametrize("name", [*MODELS, "tiny-qwen3-mha", "tiny-mistral-window-mha"])
def test_triton_path_serves_hidden_mode(name, model_dirs):
    pytest.importorskip("triton", reason="triton is not installed")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    eng = LLMEngine(str(model_dirs[name]), device=device, dtype="float32",
                    kv_cache_bytes=1 << 20, block_size=BLOCK, attention="triton",
                    cuda_graphs=False)
    # The interpreter pays per launch and per program (a program per token, every hidden
    # context token re-projected each step), so few steps: prompts of 8, 2 and 7 tokens and
    # 3 new ones, decoded at positions 8 and 9 (7 and 8), start a new block in decode, run
    # past the windowed model's window, and leave a decode step after the switch at step 2.
    prompts = [p[:8] for p in _prompts(3, 280, seed=2)]
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    want = _generate(eng, prompts, ["kv"] * 3, params=params)
    assert _generate(eng, prompts, ["kv", "hidden", "hidden"], params=params) == want
    assert _generate(eng, prompts, ["hidden"] * 3, switch={2: ["kv"] * 3}, params=params,
                     project=True) == want
    if name == "tiny-opt":
        # Hidden requests reading 2 shared blocks from the KV cache: the same tokens and
        # log-probabilities (the tokens alone did not notice those blocks' K/V zeroed).
        shared = [prompts[0] + p[:3] for p in prompts]
        with_logprobs = replace(params, logprobs=0)
        want = _generate(eng, shared, ["kv"] * 3, params=with_logprobs, logprobs=True)
        prefixes = []
        eng.scheduler.observers.append(lambda out: prefixes.extend(
            r.num_kv_prefix for r, _ in out.scheduled if r.cache_type == "hidden"))
        got = _generate(eng, shared, ["kv", "hidden", "hidden"], params=with_logprobs,
                        logprobs=True)
        assert [t for t, _ in got] == [t for t, _ in want] and 2 in prefixes
        torch.testing.assert_close([lp for _, lp in got], [lp for _, lp in want])


def test_gqa_model_keeps_kv_only(model_dirs):
    eng = _engine(model_dirs["tiny-llama"])
    info = eng.describe()["hidden_cache"]
    assert not info["enabled"] and "not smaller than K and V" in info["why"]
    assert eng.scheduler.hidden_ratio is None
    with pytest.raises(ValueError, match="no hidden cache"):
        _engine(model_dirs["tiny-llama"], hidden_cache=True)
    off = _engine(model_dirs["tiny-opt"], hidden_cache=False).describe()["hidden_cache"]
    assert not off["enabled"] and "turned off" in off["why"]


def test_a_hidden_cache_turned_off_keeps_no_reprojection_weights(model_dirs):
    """With hidden_cache=False the model keeps no K/V re-projection weights: in bf16 on the
    CPU each layer's were a packed copy of 2/3 of its QKV weight (28 MB of OPT-125m's 250),
    for requests that can no longer have a hidden cache. A request set to one fails with an
    error that says so, and the engine serves the next."""
    path = model_dirs["tiny-opt"]
    assert _engine(path).model.kv_projs  # (the hidden cache on: one a layer)
    eng = _engine(path, hidden_cache=False)
    assert eng.model.kv_projs == [] and eng.kv_cache.hidden == []
    assert eng.describe()["hidden_cache"]["why"] == "turned off (hidden_cache=False)"
    rid = eng.add_request([5, 6, 7], GREEDY)
    eng._requests[rid].cache_type = "hidden"
    while eng.has_unfinished:
        eng.step()
    assert "without a hidden cache" in eng.wait(rid).error
    want = _engine(path).generate([[5, 6, 7]], GREEDY)[0].token_ids
    assert eng.generate([[5, 6, 7]], GREEDY)[0].token_ids == want
    assert eng.pool.num_free == eng.pool.num_blocks


def test_apt_serves_both_cache_types_at_saturation(model_dirs):
    """apt on a pool too small for the batch in KV form: its knapsack keeps some requests as
    hidden states, converts and evicts, and every request still gets the tokens it gets
    alone on a large pool, with the pool never over-committed (allocate raises)."""
    prompts = [p + p for p in _prompts(12, 280, seed=3)]
    want = _generate(_engine(model_dirs["tiny-opt"]), prompts, ["kv"] * 12)
    block_bytes = 2 * 3 * 64 * 4 * BLOCK  # K and V, 3 layers, hidden 64, fp32
    eng = LLMEngine(str(model_dirs["tiny-opt"]), device="cpu", dtype="float32",
                    kv_cache_bytes=40 * block_bytes, block_size=BLOCK, policy="apt")
    assert eng.pool.num_blocks == 40
    ids = [eng.add_request(p, GREEDY) for p in prompts]
    seen = set()
    while eng.has_unfinished:
        eng.step()
        seen |= {r.cache_type for r in eng.scheduler.running}
    assert seen == {"kv", "hidden"}
    assert [eng.wait(i).token_ids for i in ids] == want
    assert eng.pool.num_free == eng.pool.num_blocks


def _serve_together(path: Path, prompts: list[list[int]], policy: str, budget: int,
                    max_steps: int) -> tuple[int, int, list[list[int]] | None]:
    """Steps, preemptions and tokens of `prompts` served together under `policy` on a pool
    of 40 blocks with `budget` tokens a step; the tokens are None if they are not all done
    within max_steps."""
    block_bytes = 2 * 3 * 64 * 4 * BLOCK  # K and V, 3 layers, hidden 64, fp32
    eng = LLMEngine(str(path), device="cpu", dtype="float32", kv_cache_bytes=40 * block_bytes,
                    block_size=BLOCK, max_num_batched_tokens=budget, policy=policy)
    preempted: list[str] = []
    eng.scheduler.observers.append(
        lambda out: preempted.extend(r.request_id for r in out.preempted))
    ids = [eng.add_request(p, GREEDY) for p in prompts]
    steps = 0
    while eng.has_unfinished and steps < max_steps:
        eng.step()
        steps += 1
    tokens = None if eng.has_unfinished else [eng.wait(i).token_ids for i in ids]
    return steps, len(preempted), tokens


@pytest.mark.parametrize("budget", [2, 7])
def test_apt_at_a_tiny_step_budget_keeps_the_work_it_started(model_dirs, budget):
    """apt with a few tokens a step on a small pool: a running request its knapsack leaves
    out of a step keeps its cache until a request that runs needs the memory, and admission
    counts a started prefill whole. It once evicted every left-out request at once, and
    prefill iterations admitted against blocks its started prefills still needed: these 24
    requests took 6-9 times sarathi's steps (which evicts nothing here) and 190-360
    preemptions. And every request gets the tokens it gets alone."""
    path = model_dirs["tiny-opt"]
    prompts = _prompts(24, 280, seed=4)
    alone = _engine(path)
    want = [alone.generate([p], GREEDY)[0].token_ids for p in prompts]
    base, _, _ = _serve_together(path, prompts, "sarathi", budget, max_steps=10_000)
    # Now about twice sarathi's steps and 1-2 preemptions a request (timing moves both).
    steps, preempted, got = _serve_together(path, prompts, "apt", budget, 4 * base)
    assert got is not None, f"apt unfinished after {steps} steps (sarathi: {base})"
    assert preempted <= 3 * len(prompts), f"{preempted} preemptions in {steps} steps"
    assert got == want


@pytest.mark.parametrize("policy", ["apt", "fcfs-hybrid"])
@pytest.mark.parametrize("priority", ["BE", "RT"])
def test_requests_only_hidden_states_fit_are_served(model_dirs, policy, priority):
    """A pool of 30 blocks holds 120 tokens as K/V and 240 as hidden states. The policies that
    keep hidden states serve a prompt longer than 120, and a prompt whose max_tokens run past
    120, beside short requests: with the tokens of a pool large enough for K/V, also as RT
    requests late for SLOs of a millisecond (apt's fallback values them near zero, and their
    hidden form then had a negative value: they were never picked). They were refused."""
    path = model_dirs["tiny-opt"]
    rng = random.Random(8)
    prompts = ([[rng.randrange(4, 280) for _ in range(n)] for n in (150, 100)]
               + _prompts(4, 280, seed=8))
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (8, 40, 8, 8, 8, 8)]
    big = _engine(path, hidden_cache=False)
    want = [big.generate([p], sp)[0].token_ids for p, sp in zip(prompts, params, strict=True)]
    block_bytes = 2 * 3 * 64 * 4 * BLOCK  # K and V, 3 layers, hidden 64, fp32
    eng = LLMEngine(str(path), device="cpu", dtype="float32", kv_cache_bytes=30 * block_bytes,
                    block_size=BLOCK, policy=policy, max_num_batched_tokens=32,
                    rt_slo_ttft_s=1e-3, rt_slo_tbt_s=1e-3)
    with pytest.raises(ValueError, match="whole pool holds 240 tokens as hidden states"):
        eng.add_request([5] * 241, SamplingParams(max_tokens=1))
    ids = [eng.add_request(p, sp, priority=priority)
           for p, sp in zip(prompts, params, strict=True)]
    steps = 0
    while eng.has_unfinished and steps < 1000:
        eng.step()
        steps += 1
    assert not eng.has_unfinished, f"unfinished after {steps} steps"
    assert [eng.wait(i).token_ids for i in ids] == want
    assert eng.pool.num_free == eng.pool.num_blocks


def test_apt_serves_prompts_on_a_shared_prefix_that_fit_only_as_hidden_states(model_dirs):
    """Two prompts of 148 tokens share 100 (25 blocks): as K/V each takes 37 blocks of a pool
    of 30, as hidden states 18.5. Counting the second's prefix as shared with the first
    (12 blocks), apt picked it for the KV cache it could never fit, ahead of the first, and
    then had no room for the first: nothing ran, for ever."""
    path = model_dirs["tiny-opt"]
    rng = random.Random(9)
    shared = [rng.randrange(4, 280) for _ in range(100)]
    prompts = [shared + [rng.randrange(4, 280) for _ in range(48)] for _ in range(2)]
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    want = [r.token_ids for r in _engine(path, hidden_cache=False).generate(prompts, params)]
    block_bytes = 2 * 3 * 64 * 4 * BLOCK  # K and V, 3 layers, hidden 64, fp32
    eng = LLMEngine(str(path), device="cpu", dtype="float32", kv_cache_bytes=30 * block_bytes,
                    block_size=BLOCK, policy="apt", max_num_batched_tokens=32)
    ids = [eng.add_request(p, params) for p in prompts]
    steps = 0
    while eng.has_unfinished and steps < 100:
        eng.step()
        steps += 1
    assert not eng.has_unfinished, f"unfinished after {steps} steps"
    assert [eng.wait(i).token_ids for i in ids] == want
    assert eng.pool.num_free == eng.pool.num_blocks


def test_apt_serves_a_hidden_request_whose_kv_prefix_no_longer_fits(model_dirs):
    """A pool of 30 blocks. A short KV request publishes 40 prompt tokens (10 blocks); a
    request of 150 prompt tokens and 70 new ones, 55 blocks as K/V, is admitted as hidden
    states reading those 10 blocks where they are. Once the first has finished it holds them
    alone: whole blocks for 40 tokens, where hidden states take 5, so at 200 tokens it fills
    the pool (10 + 40 halves) and cannot go on in its form. apt neither picked nor ran it,
    for ever; it must recompute it as hidden states (220 tokens: 27.5 blocks)."""
    path = model_dirs["tiny-opt"]
    rng = random.Random(10)
    prefix = [rng.randrange(4, 280) for _ in range(40)]
    short = (prefix + [7, 8], SamplingParams(max_tokens=6, ignore_eos=True))
    long = (prefix + [rng.randrange(4, 280) for _ in range(110)],
            SamplingParams(max_tokens=70, ignore_eos=True))
    big = _engine(path, hidden_cache=False)
    want = [big.generate([p], sp)[0].token_ids for p, sp in (short, long)]
    block_bytes = 2 * 3 * 64 * 4 * BLOCK  # K and V, 3 layers, hidden 64, fp32
    eng = LLMEngine(str(path), device="cpu", dtype="float32", kv_cache_bytes=30 * block_bytes,
                    block_size=BLOCK, policy="apt", max_num_batched_tokens=64)
    prefixes = []
    eng.scheduler.observers.append(lambda out: prefixes.extend(
        r.num_kv_prefix for r, _ in out.scheduled if r.cache_type == "hidden"))
    ids = [eng.add_request(*short)]
    eng.step()  # its prompt: published
    ids.append(eng.add_request(*long))
    steps = 0
    while eng.has_unfinished and steps < 300:
        eng.step()
        steps += 1
    assert 10 in prefixes, "the long request did not read the prefix from the KV cache"
    assert not eng.has_unfinished, f"unfinished after {steps} steps"
    assert [eng.wait(i).token_ids for i in ids] == want
    assert eng.pool.num_free == eng.pool.num_blocks


@pytest.mark.parametrize("options", [{"policy": "sarathi"},
                                     {"policy": "apt", "hidden_cache": False}])
def test_requests_only_hidden_states_fit_are_refused_without_them(model_dirs, options):
    """Where no policy keeps hidden states, a request must fit the pool as K/V."""
    block_bytes = 2 * 3 * 64 * 4 * BLOCK
    eng = LLMEngine(str(model_dirs["tiny-opt"]), device="cpu", dtype="float32",
                    kv_cache_bytes=30 * block_bytes, block_size=BLOCK, **options)
    with pytest.raises(ValueError, match="whole pool holds 120 tokens as K/V"):
        eng.add_request([5] * 121, SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="prompt plus max_tokens"):
        eng.add_request([5] * 100, SamplingParams(max_tokens=21))


def _computed_and_cached(path: Path, policy: str, prompts: list[list[int]]
                         ) -> tuple[int, int, int, list[list[int]]]:
    """Steps, tokens computed and prompt tokens served from the prefix cache when `prompts`
    are served together under `policy` on a pool of 60 blocks, and their tokens."""
    block_bytes = 2 * 3 * 64 * 4 * BLOCK  # K and V, 3 layers, hidden 64, fp32
    eng = LLMEngine(str(path), device="cpu", dtype="float32", kv_cache_bytes=60 * block_bytes,
                    block_size=BLOCK, policy=policy)
    computed = []
    eng.scheduler.observers.append(lambda out: computed.append(out.num_tokens))
    results = eng.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))
    assert eng.pool.num_free == eng.pool.num_blocks and eng.pool.shared_refs == 0
    return (len(computed), sum(computed), sum(r.usage.cached_tokens for r in results),
            [r.token_ids for r in results])


def test_apt_keeps_more_requests_on_a_shared_prefix_with_hidden_states(model_dirs):
    """32 prompts share 32 tokens (8 blocks) and have 8-16 of their own; a pool of 40 blocks.
    apt weighing memory alone (re-projection free, as bench/hybrid.py's memory-only mode):
    with KV caches only it runs at most 12 together; with the hidden cache its requests read
    the prefix one KV request published and store only their own tokens as hidden states,
    and it runs 19. Before, a hidden request had no prefix hit, and apt ran at most 11
    with the hidden cache too. The tokens are the KV-only engine's."""
    path = model_dirs["tiny-opt"]
    rng = random.Random(9)
    shared = [rng.randrange(4, 280) for _ in range(32)]
    prompts = [shared + [rng.randrange(4, 280) for _ in range(rng.randrange(8, 17))]
               for _ in range(32)]
    block_bytes = 2 * 3 * 64 * 4 * BLOCK  # K and V, 3 layers, hidden 64, fp32

    def serve(hidden_cache: bool) -> tuple[int, list[list[int]]]:
        eng = LLMEngine(str(path), device="cpu", dtype="float32", block_size=BLOCK,
                        kv_cache_bytes=40 * block_bytes, policy="apt", hidden_cache=hidden_cache)
        cm = eng.scheduler.cost_model
        eng.scheduler.cost_model = replace(cm, coefficients={**cm.coefficients,
                                                             "hidden_tokens": 0.0})
        ids = [eng.add_request(p, SamplingParams(max_tokens=8, ignore_eos=True))
               for p in prompts]
        most = 0
        while eng.has_unfinished:
            eng.step()
            most = max(most, len(eng.scheduler.running))
        assert eng.pool.num_free == eng.pool.num_blocks and eng.pool.shared_refs == 0
        return most, [eng.wait(i).token_ids for i in ids]

    kv_most, want = serve(hidden_cache=False)
    hybrid_most, got = serve(hidden_cache=True)
    assert got == want
    assert hybrid_most >= 1.5 * kv_most, (hybrid_most, kv_most)


@pytest.mark.parametrize(("policy", "base"), [("apt", "sarathi"), ("fcfs-hybrid", "fcfs")])
def test_shared_prompt_prefixes_stay_in_the_kv_cache(model_dirs, policy, base):
    """24 prompts share 32 tokens (8 blocks): as K/V they take 8 blocks once and a few each,
    which the 60-block pool holds. apt counted every prompt's blocks whole (288), chose
    hidden states for 23 of them, which have no prefix hits, and computed 2,043 tokens in 41
    steps with nothing served from the cache (sarathi: 327 tokens, 13 steps, 736 cached);
    counting a running request's shared blocks whole it took 21 steps. fcfs-hybrid gave 2 a
    hidden cache: 408 tokens computed (fcfs: 336). Each must reuse the prefix as the policy
    without a hidden cache does, with the tokens of an engine without one."""
    path = model_dirs["tiny-opt"]
    rng = random.Random(5)
    shared = [rng.randrange(4, 280) for _ in range(32)]
    prompts = [shared + [rng.randrange(4, 280) for _ in range(rng.randrange(1, 7))]
               for _ in range(24)]
    want = [r.token_ids for r in _engine(path, hidden_cache=False).generate(
        prompts, SamplingParams(max_tokens=8, ignore_eos=True))]
    base_steps, base_computed, base_cached, _ = _computed_and_cached(path, base, prompts)
    steps, computed, cached, got = _computed_and_cached(path, policy, prompts)
    assert got == want
    assert cached >= base_cached, (cached, base_cached)
    assert computed <= 1.1 * base_computed, (computed, base_computed)
    assert steps <= 1.25 * base_steps, (steps, base_steps)
