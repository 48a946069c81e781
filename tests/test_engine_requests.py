"""The engine's public API used carelessly: bad parameters, bad prompts, reused request
ids, a failing step. Each is refused naming its cause, or ends its own requests; the engine
serves the next request as before (the reference: that request's tokens before the fault)."""

from __future__ import annotations

import gc
import re
import threading
import weakref

import numpy as np
import pytest
import torch

from llmdb.engine.engine import LLMEngine
from llmdb.engine.outputs import RequestAborted
from llmdb.engine.params import SamplingParams

from .helpers import chat

SHORT = SamplingParams(max_tokens=4, ignore_eos=True)


@pytest.mark.parametrize(
    ("params", "field"),
    [
        (SamplingParams(max_tokens=2.5), "max_tokens"),
        (SamplingParams(max_tokens=float("nan")), "max_tokens"),  # (generated to the context)
        (SamplingParams(max_tokens=True), "max_tokens"),
        (SamplingParams(temperature="0.7"), "temperature"),
        (SamplingParams(temperature=float("nan")), "temperature"),
        (SamplingParams(top_p=float("nan")), "top_p"),
        (SamplingParams(top_p=0), "top_p"),
        (SamplingParams(top_k=2.5, temperature=1.0), "top_k"),
        (SamplingParams(top_k=-1), "top_k"),
        (SamplingParams(seed=1.5, temperature=1.0), "seed"),
        (SamplingParams(seed="7", temperature=1.0), "seed"),
        (SamplingParams(logprobs=2.5), "logprobs"),
        (SamplingParams(logprobs=True), "logprobs"),
        (SamplingParams(logprobs=-1), "logprobs"),
        (SamplingParams(logprobs=10**6), "logprobs"),  # more than the vocabulary
        (SamplingParams(stop=[5]), "stop"),
        (SamplingParams(stop=["ok", ""]), "stop"),
        (SamplingParams(stop={"a": 1}), "stop"),
        (SamplingParams(stop_token_ids=["a"]), "stop_token_ids"),
        (SamplingParams(ignore_eos="no"), "ignore_eos"),
    ],
)
def test_each_bad_sampling_value_is_refused_naming_its_field(engine, params, field):
    """These reached the sampler, which runs a batch at once: a float seed or logprobs
    beyond the vocabulary failed every request of the step, and a stop "string" that was an
    int failed every later step of the engine."""
    beside = engine.add_request("Hello there", SHORT)
    with pytest.raises((TypeError, ValueError), match=rf"^{field}\b|^stop strings"):
        engine.add_request("Hello there", params)
    ref = engine.wait(beside)
    assert ref.finish_reason == "length" and ref.error is None
    assert engine.generate(["Hello there"], SHORT)[0].token_ids == ref.token_ids


def test_sampling_values_are_normalized():
    """A lone stop string is a list of one, None no stop, numpy integers ints (a numpy
    seed overflowed the noise hash's 64-bit mask)."""
    p = SamplingParams(max_tokens=np.int64(3), seed=np.int64(-5), top_k=np.int32(4),
                       stop="\n", stop_token_ids=7, logprobs=np.int64(2))
    p.validate()
    assert (p.max_tokens, p.seed, p.top_k, p.stop, p.stop_token_ids, p.logprobs) == (
        3, -5, 4, ["\n"], [7], 2)
    assert all(type(v) is int for v in (p.max_tokens, p.seed, p.top_k, p.logprobs))
    none = SamplingParams(stop=None, stop_token_ids=None)
    none.validate()
    assert (none.stop, none.stop_token_ids) == ([], [])


def test_a_seeded_numpy_integer_samples_as_its_int(engine):
    prompt = chat("Tell me a story.")
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=3, ignore_eos=True)
    ref = engine.generate([prompt], params)[0].token_ids
    numpy_seed = SamplingParams(max_tokens=6, temperature=1.0, seed=np.int64(3),
                                ignore_eos=True)
    assert engine.generate([prompt], numpy_seed)[0].token_ids == ref


