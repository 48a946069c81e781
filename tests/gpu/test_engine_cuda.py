"""The engine on a CUDA GPU against the CPU engine, both in fp32, on tiny random models.

Collected everywhere; without a GPU every test skips with the reason. On a GPU the Triton
kernels, the persistent step buffers and the CUDA graphs (decode and mixed) run for real, and each
answer must equal the CPU engine's greedy tokens (or differ first at a near-tie of the
reference's logits, tests/helpers.py). `make test-gpu` runs this file.
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from llmdb.engine.engine import LLMEngine
from llmdb.engine.params import SamplingParams

from .. import gemma_models, test_smollm3
from ..helpers import assert_same_tokens
from ..model_builders import randomize
from ..test_hf_models import VARIANTS, _save

if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU: torch sees none (tests/gpu runs where one is; make test-gpu)",
                allow_module_level=True)
pytest.importorskip("triton", reason="triton is not installed (it comes with CUDA torch)")

GEN = SamplingParams(max_tokens=24, ignore_eos=True)
# Llama with GQA; OPT; Qwen3 (per-head Q/K norms before the fused RoPE and cache write, and
# hidden states smaller than its K/V, so the hybrid cache runs with them too); Gemma 2 (its
# logit cap applied in place to a CUDA graph's logits buffer) and Gemma 3 (fp32-scaled Q/K
# norms in the fused RoPE, two RoPE tables); SmolLM3 (NoPE layers: no table for the fused
# RoPE there).
MODELS = ("llama-gqa", "opt", "qwen3", "gemma2", "gemma3", "smollm3")


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("gpu_models")
    out = {}
    for seed, name in enumerate(MODELS):
        if name in test_smollm3.VARIANTS:
            path = root / name
            _save(test_smollm3._smollm3(seed, **test_smollm3.VARIANTS[name]), path,
                  {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": False}, None)
            out[name] = str(path)
            continue
        if name in gemma_models.VARIANTS:
            out[name] = str(gemma_models._save(gemma_models._build(name, seed), root / name,
                                               [gemma_models.EOS, gemma_models.EOT]))
            continue
        build, tok_cfg, prepend = VARIANTS[name]
        torch.manual_seed(seed)
        model = build()
        randomize(model, seed)
        _save(model, root / name, tok_cfg, prepend)
        out[name] = str(root / name)
    return out


def _engine(path: str, device: str, **kw) -> LLMEngine:
    return LLMEngine(path, device=device, dtype="fp32", **{"kv_cache_bytes": 64 << 20, **kw})


@pytest.fixture(scope="module", params=MODELS)
def pair(request, model_dirs):
    """(CPU engine, CUDA engine with graphs) on the same weights."""
    path = model_dirs[request.param]
    return _engine(path, "cpu"), _engine(path, "cuda")


def _prompts(n: int, seed: int, vocab: int, max_len: int = 200) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [1, 15, 16, 17, 31, 32, 33] + [rng.randint(1, max_len) for _ in range(n)]
    return [[rng.randrange(5, vocab) for _ in range(k)] for k in lengths[:n]]


def _check(cpu: LLMEngine, prompts, results, params=GEN) -> None:
    for p, r in zip(prompts, results, strict=True):
        assert r.finish_reason == "length", r.error
        ref = cpu.generate([p], params)[0].token_ids
        assert_same_tokens(cpu, p, ref, r.token_ids)


def _all_free(*engines: LLMEngine) -> None:
    for e in engines:
        assert not e.has_unfinished
        assert e.pool.num_free == e.pool.num_blocks, "KV blocks leaked"


def test_describe_names_the_gpu(pair):
    _, gpu = pair
    d = gpu.describe()
    assert d["device"].startswith("cuda:") and torch.cuda.get_device_name() in d["device"]
    assert d["kernels"] == "triton" and d["cuda_graphs"] and d["launch_ahead"], d


def test_logits_match_cpu(pair):
    cpu, gpu = pair
    for p in _prompts(4, seed=1, vocab=cpu.config.vocab_size):
        ours, ref = gpu.logits(p), cpu.logits(p)
        assert ours.device.type == "cpu" and ours.dtype == torch.float32
        torch.testing.assert_close(ours, ref, atol=2e-4, rtol=2e-4)
    _all_free(cpu, gpu)


def test_greedy_alone_and_in_a_batch_of_64(pair):
    cpu, gpu = pair
    prompts = _prompts(64, seed=2, vocab=cpu.config.vocab_size)
    alone = [gpu.generate([p], GEN)[0] for p in prompts[:6]]
    _check(cpu, prompts[:6], alone)
    _check(cpu, prompts, gpu.generate(prompts, GEN))
    _all_free(cpu, gpu)


def test_chunked_prefill_and_prefix_caching(pair, model_dirs):
    cpu, _ = pair
    path = next(p for p in model_dirs.values() if cpu.model_name == p)
    gpu = _engine(path, "cuda", max_num_batched_tokens=48)
    rng = random.Random(3)
    shared = [rng.randrange(5, cpu.config.vocab_size) for _ in range(100)]
    prompts = [shared + [rng.randrange(5, cpu.config.vocab_size) for _ in range(k)]
               for k in (1, 7, 16, 40)]
    first = gpu.generate(prompts, GEN)
    again = gpu.generate(prompts, GEN)
    _check(cpu, prompts, first)
    assert [r.token_ids for r in again] == [r.token_ids for r in first]
    assert all(r.usage.cached_tokens >= 96 for r in again)  # six full blocks of the prefix
    _all_free(cpu, gpu)


def test_preemption_keeps_tokens(pair, model_dirs):
    cpu, _ = pair
    path = next(p for p in model_dirs.values() if cpu.model_name == p)
    # A pool of a few dozen blocks for 16 requests of up to ~130 tokens: some are evicted.
    block_bytes = gpu_block_bytes(cpu)
    gpu = _engine(path, "cuda", kv_cache_bytes=40 * block_bytes, enable_prefix_caching=False)
    prompts = _prompts(16, seed=4, vocab=cpu.config.vocab_size, max_len=100)
    ids = [gpu.add_request(p, GEN) for p in prompts]
    preempted: set[str] = set()
    while gpu.has_unfinished:
        gpu.step()
        preempted |= {r.request_id for r in [*gpu.scheduler.running, *gpu.scheduler.waiting]
                      if r.num_preemptions}
    results = [gpu.wait(i) for i in ids]
    assert preempted, "the pool was large enough that nothing was preempted"
    _check(cpu, prompts, results)
    _all_free(gpu)


def gpu_block_bytes(engine: LLMEngine) -> int:
    from llmdb.engine.cache.kv_cache import KVCache

    return KVCache.bytes_per_block(engine.config, engine.pool.block_size, torch.float32)


@pytest.mark.parametrize("name", ["opt", "qwen3"])
def test_hybrid_cache_under_apt_keeps_tokens(model_dirs, name):
    """OPT (MHA) and Qwen3 under apt on a pool too small for its batch in KV form: requests
    move between K/V and hidden states (compiled Triton gathers and writes, re-projection
    into a scratch cache, hidden -> KV by projection) and keep the CPU engine's tokens."""
    path = model_dirs[name]
    cpu = _engine(path, "cpu")
    gpu = _engine(path, "cuda", kv_cache_bytes=40 * gpu_block_bytes(cpu), policy="apt",
                  enable_prefix_caching=False)
    assert gpu.describe()["hidden_cache"]["enabled"]
    prompts = _prompts(16, seed=8, vocab=cpu.config.vocab_size, max_len=100)
    ids = [gpu.add_request(p, GEN) for p in prompts]
    kinds: set[str] = set()
    while gpu.has_unfinished:
        gpu.step()
        kinds |= {r.cache_type for r in gpu.scheduler.running}
    assert kinds == {"kv", "hidden"}, kinds
    _check(cpu, prompts, [gpu.wait(i) for i in ids])
    _all_free(gpu)


