"""The engine on the bundled model: batching, chunking and preemption never change tokens."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
import time

import pytest
import torch

from llmdb.engine.engine import LLMEngine
from llmdb.engine.outputs import RequestAborted
from llmdb.engine.params import SamplingParams
from llmdb.engine.sched.scheduler import SchedulerOutput

from .helpers import CHAT_QUESTIONS, assert_same_tokens, chat


def _mixed_prompts(engine: LLMEngine, n: int = 32) -> list[list[int]]:
    """n chat prompts of varied lengths (about 30 to 200 tokens)."""
    prompts = []
    for i in range(n):
        q = CHAT_QUESTIONS[i % len(CHAT_QUESTIONS)]
        q = (q + " Please answer carefully. ") * (1 + i % 5)
        prompts.append(engine.encode_prompt(chat(q)))
    return prompts


GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def alone(engine_fp32: LLMEngine) -> dict[int, list[int]]:
    """Reference: each of the first 4 prompts generated on its own."""
    prompts = _mixed_prompts(engine_fp32)
    return {i: engine_fp32.generate([prompts[i]], GREEDY)[0].token_ids for i in range(4)}


@pytest.mark.parametrize("budget", [1, 7, 64, 1024])
def test_batch_and_budget_do_not_change_tokens(engine, alone, budget):
    engine.scheduler.max_num_batched_tokens = budget
    prompts = _mixed_prompts(engine)
    results = engine.generate(prompts if budget >= 64 else prompts[:6], GREEDY)
    for i, ref in alone.items():
        assert_same_tokens(engine, prompts[i], ref, results[i].token_ids)
    assert all(r.usage.generated_tokens == 12 for r in results)


def test_forced_preemption_recomputes_the_same_tokens(engine, alone):
    prompts = _mixed_prompts(engine)[:4]
    ids = [engine.add_request(p, GREEDY) for p in prompts]
    for _ in range(6):
        engine.step()
    with engine._cond:  # preempt the newest two mid-generation, as a full pool would
        for _ in range(2):
            engine.scheduler.preempt(SchedulerOutput(), engine.scheduler.running[-1])
    results = [engine.wait(i) for i in ids]
    for i, r in enumerate(results):
        assert_same_tokens(engine, prompts[i], alone[i], r.token_ids)


def test_small_pool_preempts_and_never_overflows():
    eng = LLMEngine("smollm2-135m", dtype="fp32", kv_cache_bytes=36 * 16 * 46080)  # 36 blocks
    prompts = _mixed_prompts(eng, 8)  # 41 to 106 tokens: with 16 new ones, 46 blocks' worth
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    # References from one batch that fits the pool (in fp32 batching changes no token:
    # test_batch_and_budget_do_not_change_tokens), not one request at a time, which took as
    # many steps again; 7 is the request the small pool preempts.
    refs = (0, 5, 7)
    ref = dict(zip(refs, [r.token_ids for r in eng.generate([prompts[i] for i in refs], params)],
                   strict=True))
    preempted = []
    ids = [eng.add_request(p, params) for p in prompts]
    while eng.has_unfinished:
        eng.step()
        assert eng.pool.num_free >= 0
        preempted.extend(r.request_id for r in eng.scheduler.running if r.num_preemptions)
    results = [eng.wait(i) for i in ids]
    assert preempted, "the workload was meant to overflow the pool"
    for i, r in ref.items():
        assert_same_tokens(eng, prompts[i], r, results[i].token_ids)
    assert eng.pool.num_free == eng.pool.num_blocks


def test_paged_logits_equal_reference_attention(engine):
    ids = engine.encode_prompt(chat(CHAT_QUESTIONS[2]))
    fast = engine.logits(ids)
    saved = engine.model.kernels
    engine.model.kernels = "reference"
    try:
        ref = engine.logits(ids)
    finally:
        engine.model.kernels = saved
    assert fast.shape == (len(ids), engine.config.vocab_size) and fast.dtype == torch.float32
    torch.testing.assert_close(fast, ref, atol=1e-4, rtol=1e-4)


def test_logits_match_generation(engine):
    """Greedy tokens are the argmax of the teacher-forced logits."""
    ids = engine.encode_prompt(chat(CHAT_QUESTIONS[0]))
    out = engine.generate([ids], SamplingParams(max_tokens=8, ignore_eos=True))[0].token_ids
    logits = engine.logits(ids + out[:-1])
    assert logits[len(ids) - 1 :].argmax(-1).tolist() == out


def test_seeded_sampling_is_reproducible_across_batches(engine):
    prompts = _mixed_prompts(engine, 6)
    params = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, top_k=50, seed=123)
    alone = engine.generate([prompts[0]], params)[0].token_ids
    again = engine.generate([prompts[0]], params)[0].token_ids
    others = [SamplingParams(max_tokens=16, temperature=1.0, seed=s) for s in range(5)]
    batched = engine.generate(prompts, [params, *others])[0].token_ids
    assert alone == again
    assert_same_tokens(engine, prompts[0], alone, batched)
    other_seed = engine.generate([prompts[0]], SamplingParams(
        max_tokens=16, temperature=0.9, top_p=0.95, top_k=50, seed=124))[0].token_ids
    assert other_seed != alone


def test_stop_strings_and_stop_tokens(engine):
    ids = engine.encode_prompt(chat("Count from 1 to 20, separated by commas."))
    free = engine.generate([ids], SamplingParams(max_tokens=40))[0]
    assert "5" in free.text
    r = engine.generate([ids], SamplingParams(max_tokens=40, stop=["5"]))[0]
    assert r.finish_reason == "stop" and "5" not in r.text and free.text.startswith(r.text)
    tok = free.token_ids[3]
    r = engine.generate([ids], SamplingParams(max_tokens=40, stop_token_ids=[tok]))[0]
    first = free.token_ids.index(tok)
    assert r.finish_reason == "stop" and r.token_ids == free.token_ids[: first + 1]


def test_eos_and_length_finish_reasons(engine):
    ids = engine.encode_prompt(chat(CHAT_QUESTIONS[0]))
    r = engine.generate([ids], SamplingParams(max_tokens=64))[0]
    assert r.finish_reason == "stop" and r.token_ids[-1] in engine.config.eos_token_ids
    assert "Paris" in r.text and "<|im_end|>" not in r.text
    r = engine.generate([ids], SamplingParams(max_tokens=3))[0]
    assert r.finish_reason == "length" and len(r.token_ids) == 3
    assert r.usage.prompt_tokens == len(ids) and r.usage.ttft_s <= r.usage.total_s


def test_logprobs(engine):
    ids = engine.encode_prompt(chat(CHAT_QUESTIONS[0]))
    r = engine.generate([ids], SamplingParams(max_tokens=4, logprobs=3, ignore_eos=True))[0]
    assert len(r.logprobs) == 4
    for tok, (lp, top) in zip(r.token_ids, r.logprobs, strict=True):
        assert len(top) == 3 and max(top, key=top.get) == tok  # greedy picks the top one
        assert lp == pytest.approx(top[tok]) and lp <= 0


def test_score_continuations(engine):
    prompt = chat("Is the sky blue on a clear day? Answer yes or no.")
    ids = engine.encode_prompt(prompt)
    yes, no = engine.tokenizer.encode("Yes"), engine.tokenizer.encode("No")
    scores = engine.score(prompt, [yes, no])
    lp = engine.logits(ids)[-1].log_softmax(-1)
    assert scores[0] == pytest.approx(float(lp[yes[0]]), abs=1e-4)
    assert scores[1] == pytest.approx(float(lp[no[0]]), abs=1e-4)
    # A multi-token continuation sums its tokens' log-probabilities.
    cont = engine.tokenizer.encode("Yes, it is.")
    full = engine.logits(ids + cont).log_softmax(-1)
    expected = sum(float(full[len(ids) - 1 + k, t]) for k, t in enumerate(cont))
    assert engine.score(prompt, [cont])[0] == pytest.approx(expected, abs=1e-3)


def test_stream_yields_the_generated_tokens(engine):
    ids = engine.encode_prompt(chat(CHAT_QUESTIONS[1]))
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    assert list(engine.stream(ids, params)) == engine.generate([ids], params)[0].token_ids


def test_abort_frees_blocks_and_engine_keeps_serving(engine):
    ids = engine.encode_prompt(chat(CHAT_QUESTIONS[3]))
    rid = engine.add_request(ids, SamplingParams(max_tokens=50, ignore_eos=True))
    keep = engine.add_request(ids, SamplingParams(max_tokens=5, ignore_eos=True))
    engine.step()
    engine.step()
    engine.abort(rid)
    r = engine.wait(rid)
    assert r.finish_reason == "abort"
    assert engine.wait(keep).usage.generated_tokens == 5


def test_aborting_many_running_requests_waits_for_one_step_not_one_each(engine, monkeypatch):
    """abort(*ids) with the background loop busy: every request ends (their blocks freed)
    as the step under way ends, not one per step. (Query cancellation aborts its rows so.)"""
    launches = []
    launch = engine.runner.launch
    monkeypatch.setattr(engine.runner, "launch", lambda *a: launches.append(1) or launch(*a))
    ids = engine.encode_prompt(chat(CHAT_QUESTIONS[2]))
    rids = [engine.add_request(ids + [i], SamplingParams(max_tokens=400, ignore_eos=True))
            for i in range(8)]
    engine.start_background_loop()
    try:
        deadline = time.monotonic() + 60
        while min(engine.num_generated(r) for r in rids) < 2:
            assert time.monotonic() < deadline, "the requests never started decoding"
            time.sleep(0.01)
        before = len(launches)
        engine.abort(*rids)
        steps = len(launches) - before
        assert all(r not in engine._requests for r in rids)
    finally:
        engine.stop_background_loop()
    assert steps <= 2, f"{len(rids)} aborts took {steps} steps"
    assert [engine.wait(r).finish_reason for r in rids] == ["abort"] * len(rids)
    assert engine.pool.num_free == engine.pool.num_blocks


@dataclasses.dataclass
class _HeldLoop:
    """The background loop held inside a runner call while a thread waits on a job; `got`:
    what the job returned ("result") or the RequestAborted it raised ("error")."""

    resume: threading.Event
    waiter: threading.Thread
    got: dict
    timed_out: list  # [True] once the held step stopped waiting for release()

    def release(self) -> None:
        """Lets the held step go on: the waiter must then end (an abort woke it)."""
        assert not self.timed_out, "the step was let go by its timeout, not by release()"
        self.resume.set()
        self.waiter.join(30)
        assert not self.waiter.is_alive(), "the waiter was not woken by the abort"


@contextlib.contextmanager
def _loop_held(engine, monkeypatch, method: str, call: int, job):
    """job() runs on a thread of its own beside the background loop, which is held inside
    engine.runner.<method> at its call-th call until release(). (No timing: a loop that takes
    its lock back at once would starve a test that polls.) On exit the loop stops and the
    runner's method is its own again."""
    original, calls, timed_out = getattr(engine.runner, method), [], []
    reached, resume = threading.Event(), threading.Event()

    def held(*args, **kwargs):
        calls.append(1)
        if len(calls) == call:
            reached.set()
            if not resume.wait(30):
                timed_out.append(True)
        return original(*args, **kwargs)

    monkeypatch.setattr(engine.runner, method, held)
    got: dict[str, object] = {}

    def waiter() -> None:
        try:
            got["result"] = job()
        except RequestAborted as e:
            got["error"] = e

    engine.start_background_loop()
    thread = threading.Thread(target=waiter)
    thread.start()
    try:
        assert reached.wait(30), f"the job never reached call {call} of runner.{method}"
        yield _HeldLoop(resume, thread, got, timed_out)
    finally:
        resume.set()
        engine.stop_background_loop()
        monkeypatch.setattr(engine.runner, method, original)


