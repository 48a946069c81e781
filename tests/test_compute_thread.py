"""engine/compute.py: every model computation of the process runs on one compute thread.

Proved: `run_on_compute_thread` runs fn on one and the same OS thread whichever thread calls
it (the main thread or several others at once), and that thread is none of the callers;
a call made from inside fn runs inline on that thread (no deadlock); fn's return value comes
back and its exception reaches the caller with type and message. On the real engine, the
model work of `step()` (runner.launch) runs on that thread whether `generate` is called from
the main thread or from another one, and both give the same greedy tokens.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from llmdb.engine.compute import run_on_compute_thread
from llmdb.engine.params import SamplingParams


def _compute_ident() -> int:
    return run_on_compute_thread(threading.get_ident)


def test_main_and_other_threads_share_one_compute_thread():
    compute = _compute_ident()
    main = threading.get_ident()
    assert compute != main
    assert run_on_compute_thread(threading.get_ident) == compute
    barrier = threading.Barrier(6)

    def caller() -> tuple[int, int]:
        barrier.wait()  # all six call at once
        return threading.get_ident(), run_on_compute_thread(threading.get_ident)

    with ThreadPoolExecutor(6) as ex:
        results = list(ex.map(lambda _: caller(), range(6)))
    callers = {c for c, _ in results}
    assert len(callers) == 6
    assert {ran for _, ran in results} == {compute}
    assert compute not in callers | {main}


def test_nested_call_runs_inline_on_the_compute_thread():
    def outer() -> tuple[int, int, int]:
        me = threading.get_ident()
        inner = run_on_compute_thread(threading.get_ident)  # would deadlock if queued
        deeper = run_on_compute_thread(run_on_compute_thread, threading.get_ident)
        return me, inner, deeper

    result: list = []
    t = threading.Thread(target=lambda: result.append(run_on_compute_thread(outer)))
    t.start()
    t.join(timeout=30)
    assert not t.is_alive(), "nested run_on_compute_thread deadlocked"
    compute = _compute_ident()
    assert result == [(compute, compute, compute)]


def test_return_values_and_arguments_come_back():
    assert run_on_compute_thread(divmod, 17, 5) == (3, 2)
    assert run_on_compute_thread(sorted, [3, 1, 2], reverse=True) == [3, 2, 1]
    obj = object()
    assert run_on_compute_thread(lambda: obj) is obj
    assert run_on_compute_thread(lambda: None) is None


def test_exception_propagates_with_type_and_message():
    class Boom(RuntimeError):
        pass

    def fail(x):
        raise Boom(f"bad input {x}")

    with pytest.raises(Boom, match=r"^bad input 42$"):
        run_on_compute_thread(fail, 42)
    with pytest.raises(KeyError, match="missing"):
        run_on_compute_thread({}.__getitem__, "missing")
    # The compute thread survives its callers' exceptions.
    assert run_on_compute_thread(lambda: 5) == 5


def test_engine_steps_run_on_the_compute_thread(engine, monkeypatch):
    compute = _compute_ident()
    seen: list[int] = []
    launch = engine.runner.launch

    def spy(*args, **kwargs):
        seen.append(threading.get_ident())
        return launch(*args, **kwargs)

    monkeypatch.setattr(engine.runner, "launch", spy)
    prompt = engine.encode_prompt("The capital of France is")
    params = SamplingParams(max_tokens=6, ignore_eos=True)

    from_main = engine.generate([prompt], params)[0]
    steps_main = len(seen)
    box: list = []
    t = threading.Thread(target=lambda: box.append(engine.generate([prompt], params)[0]))
    t.start()
    t.join(timeout=120)
    assert not t.is_alive()
    from_thread = box[0]

    assert steps_main >= 6 and len(seen) >= 2 * 6  # a prefill and decodes per generation
    assert set(seen) == {compute}
    assert compute not in (threading.get_ident(), t.ident)
    assert from_main.finish_reason == from_thread.finish_reason == "length"
    assert len(from_main.token_ids) == 6
    assert from_thread.token_ids == from_main.token_ids