def test_hidden_requests_read_a_shared_prefix_from_the_kv_cache(model_dirs):
    """OPT under apt weighing memory alone, prompts sharing 48 tokens: hidden-cache requests
    read the prefix one KV request published (its K/V copied into their scratch on the
    device), store only their own tokens, and keep the CPU engine's tokens."""
    path = model_dirs["opt"]
    cpu = _engine(path, "cpu")
    gpu = _engine(path, "cuda", kv_cache_bytes=40 * gpu_block_bytes(cpu), policy="apt")
    cm = gpu.scheduler.cost_model
    gpu.scheduler.cost_model = replace(cm, coefficients={**cm.coefficients,
                                                         "hidden_tokens": 0.0})
    rng = random.Random(4)
    shared = [rng.randrange(5, cpu.config.vocab_size) for _ in range(48)]
    prompts = [shared + own for own in _prompts(16, seed=9, vocab=cpu.config.vocab_size,
                                                max_len=40)]
    prefixes: list[int] = []
    gpu.scheduler.observers.append(lambda out: prefixes.extend(
        r.num_kv_prefix for r, _ in out.scheduled if r.cache_type == "hidden"))
    ids = [gpu.add_request(p, GEN) for p in prompts]
    while gpu.has_unfinished:
        gpu.step()
    assert max(prefixes, default=0) > 0, "no hidden request read the prefix"
    _check(cpu, prompts, [gpu.wait(i) for i in ids])
    _all_free(gpu)