def test_aborting_a_logits_job_mid_way_frees_its_blocks_and_tells_its_waiter(engine,
                                                                             monkeypatch):
    """A thread waits in logits() on a long prompt; another aborts the job between two of its
    steps: every block is freed, the waiter gets RequestAborted naming the job (not the rows
    computed so far), no result is left behind, and the engine's next logits equal those of
    an undisturbed run. The background loop is held at the job's second step."""
    ids = engine.encode_prompt(chat(" ".join(CHAT_QUESTIONS) * 2))
    short = ids[:48]
    ref = engine.logits(short)
    monkeypatch.setattr(engine.scheduler, "max_num_batched_tokens", 16)  # many steps
    job = functools.partial(engine.logits, ids, request_id="long-logits")
    with _loop_held(engine, monkeypatch, "launch", 2, job) as held:
        req = engine._requests["long-logits"]
        assert 0 < req.num_computed < len(ids)
        assert engine.pool.num_free < engine.pool.num_blocks
        # abort() waits for the held step: it is made from a thread of its own.
        aborting = threading.Thread(target=engine.abort, args=("long-logits",))
        aborting.start()
        held.release()
        aborting.join(30)
        assert not aborting.is_alive(), "abort() did not return once the step ended"
    got = held.got
    assert "result" not in got
    assert isinstance(got["error"], RequestAborted) and got["error"].request_id == "long-logits"
    assert "'long-logits' was aborted" in str(got["error"])
    assert engine.pool.num_free == engine.pool.num_blocks
    assert not engine.has_unfinished and not engine._results
    torch.testing.assert_close(engine.logits(short), ref, rtol=1e-4, atol=1e-4)