@pytest.mark.parametrize("background", [False, True])
def test_a_step_that_raises_fails_its_requests_and_the_engine_serves_on(engine, monkeypatch,
                                                                         background):
    """A bug while a step's tokens were taken (here: the first call of _after_token raises)
    left that step in flight: driven by wait(), every later step read it again and raised
    the same, for these requests and every new one. Now the requests under way end with the
    error, and the next request gets the tokens it got before."""
    prompt = chat("What is the capital of France?")
    ref = engine.generate([prompt], SHORT)[0].token_ids
    real = engine._after_token
    calls = []

    def buggy(req, token, result):
        calls.append(req.request_id)
        if len(calls) == 1:
            raise KeyError("a bug")
        return real(req, token, result)

    monkeypatch.setattr(engine, "_after_token", buggy)
    if background:
        engine.start_background_loop()
    try:
        ids = [engine.add_request(prompt, SHORT) for _ in range(2)]
        failed = [engine.wait(i, timeout=60) for i in ids]
        again = engine.generate([prompt], SHORT)[0]
    finally:
        engine.stop_background_loop()
    assert [r.finish_reason for r in failed] == ["error", "error"]
    assert all("the engine's step failed: KeyError: 'a bug'" in r.error for r in failed)
    assert again.finish_reason == "length" and again.token_ids == ref


def test_a_refused_prompt_of_generate_names_it_and_leaves_nothing_running(engine):
    """generate() queued the prompts before the bad one and raised: those ran on, unasked,
    and their results stayed in the engine for good. The error did not say which prompt."""
    with pytest.raises(ValueError, match=r"^prompt 2 of 3: empty prompt"):
        engine.generate(["Hi", "Hello", ""], SHORT)
    assert not engine._requests and not engine._results
    with pytest.raises(ValueError, match="2 prompts but 1 SamplingParams"):
        engine.generate(["Hi", "Hello"], [SHORT])
    assert not engine._requests and not engine._results


def test_a_request_id_whose_result_is_not_collected_is_still_in_use(engine):
    """A finished request's id was free again before wait() took its result: the next
    request of that id then got the first one's result from wait(), and its own stayed in
    the engine for good."""
    first = engine.add_request("Say A", SHORT, request_id="x")
    while engine.has_unfinished:
        engine.step()
    with pytest.raises(ValueError, match=r"already in use .* \(request 'x'\)$"):
        engine.add_request("Tell me a long story", SHORT, request_id="x")
    assert engine.wait(first).usage.prompt_tokens == len(engine.encode_prompt("Say A"))
    again = engine.add_request("Tell me a long story", SHORT, request_id="x")  # collected: free
    assert engine.wait(again).usage.prompt_tokens == len(
        engine.encode_prompt("Tell me a long story"))


@pytest.mark.parametrize("temperature", [1e-6, 1e-38, 1e-45])
def test_a_vanishing_temperature_samples_the_greedy_tokens(engine, temperature):
    """Sampling divided the raw logits by the temperature: below about 1e-37 every positive
    logit became +inf, and the draw was among them at random (NaN probabilities, so no top-p
    either), not the argmax that temperature -> 0 tends to."""
    prompt = chat("Tell me a story about a cat.")
    greedy = engine.generate([prompt], SamplingParams(max_tokens=8))[0].token_ids
    cold = SamplingParams(max_tokens=8, temperature=temperature, top_p=0.9, seed=4)
    assert engine.generate([prompt], cold)[0].token_ids == greedy


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        (None, "a prompt is a string, a list of token ids or a list of chat messages"),
        (5, "not int"),
        ([{"role": "user", "content": "hi"}, 5], "token ids must be integers, got a chat "
                                                 "message"),
        ([1.5, 2], "token ids must be integers, got 1.5"),  # (was token 1)
        (["a", "b"], "token ids must be integers, got 'a'"),
    ],
)
def test_a_malformed_prompt_is_refused_naming_what_it_holds(engine, prompt, message):
    with pytest.raises(TypeError, match=message):
        engine.add_request(prompt, SHORT)


def test_token_ids_may_be_numpy_or_torch_integers(engine):
    ids = engine.encode_prompt("Hello there")
    as_numpy = engine.encode_prompt(list(np.array(ids)))
    as_torch = engine.encode_prompt(list(torch.tensor(ids)))
    assert as_numpy == as_torch == ids and all(type(t) is int for t in as_torch)


def test_a_stream_whose_request_fails_raises_naming_it(engine, monkeypatch):
    """stream() ended as at a normal finish when its request failed (its result, holding
    the error, was dropped): a short answer the caller could not tell from a whole one."""
    prompt = chat("Tell me a story.")
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    ref = engine.generate([prompt], params)[0].token_ids
    real, calls = engine._after_token, []

    def buggy(req, token, result):
        calls.append(token)
        if len(calls) == 3:
            raise KeyError("a bug")
        return real(req, token, result)

    monkeypatch.setattr(engine, "_after_token", buggy)
    got = []
    with pytest.raises(RuntimeError, match=r"request 'req-\d+' failed: the engine's step "
                                           r"failed: KeyError"):
        got.extend(engine.stream(prompt, params))
    assert got == ref[:2]
    monkeypatch.undo()
    assert list(engine.stream(prompt, params)) == ref  # and a whole one ends quietly


