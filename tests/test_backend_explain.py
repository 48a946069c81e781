"""The backend contract's answers for EXPLAIN LLM on the bundled model, checked against what
the engine then does: a request's tokens and its prefix-cache hit, predicted before it is
sent, are the usage the engine reports for it; EXPLAIN's token estimates follow from them."""

from __future__ import annotations

import threading
import uuid

import pytest

from llmdb.backends import BackendResult, ChoiceRequest, GenerationRequest, ScoreRequest
from llmdb.engine.costmodel import preset
from llmdb.engine.params import SamplingParams
from llmdb.planner.estimate import use_cost_model

pytestmark = pytest.mark.usefixtures("eng", "own_cache_dir")

# About 60 tokens under the chat template: several full blocks that rows share.
SYSTEM = "You answer questions about fruit and colors, briefly and politely. " * 4


def _run(backend, request) -> BackendResult:
    done = threading.Event()
    handle = backend.submit(request, done.set)
    assert done.wait(120), "the request did not finish"
    return backend.collect(handle)


def test_predicted_tokens_and_prefix_hits_are_the_engines_usage(con):
    backend = con.session.backend()
    system = f"{uuid.uuid4()} {SYSTEM}"  # blocks no earlier request left in the pool
    first = GenerationRequest(backend.render_chat("Name a color.", system),
                              SamplingParams(max_tokens=2))
    t = backend.tokenize(first)
    assert backend.cached_prefix(t.ids[:t.cacheable + 1]) == 0
    assert _run(backend, first).cached_tokens == 0
    prompt = backend.render_chat("Name a fruit.", system)
    for request in (GenerationRequest(prompt, SamplingParams(max_tokens=2)),
                    ScoreRequest(prompt, "Apple"), ChoiceRequest(prompt, ("yes", "no"))):
        t = backend.tokenize(request)
        predicted = backend.cached_prefix(t.ids[:t.cacheable + 1])
        got = _run(backend, request)
        assert (got.prompt_tokens, got.cached_tokens) == (t.count, predicted), request
        assert predicted >= 3 * 16  # the shared system prompt's blocks, at least


def test_simulation_is_the_engines_configuration(con, eng):
    sim = con.session.backend().simulation()
    d = eng.describe()
    assert (sim.config.num_blocks, sim.config.block_size, sim.config.prefix_caching) == (
        d["kv_cache"]["blocks"], d["kv_cache"]["block_size"], d["kv_cache"]["prefix_caching"])
    assert (sim.policy, sim.config.max_num_seqs, sim.config.max_num_batched_tokens) == (
        d["policy"], d["max_num_seqs"], d["max_num_batched_tokens"])
    assert sim.cost_model is eng.cost_model


def test_explain_on_the_model_counts_tokens_exactly_and_times_them(con):
    use_cost_model(preset("cpu"))
    try:
        sql = ("SELECT i, llm_complete('Name a color number ' || (i % 5)::VARCHAR, "
               "max_tokens := 2) FROM range(12) t(i)")
        [site, _] = _rows(con, sql)
        assert site["model_s_est"] is not None and site["model_s_est"] > 0
        con.execute(sql).fetchall()
        [site, _] = _rows(con, sql)
        assert site["calls_est"] == site["calls_actual"] == 5  # one per distinct prompt
        assert site["prompt_tokens_est"] == site["prompt_tokens_actual"]
    finally:
        use_cost_model(None)


def _rows(con, sql):
    con.execute(f"EXPLAIN LLM {sql}")
    cols = [d[0] for d in con.description]
    return [dict(zip(cols, r, strict=True)) for r in con.fetchall()]