def test_cuda_graphs_equal_eager(pair, model_dirs):
    cpu, graphs = pair
    path = next(p for p in model_dirs.values() if cpu.model_name == p)
    eager = _engine(path, "cuda", cuda_graphs=False)
    assert not eager.describe()["cuda_graphs"]
    prompts = _prompts(40, seed=5, vocab=cpu.config.vocab_size)
    graphs.step_log, eager.step_log = [], []
    for a, b, p in zip(graphs.generate(prompts, GEN), eager.generate(prompts, GEN), prompts,
                       strict=True):
        assert_same_tokens(cpu, p, b.token_ids, a.token_ids)
    # The decodes did replay graphs (the comparison would be empty otherwise).
    assert "graph" in {k for k, _, _ in graphs.step_log}
    assert "graph" not in {k for k, _, _ in eager.step_log}
    graphs.step_log = None
    _all_free(graphs, eager)


def test_mixed_graphs_equal_eager(pair, model_dirs):
    """More rows than running slots, outputs of different lengths: new prompts join running
    decodes step after step, and those mixed steps replay graphs captured at first use."""
    cpu, _ = pair
    path = next(p for p in model_dirs.values() if cpu.model_name == p)
    graphs = _engine(path, "cuda", max_num_seqs=16, max_num_batched_tokens=256)
    eager = _engine(path, "cuda", max_num_seqs=16, max_num_batched_tokens=256,
                    cuda_graphs=False)
    prompts = _prompts(48, seed=13, vocab=cpu.config.vocab_size, max_len=60)
    params = [SamplingParams(max_tokens=4 + i % 13, ignore_eos=True) for i in range(48)]
    graphs.step_log = []
    for a, b, p in zip(graphs.generate(prompts, params), eager.generate(prompts, params),
                       prompts, strict=True):
        assert_same_tokens(cpu, p, b.token_ids, a.token_ids)
    kinds = [k for k, _, _ in graphs.step_log]
    assert kinds.count("mixed graph") > kinds.count("eager"), kinds
    assert graphs.describe()["mixed_cuda_graphs"]
    _all_free(graphs, eager)


