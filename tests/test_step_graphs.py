"""Graph-shaped steps (engine/cuda_graphs.py) on the CPU: the GPU kernels under the Triton
interpreter, each "graph" run over the padded buffers instead of captured. Everything but the
capture is checked here: bucket choice, the padded layouts of decode and mixed steps, logit
rows gathered from a padded list, pending tokens copied into padded buffers (launch-ahead).
The captured graphs themselves are compared with eager steps in tests/gpu."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch

from llmdb.engine.cuda_graphs import StepGraphs
from llmdb.engine.engine import LLMEngine
from llmdb.engine.params import SamplingParams

from .helpers import as_windowed_mistral, assert_same_tokens

pytest.importorskip("triton", reason="triton is not installed: the GPU kernels are not tested")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from random_model import write_random_model  # noqa: E402

SEQS = 4


def _engine(path: Path) -> LLMEngine:
    return LLMEngine(str(path), device="cpu", dtype="float32", kv_cache_bytes=1 << 21,
                     block_size=4, attention="triton", cuda_graphs=False, max_num_seqs=SEQS,
                     max_num_batched_tokens=48)


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> LLMEngine:
    return _engine(write_random_model("tiny-llama", tmp_path_factory.mktemp("graphs") / "m",
                                      seed=3, dtype=torch.float32, device="cpu"))


def _prompts(engine: LLMEngine, n: int) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(0)
    vocab = engine.config.vocab_size
    prompts = [[rng.randrange(4, vocab) for _ in range(rng.randrange(2, 40))] for _ in range(n)]
    params = [SamplingParams(max_tokens=rng.randrange(2, 9), ignore_eos=True) for _ in prompts]
    return prompts, params


def test_more_rows_than_slots_run_in_graphs_and_give_the_eager_tokens(engine):
    """Rows outnumber the running slots, so new prompts join running decodes: those mixed
    steps, and the decode steps, replay graphs; tokens equal the eager engine's, stepping
    and launching ahead, and every block comes back. Five rows for SEQS = 4 slots: the fifth
    joins three running decodes in a mixed step (each mixed step runs a 64-token bucket in
    the interpreter, some 2 s)."""
    prompts, params = _prompts(engine, SEQS + 1)
    eager = engine.generate(prompts, params)
    graphs = StepGraphs(engine.runner, SEQS, emulate=True)
    graphs.capture_all()
    engine.runner.graphs = graphs
    try:
        for launch_ahead in (False, True):
            engine.launch_ahead, engine.step_log = launch_ahead, []
            got = engine.generate(prompts, params)
            for p, a, b in zip(prompts, eager, got, strict=True):
                assert_same_tokens(engine, p, a.token_ids, b.token_ids)
            kinds = {k for k, _, _ in engine.step_log}
            assert {"graph", "mixed graph"} <= kinds, kinds
            assert engine.pool.num_free == engine.pool.num_blocks
    finally:
        engine.runner.graphs, engine.launch_ahead, engine.step_log = None, False, None
    # Mixed steps took the smallest bucket that holds them, with as many sequences as fit.
    assert graphs.mixed and all(g.seqs == min(t, SEQS) for t, g in graphs.mixed.items())
    # Every graph writes its logit rows into the first rows of one buffer (a graph's own
    # output would hold a [rows, vocab] tensor per graph in the GPU's pool).
    for g in [*graphs.graphs.values(), *graphs.mixed.values()]:
        assert g.logits.data_ptr() == graphs.logits_out.data_ptr()
        assert g.logits.shape[0] == (g.rows or g.seqs) <= SEQS


def test_scoring_steps_run_eagerly(engine):
    """Scores need logit rows a graph does not gather: those steps run eagerly."""
    want = engine.score([5, 6, 7, 8], [[9, 10], [11]])
    engine.runner.graphs = StepGraphs(engine.runner, SEQS, emulate=True)
    try:
        engine.step_log = []
        assert engine.score([5, 6, 7, 8], [[9, 10], [11]]) == pytest.approx(want, abs=1e-5)
        assert {k for k, _, _ in engine.step_log} == {"eager"}
    finally:
        engine.runner.graphs, engine.step_log = None, None


def test_sliding_windows_in_graph_shaped_steps(tmp_path):
    """A model whose layers see their last 6 positions (the tiny Llama's weights as a
    Mistral): decode and mixed graphs, their padding rows and sequences included, give the
    eager tokens. (Each layer's window is a host value its launch is made with, as a
    captured graph would keep it.)"""
    llama = write_random_model("tiny-llama", tmp_path / "m", seed=3, dtype=torch.float32,
                               device="cpu")
    engine = _engine(as_windowed_mistral(llama, tmp_path / "windowed", 6))
    assert engine.config.layer_windows == (6,) * engine.config.num_layers
    prompts, params = _prompts(engine, 5)
    eager = engine.generate(prompts, params)
    graphs = StepGraphs(engine.runner, SEQS, emulate=True)
    graphs.capture_all()
    engine.runner.graphs, engine.step_log = graphs, []
    got = engine.generate(prompts, params)
    for p, a, b in zip(prompts, eager, got, strict=True):
        assert_same_tokens(engine, p, a.token_ids, b.token_ids)
    assert {"graph", "mixed graph"} <= {k for k, _, _ in engine.step_log}
    assert engine.pool.num_free == engine.pool.num_blocks