def test_an_abort_from_the_steps_own_callback_does_not_wait_for_the_step(engine, monkeypatch):
    """abort() waits for a step under way (its K/V writes must land before the blocks are
    freed), except when the step itself calls it (an on_token callback): that wait would
    never end. The abort is then finished as the step ends, after one token."""
    lock, takers = engine._step_lock, []

    class Spy:  # the step lock, counting who takes it
        def __enter__(self):
            takers.append(threading.get_ident())
            return lock.__enter__()

        def __exit__(self, *exc):
            return lock.__exit__(*exc)

    monkeypatch.setattr(engine, "_step_lock", Spy())
    rid = engine.add_request(chat(CHAT_QUESTIONS[0]), SamplingParams(max_tokens=8),
                             on_token=lambda tok: tok is not None and engine.abort(rid))
    result = engine.wait(rid)
    assert result.finish_reason == "abort" and len(result.token_ids) == 1
    assert set(takers) == {threading.get_ident()}  # the steps' own takes, not abort's
    assert engine.pool.num_free == engine.pool.num_blocks


def test_an_aborted_score_request_raises_naming_it_not_a_partial_sum(engine, monkeypatch):
    """A thread waits in score() on two long continuations; another aborts one of its
    requests after its first step: score() raises RequestAborted naming that request (not
    the sum of the log-probabilities scored so far, as if it were the answer), its other
    request is aborted too, every block is freed, nothing is left behind, and the engine's
    next scores equal an undisturbed run's. The background loop is held as the first step is
    read, its K/V written (held inside a launch, as the logits test above is, the abort
    frees blocks that the launch then writes through an emptied block table)."""
    prompt = [5, 6, 7, 8]
    text = engine.tokenizer.encode(" ".join(CHAT_QUESTIONS))
    continuations = [text[:60], text[60:120]]
    ref = engine.score(prompt, continuations)
    monkeypatch.setattr(engine.scheduler, "max_num_batched_tokens", 16)  # many steps
    job = functools.partial(engine.score, prompt, continuations)
    with _loop_held(engine, monkeypatch, "collect", 1, job) as held:
        first, _ = engine._requests  # score()'s requests, in order
        assert engine._requests[first].num_computed == 16  # 12 of its tokens scored
        # abort() waits for the held step (made here, it would wait out the hold's timeout).
        aborting = threading.Thread(target=engine.abort, args=(first,))
        aborting.start()
        held.release()
        aborting.join(30)
        assert not aborting.is_alive(), "abort() did not return once the step ended"
    got = held.got
    assert "result" not in got
    assert isinstance(got["error"], RequestAborted) and got["error"].request_id == first
    assert f"score request {first!r} was aborted" in str(got["error"])
    assert engine.pool.num_free == engine.pool.num_blocks
    assert not engine.has_unfinished and not engine._results
    assert engine.score(prompt, continuations) == pytest.approx(ref, abs=1e-4)