def test_a_stream_aborted_by_another_caller_raises_request_aborted(engine):
    prompt = chat("Tell me a story.")
    stream = engine.stream(prompt, SamplingParams(max_tokens=50, ignore_eos=True))
    first = next(stream)
    (rid,) = engine._requests
    engine.abort(rid)
    with pytest.raises(RequestAborted, match=rid):
        list(stream)
    assert isinstance(first, int)
    left = engine.stream(prompt, SamplingParams(max_tokens=50, ignore_eos=True))
    next(left)
    left.close()  # the caller stopping reading is no error: its request just ends
    assert not engine._requests and not engine._results


@pytest.mark.parametrize(
    ("continuation", "error", "message"),
    [
        ([10**6], ValueError, "token id 1000000 is outside the vocabulary"),
        ([1.5], TypeError, "token ids must be integers, got 1.5"),
        (None, TypeError, "a continuation is a string or a list of token ids"),
    ],
)
def test_a_bad_score_continuation_is_refused_before_it_reaches_a_batch(engine, continuation,
                                                                       error, message):
    """Continuation ids were not checked: one beyond the vocabulary failed in the model's
    embedding, and with it every request of that step (the generation beside it here)."""
    beside = engine.add_request("Hello there", SHORT)
    with pytest.raises(error, match=message):
        engine.score("Is water wet?", [continuation])
    assert engine.wait(beside).finish_reason == "length"


def test_score_refuses_a_lone_string_for_its_list_of_continuations(engine):
    """score(prompt, "Yes") scored "Y", "e" and "s", three numbers for one answer."""
    with pytest.raises(TypeError, match="continuations is a list"):
        engine.score("Is water wet?", "Yes")
    one = engine.score("Is water wet?", ["Yes"])
    ids = engine.encode_prompt("Is water wet?")
    cont = engine.tokenizer.encode("Yes")
    logp = engine.logits(ids + cont)[len(ids) - 1:-1].log_softmax(-1)
    assert one[0] == pytest.approx(float(logp[torch.arange(len(cont)), cont].sum()), abs=1e-4)


@pytest.mark.parametrize(("candidates", "error", "message"), [
    ([1.5], TypeError, "token ids must be integers, got 1.5"),  # (was a gather() error)
    ([49152], ValueError, "token id 49152 is outside the vocabulary"),
    ([], ValueError, "at least one candidate"),
])
def test_bad_choice_candidates_are_refused(engine, candidates, error, message):
    beside = engine.add_request("Hello there", SHORT)
    with pytest.raises(error, match=message):
        engine.add_choice_request("Is water wet?", candidates)
    assert engine.wait(beside).finish_reason == "length"


@pytest.mark.parametrize("limit", [
    {"max_num_batched_tokens": 0}, {"max_num_batched_tokens": -5}, {"max_num_seqs": 0},
    {"max_prefill_tokens": -1}, {"block_size": 0}, {"max_num_seqs": 2.5},
])
def test_engine_limits_that_could_never_schedule_are_refused_by_name(limit):
    """A step budget or sequence limit of 0 (or less) scheduled nothing, and generate()
    looped for ever; block_size=0 was a ZeroDivisionError. Refused before the model loads."""
    (name, value), = limit.items()
    with pytest.raises(ValueError, match=rf"^{name} must be a positive integer, got {value}"):
        LLMEngine("smollm2-135m", dtype="fp32", **limit)


def test_a_callback_that_waits_on_the_engine_fails_its_request_instead_of_hanging(engine):
    """A token callback calling generate() waited for a step that waits for the callback
    (driven by wait(), on the step lock; in the background loop, for the loop's own
    thread): for ever. Now that wait raises, so the callback's request ends with the cause,
    and the engine serves on. (Driven by wait() only: with the loop, the old hang would
    hang the test's cleanup too.)"""
    prompt = chat("What is the capital of France?")
    ref = engine.generate([prompt], SHORT)[0].token_ids

    def waits(token):
        if token is not None:
            engine.generate(["Hi"], SamplingParams(max_tokens=2))

    got = []
    rid = engine.add_request(prompt, SHORT, on_token=waits)
    caller = threading.Thread(target=lambda: got.append(engine.wait(rid)), daemon=True)
    caller.start()
    caller.join(60)
    assert not caller.is_alive(), "the request's wait() hung"
    assert got[0].finish_reason == "error"
    assert "its callback raised RuntimeError: wait() was called from inside" in got[0].error
    assert engine.generate([prompt], SHORT)[0].token_ids == ref
    while engine._results:  # (the inner request, aborted: its result cannot be waited for)
        engine._results.popitem()


