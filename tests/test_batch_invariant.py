"""The batch-invariant mode of the GPU path: a row's result does not depend on the rows
computed beside it (kernels/gpu/matmul.py, paged_attention(invariant=True), and the engine's
batch_invariant option end to end).

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
from llmdb.engine.engine import LLMEngine, _check_batch_invariant  # noqa: E402
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
# One chunk and a part; several, the row not a multiple of 4 (torch's CUDA kernel then sums a
# row by its index in the batch).
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


@pytest.mark.parametrize("name", ["llama-gqa", "opt"])
def test_engine_answer_does_not_depend_on_its_batch(name, model_dirs):
    """A request's tokens and log-probabilities, bit for bit, alone and as the third of six
    requests whose prompts push its prompt into other chunks (16-token steps, no prefix
    cache to reuse the first run's blocks)."""
    eng = LLMEngine(str(model_dirs[name]), device=DEVICE, dtype="float32", attention="triton",
                    batch_invariant=True, enable_prefix_caching=False, kv_cache_bytes=1 << 20,
                    block_size=4, max_num_batched_tokens=16, threads=2)
    assert eng.describe()["batch_invariant"]
    rng = random.Random(5)
    vocab = eng.config.vocab_size

    def prompt(n: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(n)]

    target = prompt(21)
    others = [prompt(n) for n in (3, 13, 9, 30, 6)]
    params = SamplingParams(max_tokens=4, ignore_eos=True, logprobs=2)
    alone = eng.generate([target], params)[0]
    batched = eng.generate([*others[:2], target, *others[2:]], params)[2]
    assert batched.token_ids == alone.token_ids
    assert batched.logprobs == alone.logprobs
    assert eng.pool.num_free == eng.pool.num_blocks