def test_the_local_backend_reports_an_aborted_choice_as_aborted(engine):
    """An aborted choice request has no candidate scores: collect says it was aborted
    (the batch then fails its row) instead of failing on the scores it lacks."""
    from llmdb.backends import ChoiceRequest
    from llmdb.backends.local import LocalBackend

    backend = LocalBackend(engine)
    handle = backend.submit(ChoiceRequest(chat(CHAT_QUESTIONS[0]), ("yes", "no")), lambda: None)
    engine.abort(handle)
    result = backend.collect(handle)
    assert (result.finish_reason, result.word_probs) == ("abort", ())


def test_the_local_backend_keeps_a_bounded_number_of_label_words(engine, monkeypatch):
    """Classifying into free-text labels kept every word's token ids for the life of the
    process: now the LABEL_WORDS_KEPT most recently used, and a word dropped and asked for
    again gets the same ids, so the same answer."""
    from llmdb.backends import ChoiceRequest, local

    monkeypatch.setattr(local, "LABEL_WORDS_KEPT", 4)
    backend = local.LocalBackend(engine)
    question = chat(CHAT_QUESTIONS[0])

    def word_probs(words: tuple[str, ...]) -> tuple[float, ...]:
        done = threading.Event()
        handle = backend.submit(ChoiceRequest(question, words), done.set)
        while not done.is_set():
            engine.step()
        return backend.collect(handle).word_probs

    first = word_probs(("yes", "no"))
    others = ("red", "blue", "green", "cat", "dog", "house", "tree", "water")
    for word in others:  # free-text labels, each asked once
        assert backend._variants(word) == engine.tokenizer.single_token_variants(word)
    assert backend._variants.cache_info().currsize == 4  # yes and no among those dropped
    # (rel: the prompt's K/V come from the prefix cache the second time; a word's ids
    # missing one spelling moved its probability by 2e-4 of itself)
    assert word_probs(("yes", "no")) == pytest.approx(first, rel=1e-5)



