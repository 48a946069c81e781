"""The batch-invariant mode of the GPU path: a row's result does not depend on the rows
computed beside it (kernels/gpu/matmul.py, paged_attention(invariant=True), the row-wise
log-softmax and scan of kernels/gpu/rowwise.py, and the engine's batch_invariant option end
to end: a batch, a prefix-cache hit, preemption, graph-padded steps launched ahead, apt's
hidden cache, seeded top-p draws and top log-probabilities).

Without a GPU the Triton kernels run under TRITON_INTERPRET=1 (conftest.py) on CPU tensors in
fp32; with one they run compiled, in fp32 and bf16. Each invariance check is bit for bit.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed: the GPU kernels are not tested")

from llmdb.engine import sampling  # noqa: E402
from llmdb.engine.cache.kv_cache import KVCache  # noqa: E402
from llmdb.engine.cuda_graphs import StepGraphs  # noqa: E402
from llmdb.engine.engine import LLMEngine, _check_batch_invariant  # noqa: E402
from llmdb.engine.models.loader import load_model  # noqa: E402
from llmdb.engine.params import SamplingParams  # noqa: E402
from llmdb.engine.sampling import row_key, sample, top_logprobs  # noqa: E402
from llmdb.kernels.attention import AttentionBatch  # noqa: E402
from llmdb.kernels.gpu import rowwise  # noqa: E402
from llmdb.kernels.gpu.attention import paged_attention  # noqa: E402
from llmdb.kernels.gpu.matmul import matmul  # noqa: E402

from .model_builders import edit_config, randomize, save_tiny_llama  # noqa: E402
from .test_hf_models import VARIANTS as HF_VARIANTS  # noqa: E402
from .test_hf_models import _save as hf_save  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
if not CUDA and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no GPU and TRITON_INTERPRET is not 1 (conftest.py sets it before any kernel "
                "is defined; run through pytest)", allow_module_level=True)
DTYPES = [torch.float32, torch.bfloat16] if CUDA else [torch.float32]


@pytest.fixture(autouse=True)
def _row_by_row_interpreter_dot(monkeypatch):
    """Under the interpreter tl.dot is numpy's matmul, i.e. the CPU's BLAS, whose result for a
    row can depend on the row's place in the tile (OpenBLAS's AVX2 sgemm: rows 6-11 of a tile
    sum in another order than rows 0-5; its AVX-512 kernels happened not to). A GPU's mma sums
    a row the same wherever it sits, so here each row of a dot is computed alone: these tests
    then check the kernels' order of summation, not the host BLAS's."""
    if CUDA:
        return
    import numpy as np
    from triton.runtime import interpreter

    plain = interpreter.InterpreterBuilder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype.primitive_bitwidth == 8:  # fp8 operands: the interpreter's own conversion
            return plain(self, a, b, d, input_precision, max_num_imprecise_acc)
        rows = [np.matmul(a.data[..., i:i + 1, :], b.data, dtype=d.data.dtype)
                for i in range(a.data.shape[-2])]
        return interpreter.TensorHandle(np.concatenate(rows, axis=-2) + d.data,
                                        d.dtype.scalar)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", create_dot)


def _rand(*shape: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True])
# K not a multiple of the K tile, N not one of the N tile, rows over two row tiles.
@pytest.mark.parametrize("m,n,k", [(1, 96, 80), (5, 200, 72), (70, 130, 100)])
def test_matmul_equals_torch(m, n, k, bias, dtype):
    x = _rand(m, k, seed=1, dtype=dtype)
    w = _rand(n, k, seed=2, dtype=dtype)
    b = _rand(n, seed=3, dtype=dtype) if bias else None
    ref = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())
    y = matmul(x, w, b)
    assert y.dtype == dtype and y.shape == (m, n)
    tol = {"atol": 1e-4, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 0.1, "rtol": 2e-2}
    torch.testing.assert_close(y.double(), ref, **tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_matmul_row_does_not_depend_on_the_rows_beside_it(dtype):
    """Row r of x alone, among a few other rows, and deep in a batch of many (in another row
    tile, at another position in it) gives the same bits."""
    k, n = 136, 150
    w = _rand(n, k, seed=4, dtype=dtype)
    b = _rand(n, seed=5, dtype=dtype)
    row = _rand(1, k, seed=6, dtype=dtype)
    alone = matmul(row, w, b)
    for m, at, seed in [(3, 1, 7), (37, 36, 8), (97, 40, 9), (200, 0, 10)]:
        x = _rand(m, k, seed=seed, dtype=dtype) * 100  # other magnitudes beside it
        x[at] = row[0]
        assert torch.equal(matmul(x, w, b)[at], alone[0]), (m, at)


def test_matmul_writes_into_out_and_reads_strided_inputs():
    """A CUDA graph's shared output buffer (a row range of a bigger one) and a transposed
    weight view."""
    x = _rand(6, 40, seed=11, dtype=torch.float32)
    w_t = _rand(40, 24, seed=12, dtype=torch.float32)  # stored [K, N]: w = w_t.T is strided
    buf = torch.full((10, 24), 7.0, device=DEVICE)
    y = matmul(x, w_t.T, out=buf[2:8])
    assert y.data_ptr() == buf[2:8].data_ptr()
    torch.testing.assert_close(buf[2:8], x @ w_t, atol=1e-4, rtol=1e-5)
    assert (buf[:2] == 7).all() and (buf[8:] == 7).all()
    assert matmul(x[:0], w_t.T).shape == (0, 24)
    with pytest.raises(ValueError, match="columns"):
        matmul(x, w_t)


BLOCK = 16
PROMPT = 40  # the sequence under test: 40 prompt tokens in blocks 3, 7, 1, then a decode


def _attend(kc: torch.Tensor, vc: torch.Tensor, seqs: list[tuple], num_splits: int = 1
            ) -> list[torch.Tensor]:
    """One step over `seqs` (query rows, context length after the step, block table), the
    step's query rows in that order; each sequence's output rows."""
    batch = AttentionBatch.build([len(r) for r, _, _ in seqs], [c for _, c, _ in seqs],
                                 [t for _, _, t in seqs], BLOCK, DEVICE)
    q = torch.cat([r for r, _, _ in seqs])
    out = paged_attention(q, kc, vc, batch, q.shape[-1] ** -0.5, num_splits=num_splits,
                          invariant=True)
    return list(out.split([len(r) for r, _, _ in seqs]))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (4, 4, 32), (32, 1, 16)])
def test_attention_row_does_not_depend_on_the_step(heads, kv_heads, dim, dtype):
    """A sequence's rows from its prompt in one chunk, in two chunks beside other sequences
    (the second over the first as a cached prefix), and its decode alone, beside a prefill
    chunk, and with split-KV asked for: the same bits each time."""
    kc = _rand(40 * BLOCK, kv_heads, dim, seed=20, dtype=dtype)
    vc = _rand(40 * BLOCK, kv_heads, dim, seed=21, dtype=dtype)
    q = _rand(PROMPT + 1, heads, dim, seed=22, dtype=dtype)  # its prompt's queries, a decode's
    table = [3, 7, 1, 9]
    other_prefill = (_rand(30, heads, dim, seed=23, dtype=dtype), 30, [0, 2])
    other_decode = (_rand(1, heads, dim, seed=24, dtype=dtype), 50, [4, 5, 6, 8])

    whole = _attend(kc, vc, [(q[:PROMPT], PROMPT, table)])[0]
    first = _attend(kc, vc, [other_decode, (q[:25], 25, table)])[1]
    second = _attend(kc, vc, [other_prefill, (q[25:PROMPT], PROMPT, table), other_decode])[1]
    assert torch.equal(torch.cat([first, second]), whole)

    decode = (q[PROMPT:], PROMPT + 1, table)
    alone = _attend(kc, vc, [decode])[0]
    assert torch.equal(_attend(kc, vc, [other_prefill, decode])[1], alone)
    # Over 300 keys (five key tiles): split four ways, were splits not ignored.
    long_decode = (q[PROMPT:], 300, list(range(10, 29)))
    alone = _attend(kc, vc, [long_decode])[0]
    assert torch.equal(_attend(kc, vc, [other_decode, long_decode], num_splits=4)[1], alone)


# ---- log-probabilities and top-p's sums ------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
# Less than a chunk; several chunks, rows not a multiple of 4 wide (where torch's CUDA
# log-softmax sums a row by its index in the batch).
@pytest.mark.parametrize("rows,cols", [(1, 1000), (5, 2051), (3, 4099)])
def test_rowwise_log_softmax_and_cumsum_equal_torch(rows, cols, dtype):
    x = _rand(rows, cols, seed=30, dtype=dtype) * 4
    y = rowwise.log_softmax(x)
    assert y.dtype == torch.float32 and y.shape == x.shape
    torch.testing.assert_close(y.double(), x.double().log_softmax(-1), atol=1e-5, rtol=1e-6)
    p = x.abs()
    torch.testing.assert_close(rowwise.cumsum(p).double(), p.double().cumsum(-1), atol=1e-5,
                               rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rowwise_row_does_not_depend_on_the_rows_beside_it(dtype):
    """A row's log-softmax and cumulative sums alone, among a few rows and among many (a
    view into a wider matrix): the same bits."""
    cols = 3001
    row = _rand(1, cols, seed=32, dtype=dtype) * 4
    lsm, sums = rowwise.log_softmax(row)[0], rowwise.cumsum(row.abs())[0]
    for m, at, seed in [(2, 1, 33), (7, 3, 34), (40, 39, 35)]:
        x = _rand(m, cols + 5, seed=seed, dtype=dtype)[:, :cols] * 4
        x[at] = row[0]
        assert torch.equal(rowwise.log_softmax(x)[at], lsm), (m, at)
        assert torch.equal(rowwise.cumsum(x.abs())[at], sums), (m, at)


def test_top_logprobs_of_a_row_do_not_depend_on_what_the_others_ask():
    """Tied logits (a bf16 model's often are): a row's top 1, 2 or 3 alone, and beside rows
    asking for 8, 5 or none. A topk of the batch's largest k returned other tied ids."""
    g = torch.Generator().manual_seed(36)
    logits = torch.randint(0, 6, (4, 200), generator=g).float().to(DEVICE)
    tokens = logits.argmax(-1)
    for k in (1, 2, 3):
        chosen, values, ids = top_logprobs(logits[:1], tokens[:1], [k])
        got = top_logprobs(logits, tokens, [k, 8, 0, 5])
        assert torch.equal(got[0][:1], chosen)
        assert torch.equal(got[1][0, :k], values[0]) and torch.equal(got[2][0, :k], ids[0]), k
        assert (got[1][0, k:] == float("-inf")).all() and (got[1][2] == float("-inf")).all()


def test_top_p_draws_through_the_rowwise_scan(monkeypatch):
    """The sampler's torch path (a GPU's: every row sorted whole) with invariant=True sums
    top-p's masses with rowwise.cumsum: the tokens torch's cumsum gives, a row's the same
    alone as in a batch."""
    monkeypatch.setattr(sampling, "load_library", lambda: None)  # (not csrc/sampling.cpp)
    monkeypatch.setattr(sampling, "_WHOLE_SORT_SHARE", 0.0)  # (every row sorted whole)
    g = torch.Generator().manual_seed(37)
    logits = (torch.randn(12, 3000, generator=g) * 2.5).to(torch.bfloat16).float().to(DEVICE)
    params = [SamplingParams(temperature=t, top_p=p) for t in (0.7, 1.0, 1.5)
              for p in (0.3, 0.8, 0.95, 0.99)]
    keys = [row_key(9, i) for i in range(12)]
    rows = list(range(12))
    want = sample(logits, rows, params, keys).tolist()
    got = sample(logits, rows, params, keys, invariant=True).tolist()
    assert got == want
    alone = [sample(logits[i:i + 1], [0], params[i:i + 1], keys[i:i + 1], invariant=True)[0]
             for i in rows]
    assert [int(t) for t in alone] == got


def test_batch_invariant_on_a_gpu_needs_the_triton_kernels():
    """attention="reference" on a GPU runs cuBLAS's matmuls: batch_invariant=True refuses
    it, naming why, where it once left the answers batch-dependent without a word."""
    with pytest.raises(ValueError, match="needs the Triton kernels.*'reference'.*cuBLAS"):
        _check_batch_invariant("reference", torch.device("cuda"))
    _check_batch_invariant("triton", torch.device("cuda"))
    _check_batch_invariant("cpu", torch.device("cpu"))


# ---- the engine, end to end ----------------------------------------------------------------
#
# Each scenario runs the same six requests (the third the one under test) and compares every
# request's tokens and log-probabilities, bit for bit, with those of another schedule: the
# target alone, or the six in one roomy batch (whose target equals the alone one).

TARGET = 2  # the request under test, third of six
KV_BLOCK = 4  # tokens a block (small, so that prompts span blocks and steps cut through them)


def _heads_of_32(cfg: dict) -> None:
    """Half the heads, twice as wide (the weights keep their shapes): with heads of 16 the
    interpreter's attention happened to agree across tile shapes, with 32 it does not."""
    cfg["head_dim"] = 2 * cfg.get("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    for key in ("num_attention_heads", "num_key_value_heads"):
        if key in cfg:
            cfg[key] //= 2


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("batch_invariant")
    build, tok_cfg, prepend = HF_VARIANTS["opt"]
    torch.manual_seed(3)
    opt = build()
    randomize(opt, 3)
    hf_save(opt, root / "opt16", tok_cfg, prepend)
    return {"llama-gqa": edit_config(save_tiny_llama(root / "llama16"), root / "llama",
                                     _heads_of_32),
            "opt": edit_config(root / "opt16", root / "opt", _heads_of_32)}


def _engine(path: Path, **options) -> LLMEngine:
    """The batch-invariant engine in the interpreter: 16-token steps, no prefix cache (a
    later run would reuse an earlier one's blocks) unless asked for."""
    eng = LLMEngine(str(path), **{
        "device": DEVICE, "dtype": "float32", "attention": "triton", "batch_invariant": True,
        "enable_prefix_caching": False, "kv_cache_bytes": 1 << 20, "block_size": KV_BLOCK,
        "max_num_batched_tokens": 16, "threads": 2, **options})
    assert eng.describe()["batch_invariant"]
    return eng


def _requests(vocab: int) -> tuple[list[list[int]], list[SamplingParams]]:
    """Six requests, four tokens each. The target: 21 prompt tokens, drawn at temperature 0.8
    with top-p 0.9 and a seed, two top log-probabilities a token. The others' prompts push
    the target's into other chunks; they decode greedily or draw with seeds, asking for
    other numbers of log-probabilities."""
    rng = random.Random(5)
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in (3, 13, 21, 9, 30, 6)]
    params = [SamplingParams(max_tokens=4, ignore_eos=True, **kw) for kw in (
        {}, {"logprobs": 5}, {"temperature": 0.8, "top_p": 0.9, "seed": 7, "logprobs": 2},
        {"temperature": 1.0, "top_k": 20, "seed": 3, "logprobs": 1}, {"logprobs": 2},
        {"temperature": 0.7, "seed": 11})]
    return prompts, params


def _answer(result) -> tuple[list[int], list | None]:
    return result.token_ids, result.logprobs


def _pool_bytes(path: Path, blocks: int) -> int:
    """kv_cache_bytes for a pool of `blocks` blocks of the model at path."""
    config = load_model(str(path)).config
    return blocks * KVCache.bytes_per_block(config, KV_BLOCK, torch.float32)


@pytest.fixture(scope="module")
def reference(model_dirs):
    """name -> (the target's answer alone, the six answers in one batch), computed once."""
    done: dict[str, tuple] = {}

    def get(name: str) -> tuple:
        if name not in done:
            eng = _engine(model_dirs[name])
            prompts, params = _requests(eng.config.vocab_size)
            alone = _answer(eng.generate([prompts[TARGET]], params[TARGET])[0])
            done[name] = alone, [_answer(r) for r in eng.generate(prompts, params)]
            assert eng.pool.num_free == eng.pool.num_blocks
        return done[name]

    return get


@pytest.mark.parametrize("name", ["llama-gqa", "opt"])
def test_engine_answer_does_not_depend_on_its_batch(name, reference):
    """The target alone and as the third of six: its prompt cut into other chunks (16-token
    steps), its decodes beside other requests' prefill chunks and decodes."""
    alone, batch = reference(name)
    assert batch[TARGET] == alone


def test_a_prefix_cache_hit_gives_the_same_bits(model_dirs, reference):
    """The target's first three blocks come from the prefix cache, computed by another
    request: the target computes only its last 9 prompt tokens, in one chunk."""
    alone, _ = reference("llama-gqa")
    eng = _engine(model_dirs["llama-gqa"], enable_prefix_caching=True)
    prompts, params = _requests(eng.config.vocab_size)
    target = prompts[TARGET]
    eng.generate([target[:12] + prompts[0]], params[0])  # (its fourth block differs)
    got = eng.generate([prompts[0], target], [params[0], params[TARGET]])[1]
    assert got.usage.cached_tokens == 12
    assert _answer(got) == alone


def test_preempted_requests_recompute_the_same_bits(model_dirs, reference):
    """A pool of 12 blocks for six requests that need 30: the scheduler preempts requests
    and recomputes their prompts and tokens so far as prefill chunks beside others."""
    _, batch = reference("llama-gqa")
    path = model_dirs["llama-gqa"]
    eng = _engine(path, kv_cache_bytes=_pool_bytes(path, 12))
    assert eng.pool.num_blocks == 12
    preempted = []
    eng.scheduler.observers.append(lambda out: preempted.extend(out.preempted))
    prompts, params = _requests(eng.config.vocab_size)
    got = [_answer(r) for r in eng.generate(prompts, params)]
    assert preempted, "the pool was meant to be too small"
    assert got == batch
    assert eng.pool.num_free == eng.pool.num_blocks


def test_graph_steps_launched_ahead_give_the_same_bits(model_dirs, reference):
    """Steps through (emulated) CUDA graphs, each launched before the last one's tokens are
    read: decode steps padded to their batch-size bucket, mixed steps to 64 tokens and 8
    sequences."""
    _, batch = reference("llama-gqa")
    eng = _engine(model_dirs["llama-gqa"], max_num_seqs=8, launch_ahead=True)
    eng.runner.graphs = StepGraphs(eng.runner, 8, emulate=True)
    eng.runner.graphs.capture_all()
    eng.step_log = []
    prompts, params = _requests(eng.config.vocab_size)
    got = [_answer(r) for r in eng.generate(prompts, params)]
    assert {"graph", "mixed graph"} <= {kind for kind, _, _ in eng.step_log}
    assert got == batch
    assert eng.pool.num_free == eng.pool.num_blocks


def test_apt_hidden_cache_gives_the_same_bits(model_dirs, reference):
    """apt (Apt-Serve) on a pool of 16 blocks for six requests that need 30 in KV form keeps
    some as hidden states, their K/V re-projected from them at every step (or projected
    into KV blocks where apt converts them): their answers are the roomy KV batch's."""
    _, batch = reference("opt")
    path = model_dirs["opt"]
    eng = _engine(path, policy="apt", kv_cache_bytes=_pool_bytes(path, 16))
    kinds = set()
    eng.scheduler.observers.append(
        lambda out: kinds.update(r.cache_type for r, _ in out.scheduled))
    prompts, params = _requests(eng.config.vocab_size)
    got = [_answer(r) for r in eng.generate(prompts, params)]
    assert kinds == {"kv", "hidden"}
    assert got == batch
    assert eng.pool.num_free == eng.pool.num_blocks