@pytest.mark.parametrize("messages, cause", [
    ([{"role": "user", "content": None}], "chat message 0 (user): content is null"),
    ([{"role": "system", "content": "Be brief."}, {"role": "user"}],
     "chat message 1 (user): content is missing"),
    ([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": None},
      {"role": "user", "content": "Go on."}], "chat message 1 (assistant): content is null"),
])
def test_a_chat_message_without_text_is_refused_naming_it(engine, messages, cause):
    """It reached the chat template, whose TypeError (concatenating None) named neither the
    message nor the field. OpenAI's rule: null only in an assistant message with tool_calls."""
    with pytest.raises(ValueError, match=rf"^{re.escape(cause)}; it must be text \(null only "
                                         r"in an assistant message with tool_calls\) "
                                         r"\(request 'req-\d+'\)$"):
        engine.add_request(messages, SHORT)
    assert not engine.has_unfinished


@pytest.mark.parametrize("submit, error", [
    (lambda e, rid: e.add_request("Hi", SamplingParams(max_tokens=0), request_id=rid),
     ValueError),
    (lambda e, rid: e.add_request("Hi", SamplingParams(seed="7"), request_id=rid), TypeError),
    (lambda e, rid: e.add_request("", SHORT, request_id=rid), ValueError),
    (lambda e, rid: e.add_request("Hi", SHORT, request_id=rid, priority="urgent"), ValueError),
    (lambda e, rid: e.add_request([{"role": "user"}], SHORT, request_id=rid), ValueError),
    (lambda e, rid: e.add_score_request("Hi", "", request_id=rid), ValueError),
    (lambda e, rid: e.add_score_request("Hi", 5, request_id=rid), TypeError),
    (lambda e, rid: e.add_choice_request("Hi", [], request_id=rid), ValueError),
    (lambda e, rid: e.add_logits_request([1.5], request_id=rid), TypeError),
])
def test_a_refused_request_is_named_by_its_id(engine, submit, error):
    """A caller that submitted many requests can tell which one was refused (the exception
    type is the one it was)."""
    with pytest.raises(error) as info:
        submit(engine, "row-17")
    assert type(info.value) is error
    assert str(info.value).endswith(" (request 'row-17')"), str(info.value)


def test_a_refused_request_without_an_id_is_named_by_the_one_it_was_given(engine):
    with pytest.raises(ValueError, match=r"^max_tokens must be positive, got 0 \(request "
                                         r"'req-\d+'\)$"):
        engine.add_request("Hi", SamplingParams(max_tokens=0))
    rid = engine.add_request("Hi", SHORT, request_id="taken")
    with pytest.raises(ValueError, match=r"^the id is already in use by a request running, or "
                                         r"finished and not collected by wait\(\) \(request "
                                         r"'taken'\)$"):
        engine.add_request("Hi", SHORT, request_id="taken")
    engine.wait(rid)


@pytest.mark.parametrize("launch_ahead", [False, True])
def test_the_engine_keeps_nothing_of_a_collected_request(engine, launch_ahead):
    """Between queries the engine holds no finished request, nor what its callbacks hold (a
    query's batch, its rows, its cache file): the runner kept the last launched step, its
    requests and their callbacks, until the next query's first step."""
    saved = engine.launch_ahead
    engine.launch_ahead = launch_ahead

    class Caller:  # stands for a batch: what a request's callback keeps alive
        def done(self, request_id: str) -> None:
            pass

    callers = [Caller() for _ in range(3)]
    ids = [engine.add_request(chat(f"Name {n} colours."), SamplingParams(max_tokens=4),
                              on_finish=c.done) for n, c in enumerate(callers, 1)]
    for rid in ids:
        engine.wait(rid)
    engine.launch_ahead = saved
    alive = [weakref.ref(c) for c in callers]
    del callers
    gc.collect()
    assert not [r for r in alive if r() is not None]