@pytest.mark.parametrize(
    ("prompt", "params", "message"),
    [
        ("", SamplingParams(), "empty prompt"),
        ([], SamplingParams(), "empty prompt"),
        ("hi", SamplingParams(max_tokens=0), "max_tokens must be positive"),
        ("hi", SamplingParams(max_tokens=-3), "max_tokens must be positive"),
        ("hi", SamplingParams(temperature=-1), "temperature"),
        ([10**6], SamplingParams(), "outside the vocabulary"),
    ],
)
def test_bad_requests_are_rejected_clearly(engine, prompt, params, message):
    with pytest.raises(ValueError, match=message):
        engine.add_request(prompt, params)
    assert engine.generate(["Hello"], SamplingParams(max_tokens=2))[0].usage.generated_tokens


def test_prompt_longer_than_context_names_both_lengths(engine):
    with pytest.raises(ValueError, match=r"9,000 tokens.*context of 8,192"):
        engine.add_request([5] * 9000, SamplingParams(max_tokens=1))


def test_request_that_never_fits_the_pool_is_rejected():
    eng = LLMEngine("smollm2-135m", dtype="fp32", kv_cache_bytes=4 * 16 * 46080)  # 64 tokens
    with pytest.raises(ValueError, match="whole pool holds 64"):
        eng.add_request([5] * 50, SamplingParams(max_tokens=30))


def test_background_loop_serves_many_threads(engine):
    prompts = _mixed_prompts(engine, 8)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    alone = [engine.generate([p], params)[0].token_ids for p in prompts]
    results: dict[int, list[int]] = {}
    engine.start_background_loop()
    try:
        def worker(i: int) -> None:
            rid = engine.add_request(prompts[i], params)
            while (r := engine.wait(rid, timeout=0.1)) is None:
                pass
            results[i] = r.token_ids

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        engine.stop_background_loop()
    assert sorted(results) == list(range(8))
    for i, prompt in enumerate(prompts):  # batched across threads: the tokens of each alone
        assert_same_tokens(engine, prompt, alone[i], results[i])


def test_a_callback_that_raises_ends_its_request_not_the_loop(engine):
    """A token callback whose reader is gone (a stopped server's closed event loop) raised
    in the background loop's thread, which died of it: every later request waited for ever.
    Now that request ends with an error naming the callback; the one beside it, and those
    after, are served as before."""
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    prompts = _mixed_prompts(engine, 2)
    alone = engine.generate([prompts[1]], params)[0].token_ids

    def gone(token):
        if token is not None:
            raise RuntimeError("Event loop is closed")

    engine.start_background_loop()
    try:
        bad = engine.add_request(prompts[0], params, on_token=gone)
        good = engine.add_request(prompts[1], params)
        failed, served = engine.wait(bad, timeout=60), engine.wait(good, timeout=60)
        after = engine.add_request(prompts[1], params)
        again = engine.wait(after, timeout=60)
        assert engine.background_loop_running and engine._loop.is_alive()
    finally:
        engine.stop_background_loop()
    assert failed.finish_reason == "error" and len(failed.token_ids) == 1
    assert "callback raised RuntimeError: Event loop is closed" in failed.error
    assert served.token_ids == alone and again.token_ids == alone