def test_launch_ahead_equals_step_by_step(pair):
    """The default (launching step N+1 before reading step N, pending tokens taken on the
    device) against reading each step before the next, with stops, sampling and logprobs."""
    cpu, gpu = pair
    prompts = _prompts(24, seed=9, vocab=cpu.config.vocab_size)
    params = [SamplingParams(max_tokens=1 + i % 9, ignore_eos=True,
                             stop_token_ids=[7, 8, 9] if i % 3 == 0 else [],
                             logprobs=2 if i % 4 == 0 else None,
                             temperature=0.8 if i % 5 == 0 else 0.0, seed=i)
              for i in range(24)]
    ahead = gpu.generate(prompts, params)
    gpu.launch_ahead = False
    try:
        step_by_step = gpu.generate(prompts, params)
    finally:
        gpu.launch_ahead = True
    for p, a, b in zip(prompts, step_by_step, ahead, strict=True):
        assert_same_tokens(cpu, p, a.token_ids, b.token_ids)
        assert a.finish_reason == b.finish_reason
    _all_free(gpu)


def test_launching_ahead_never_overwrites_inputs_the_device_has_not_copied(pair, model_dirs):
    """Launching ahead, step N+2 is filled into step N's host buffers. Eager prompt chunks
    sample nothing, so no read makes the host wait for the device: with the device held
    back (a spin kernel queued first), only the buffers' own wait keeps step N's inputs
    from being overwritten before they are copied."""
    cpu, _ = pair
    path = next(p for p in model_dirs.values() if cpu.model_name == p)
    gpu = _engine(path, "cuda", max_num_batched_tokens=32, cuda_graphs=False)
    rng = random.Random(11)
    prompts = [[rng.randrange(5, cpu.config.vocab_size) for _ in range(k)] for k in (150, 90)]
    torch.cuda._sleep(1_000_000_000)  # the GPU spins for about half a second
    _check(cpu, prompts, gpu.generate(prompts, GEN))
    _all_free(gpu)


def test_a_decode_step_waits_for_the_device_once(pair):
    """No hidden synchronization: a pageable host-to-device copy, .item() or .tolist() would
    stall the host behind the step it just launched. Only the read of the sampled ids
    (an event wait, which the sync debug mode does not count) waits."""
    cpu, gpu = pair
    prompts = _prompts(16, seed=10, vocab=cpu.config.vocab_size)
    params = [SamplingParams(max_tokens=12, ignore_eos=True, seed=i,
                             temperature=0.7 if i % 2 else 0.0) for i in range(16)]
    ids = [gpu.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    for _ in range(3):  # prefills, and every graph and kernel warmed
        gpu.step()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(4):
            gpu.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for i in ids:
        assert gpu.wait(i).finish_reason == "length"
    _all_free(gpu)


def test_seeded_sampling_is_reproducible(pair):
    _, gpu = pair
    prompts = _prompts(8, seed=6, vocab=gpu.config.vocab_size)
    params = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, top_k=20, seed=123,
                            ignore_eos=True)
    alone = gpu.generate([prompts[0]], params)[0].token_ids
    others = [SamplingParams(max_tokens=16, temperature=1.0, seed=s, ignore_eos=True)
              for s in range(7)]
    batched = gpu.generate(prompts, [params, *others])[0].token_ids
    assert alone == batched == gpu.generate([prompts[0]], params)[0].token_ids
    other = gpu.generate([prompts[0]], SamplingParams(
        max_tokens=16, temperature=0.9, top_p=0.95, top_k=20, seed=124, ignore_eos=True))
    assert other[0].token_ids != alone
    _all_free(gpu)


def test_scores_and_logprobs_match_cpu(pair):
    cpu, gpu = pair
    prompt = _prompts(1, seed=7, vocab=cpu.config.vocab_size)[0] + [9, 10]
    conts = [[11, 12, 13], [14], [15, 16]]
    torch.testing.assert_close(torch.tensor(gpu.score(prompt, conts)),
                               torch.tensor(cpu.score(prompt, conts)), atol=1e-3, rtol=1e-4)
    params = SamplingParams(max_tokens=4, logprobs=3, ignore_eos=True)
    a, b = gpu.generate([prompt], params)[0], cpu.generate([prompt], params)[0]
    assert a.token_ids == b.token_ids
    for (lp_a, top_a), (lp_b, top_b) in zip(a.logprobs, b.logprobs, strict=True):
        assert abs(lp_a - lp_b) < 1e-3 and top_a.keys() == top_b.keys()
    _all_free(cpu, gpu)


@pytest.mark.parametrize("name", MODELS)
def test_batch_invariant_answers_alone_equal_those_in_a_batch(model_dirs, name):
    """bf16, CUDA graphs on: with batch_invariant=True a request's tokens and log-probabilities
    are the same bits alone and among 63 others of mixed lengths (its prompt chunked
    otherwise, its decodes beside prefill chunks); every other request draws with a seed and
    top-p, asking for another number of log-probabilities (tied bf16 values must not follow
    the batch's). The answers stay the CPU fp32 engine's (near-ties aside) in fp32."""
    path = model_dirs[name]
    eng = LLMEngine(path, device="cuda", dtype="bf16", kv_cache_bytes=64 << 20,
                    batch_invariant=True, enable_prefix_caching=False,
                    max_num_batched_tokens=512)
    assert eng.describe()["batch_invariant"]
    prompts = _prompts(64, seed=41, vocab=eng.config.vocab_size)
    params = [SamplingParams(max_tokens=24, ignore_eos=True, logprobs=3) if i % 2 else
              SamplingParams(max_tokens=24, ignore_eos=True, logprobs=1, temperature=0.8,
                             top_p=0.9, seed=i)
              for i in range(len(prompts))]
    batched = eng.generate(prompts, params)
    for i in (0, 5, 36, 63):
        alone = eng.generate([prompts[i]], params[i])[0]
        assert alone.token_ids == batched[i].token_ids, i
        assert alone.logprobs == batched[i].logprobs, i
    fp32 = _engine(path, "cuda", batch_invariant=True)
    _check(_engine(path, "cpu"), prompts[:16], fp32.generate(prompts[:16], GEN))
    _all_free(eng, fp32)


def test_sql_on_cuda(model_dirs, tmp_path, monkeypatch):
    duckdb = pytest.importorskip("duckdb", reason="duckdb is not installed here")
    import llmdb
    from llmdb.engine.registry import register_model

    del duckdb
    monkeypatch.setenv("LLMDB_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.setenv("LLMDB_CACHE_DIR", str(tmp_path / "cache"))
    register_model("tiny-gpu", model_dirs["llama-gqa"])
    with llmdb.connect(model="tiny-gpu", device="cuda", dtype="fp32", cache=False) as con:
        rows = con.execute("SELECT i, llm_complete('hello world ' || i::VARCHAR, "
                           "max_tokens := 5) AS a FROM range(6) t(i) ORDER BY i").fetchall()
        assert len(rows) == 6 and all(isinstance(a, str) for _, a in rows)
        assert "cuda" in con.explain_report(
            "SELECT llm_complete('hello ' || i::VARCHAR) FROM range(3) t(i)").engine
    from llmdb.engine.process_engines import shared_engine

    _all_free(shared_engine("tiny-gpu"))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_engines_on_two_gpus_capture_their_own_graphs(model_dirs):
    """An engine on cuda:1 beside one on cuda:0 in the same process: each captures its
    graphs on a stream of its own device (torch's default capture stream is the first
    device's) and answers as the CPU does."""
    path = model_dirs["llama-gqa"]
    cpu = _engine(path, "cpu")
    prompts = _prompts(16, seed=11, vocab=cpu.config.vocab_size)
    for device in ("cuda:0", "cuda:1"):
        engine = _engine(path, device)
        engine.step_log = []
        _check(cpu, prompts, engine.generate(prompts, GEN))
        assert "graph" in {k for k, _, _ in engine.step_log}
        engine.step_log = None
        _all_free(engine)