def test_prefix_cache_hits_and_keeps_outputs(engine_fp32):
    shared = "Answer in one word. " * 12
    prompts = [engine_fp32.encode_prompt(chat(shared + q)) for q in CHAT_QUESTIONS[:4]]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    cold = LLMEngine("smollm2-135m", dtype="fp32", kv_cache_bytes=64 << 20,
                     enable_prefix_caching=False)
    refs = [cold.generate([p], params)[0] for p in prompts]
    assert all(r.usage.cached_tokens == 0 for r in refs)
    first = engine_fp32.generate([prompts[0]], params)[0]
    rest = engine_fp32.generate(prompts[1:], params)
    # The system prompt and the shared instruction are served from the cache.
    assert all(r.usage.cached_tokens >= 64 for r in rest)
    for p, ref, got in zip(prompts, refs, [first, *rest], strict=True):
        assert_same_tokens(engine_fp32, p, ref.token_ids, got.token_ids)
    # A repeated prompt reuses all its full blocks but still computes its last token.
    again = engine_fp32.generate([prompts[0]], params)[0]
    assert again.usage.cached_tokens == (len(prompts[0]) - 1) // 16 * 16
    assert again.token_ids == first.token_ids
    pool = engine_fp32.pool
    assert pool.num_free == pool.num_blocks and pool.num_cached > 0


def test_one_shared_engine_per_model_and_clear_conflicts():
    from llmdb.engine.process_engines import shared_engine, shutdown_engines

    shutdown_engines()  # start from no shared engine, whatever earlier tests left running
    try:
        a = shared_engine("smollm2-135m", dtype="fp32", kv_cache_bytes=32 << 20)
        assert shared_engine("smollm2-135m") is a
        assert shared_engine("smollm2-135m", dtype="float32") is a
        with pytest.raises(ValueError, match="already runs with dtype=torch.float32"):
            shared_engine("smollm2-135m", dtype="bf16")
        r = a.wait(a.add_request("Hello", SamplingParams(max_tokens=3, ignore_eos=True)))
        assert r.usage.generated_tokens == 3
    finally:
        shutdown_engines()


def test_cut_output_drops_a_partial_character(engine):
    from llmdb.engine.engine import without_partial_char

    ids = engine.tokenizer.encode("café 日本語")  # 日 and 語 are two tokens each here
    cut = next(ids[:k] for k in range(len(ids), 0, -1)
               if engine.tokenizer.decode(ids[:k]).endswith("\ufffd"))
    assert without_partial_char(engine.tokenizer.decode(cut)) == "café 日本"
    assert without_partial_char("done 🙂") == "done 🙂"


def test_attention_fast_is_a_deprecated_name_for_auto():
    from llmdb.engine.engine import _kernel_set

    cpu, bf16 = torch.device("cpu"), torch.bfloat16
    with pytest.warns(DeprecationWarning, match="attention='fast' is deprecated"):
        assert _kernel_set("fast", cpu, bf16) == _kernel_set("auto", cpu, bf16)


def test_fp16_on_the_cpu_runs_the_reference_kernels():
    """The C++ kernels read bf16 and fp32: an fp16 engine on the CPU was built, then every
    request failed with KeyError: torch.float16."""
    eng = LLMEngine("smollm2-135m", dtype="fp16", kv_cache_bytes=32 << 20)
    assert eng.describe()["kernels"] == "reference"
    [r] = eng.generate([[{"role": "user", "content": "Say hi."}]], SamplingParams(max_tokens=4))
    assert r.finish_reason in ("stop", "length") and r.usage.generated_tokens > 0
    with pytest.raises(ValueError, match="bf16 and fp32"):
        LLMEngine("smollm2-135m", dtype="fp16", attention="cpu")


def test_a_request_alone_gets_the_tokens_it_gets_in_a_batch_bf16():
    """bf16, the default: a request decoding alone (one row per matmul) computes exactly the
    bits it computes among others, so a row's answer does not depend on the rows beside it
    (kernels/linear.py, SAME_BITS); chunked prefill does not change them either. Exact, with
    no near-tie allowance."""
    eng = LLMEngine("smollm2-135m", dtype="bf16", kv_cache_bytes=64 << 20)
    prompts = _mixed_prompts(eng, 8)
    alone = [eng.generate([p], GREEDY)[0].token_ids for p in prompts]
    for budget in (1024, 37):
        eng.scheduler.max_num_batched_tokens = budget
        assert [r.token_ids for r in eng.generate(prompts, GREEDY)] == alone, budget
