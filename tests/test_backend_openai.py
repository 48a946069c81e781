"""The openai backend against scripted endpoints (tests/openai_stub.py): retries of 429 and
5xx honouring Retry-After, errors that are the row's own, failover from an unreachable
replica, bounded concurrency, rate limits, timeouts, aborts, and a clear error where an
endpoint has no logprobs. No model runs here; tests/test_backend_openai_serve.py runs the
backend against real `llmdb serve` processes."""

from __future__ import annotations

import asyncio
import gzip
import json
import math
import shutil
import threading
import time
import traceback

import httpx
import pytest

pytest.importorskip("uvicorn", reason="uvicorn is not installed")

import llmdb  # noqa: E402
from llmdb.backends import ChoiceRequest, GenerationRequest  # noqa: E402
from llmdb.backends.openai import OpenAIBackend  # noqa: E402
from llmdb.backends.replicas import retry_after  # noqa: E402
from llmdb.engine.params import SamplingParams  # noqa: E402

from .openai_stub import (  # noqa: E402
    StubEndpoint,
    chat_answer,
    free_port,
    generate,
    self_signed_certificate,
)


def _script(*answers):
    """A handler answering with `answers` in turn, then the last one forever."""
    answers = list(answers)

    async def handler(path, body):
        return answers.pop(0) if len(answers) > 1 else answers[0]
    return handler


def test_429_with_retry_after_and_5xx_are_retried(backends):
    ok = (200, {}, chat_answer("fine"))
    with StubEndpoint(_script((429, {"Retry-After": "1"}, {"error": {"message": "slow down"}}),
                              (503, {}, {"error": {"message": "overloaded"}}), ok)) as stub:
        result = generate(backends([stub.url]))
    assert result.error is None and result.text == "fine"
    assert result.prompt_tokens == 5 and result.generated_tokens == 2
    t = [s.at for s in stub.seen]
    assert len(t) == 3
    assert t[1] - t[0] >= 0.95, "Retry-After: 1 was not honoured"
    assert t[2] - t[1] < 0.9, "a 503 without Retry-After waits the (short) backoff only"


def test_retry_after_forms():
    def resp(**headers):
        return httpx.Response(429, headers=headers)
    assert retry_after(resp(**{"retry-after": "2.5"})) == 2.5
    assert retry_after(resp(**{"retry-after-ms": "1500"})) == 1.5
    date = time.strftime("%a, %d %b %Y %H:%M:%S GMT", time.gmtime(time.time() + 30))
    assert 25 <= retry_after(resp(**{"retry-after": date})) <= 31
    assert retry_after(resp()) is None
    assert retry_after(resp(**{"retry-after": "soon"})) is None


def test_gives_up_after_max_retries_naming_the_endpoint(backends):
    with StubEndpoint(_script((500, {}, {"error": {"message": "boom"}}))) as stub:
        result = generate(backends([stub.url], max_retries=2))
    assert len(stub.seen) == 3
    assert result.finish_reason == "error"
    assert f"127.0.0.1:{stub.port}/v1/chat/completions answered 500: boom" in result.error
    assert "gave up after 3 attempts" in result.error


def test_a_4xx_is_the_rows_error_and_follows_on_error(backends):
    async def handler(path, body):
        if "bad row" in body["messages"][-1]["content"]:
            return 400, {}, {"error": {"message": "the prompt is too long", "type": "x"}}
        return 200, {}, chat_answer("ok")

    with StubEndpoint(handler) as stub:
        backend = backends([stub.url])
        con = llmdb.connect(backend=backend, cache=False, on_error="null")
        con.execute("CREATE TABLE t AS SELECT * FROM (VALUES (1, 'good row'), (2, 'bad row')) "
                    "v(id, x)")
        rows = con.sql("SELECT id, llm_complete(x) FROM t ORDER BY id").fetchall()
        assert rows == [(1, "ok"), (2, None)]
        errors = con.sql("SELECT error FROM llm_errors()").fetchall()
        assert len(errors) == 1 and "answered 400: the prompt is too long" in errors[0][0]
        assert f"127.0.0.1:{stub.port}" in errors[0][0]
        assert len(stub.seen) == 2, "a 4xx must not be retried"
        strict = llmdb.connect(backend=backend, cache=False)
        with pytest.raises(llmdb.LLMError, match="answered 400: the prompt is too long"):
            strict.sql("SELECT llm_complete('bad row')").fetchall()


def test_an_unreachable_replica_leaves_the_rotation(backends):
    dead = f"http://127.0.0.1:{free_port()}/v1"  # nothing listens there
    with StubEndpoint(_script((200, {}, chat_answer("from the live one")))) as stub:
        backend = backends([dead, stub.url], max_retries=0)
        results = [generate(backend, f"q{i}") for i in range(6)]
        assert all(r.error is None and r.text == "from the live one" for r in results)
        assert len(stub.seen) == 6
        down, up = backend.pool.replicas
        assert not down.answered and down.down_until > time.monotonic()
        assert up.answered == {"/v1/chat/completions": 6}


@pytest.mark.parametrize("failing", ["500", "stall"])
def test_a_replica_that_keeps_failing_leaves_the_rotation(backends, failing):
    """A server whose engine died (500 to everything) or that hangs: before, it stayed in
    rotation, each row sent there paid a backoff or a timeout, and the least-dispatched
    tie-break sent retries back to it: 30 rows took 5 s and one failed after 7 attempts on
    the hung replica."""
    from llmdb.backends.replicas import FAILURES_OUT

    async def good(path, body):
        await asyncio.sleep(0.05)
        return 200, {}, chat_answer("ok " + body["messages"][-1]["content"])

    async def bad(path, body):
        if failing == "stall":
            await asyncio.sleep(5)
        return 500, {}, {"error": {"message": "EngineDeadError"}}

    with StubEndpoint(good) as a, StubEndpoint(bad) as b:
        backend = backends([a.url, b.url], max_concurrency=2, timeout_s=0.3)
        done = threading.Semaphore(0)
        handles = [backend.submit(GenerationRequest([{"role": "user", "content": f"r{i}"}],
                                                    SamplingParams(max_tokens=1)), done.release)
                   for i in range(30)]
        for _ in handles:
            assert done.acquire(timeout=30)
        assert [backend.collect(h).text for h in handles] == [f"ok r{i}" for i in range(30)]
        assert len(b.seen) <= FAILURES_OUT + 2, "the failing replica kept getting rows"
        assert backend.pool.replicas[1].down_until > time.monotonic()


def test_all_replicas_unreachable_is_a_clear_row_error(backends):
    dead = f"http://127.0.0.1:{free_port()}"
    result = generate(backends([dead], max_retries=1))
    assert result.finish_reason == "error"
    assert f"{dead}/v1 is unreachable" in result.error
    assert "gave up after 2 attempts" in result.error


def test_concurrency_is_bounded_per_replica(backends):
    async def slow(path, body):
        await asyncio.sleep(0.2)
        return 200, {}, chat_answer("done")

    with StubEndpoint(slow) as a, StubEndpoint(slow) as b:
        backend = backends([a.url, b.url], max_concurrency=2)
        done = threading.Semaphore(0)
        req = GenerationRequest([{"role": "user", "content": "x"}], SamplingParams(max_tokens=1))
        handles = [backend.submit(req, done.release) for _ in range(12)]
        for _ in handles:
            assert done.acquire(timeout=30)
        assert all(backend.collect(h).text == "done" for h in handles)
        assert a.most_active == 2 and b.most_active == 2
        assert len(a.seen) + len(b.seen) == 12


def _bulk_then_query(backend: OpenAIBackend, stub: StubEndpoint, bulk: int,
                     pause_s: float) -> tuple[list[str], int]:
    """`bulk` BE rows, then after pause_s one RT row ("query"): the order the stub got
    them in, once all are answered, and how many it had got when the query was sent."""
    done = threading.Semaphore(0)

    def submit(text: str, priority: str) -> str:
        req = GenerationRequest([{"role": "user", "content": text}],
                                SamplingParams(max_tokens=1), priority=priority)
        return backend.submit(req, done.release)

    handles = [submit(f"bulk {i}", "BE") for i in range(bulk)]
    time.sleep(pause_s)
    before = len(stub.seen)
    handles.append(submit("query", "RT"))
    for _ in handles:
        assert done.acquire(timeout=30)
    return [s.body["messages"][-1]["content"] for s in stub.seen], before


def test_interactive_rows_take_free_slots_before_bulk_ones(backends):
    """A query beside a bulk job does not queue behind its rows: with one slot busy and bulk
    rows waiting for it, an interactive row submitted after them is sent next."""
    async def slow(path, body):
        await asyncio.sleep(0.5)
        return 200, {}, chat_answer("done")

    with StubEndpoint(slow) as a:
        backend = backends([a.url], max_concurrency=1)
        # After 0.1 s the first bulk row holds the slot and three wait.
        order, _ = _bulk_then_query(backend, a, bulk=4, pause_s=0.1)
        assert order == ["bulk 0", "query", "bulk 1", "bulk 2", "bulk 3"]
        assert all("priority" not in s.body for s in a.seen)  # not sent unless asked


def test_send_priority_marks_bulk_rows_for_the_server(backends):
    with StubEndpoint(_script((200, {}, chat_answer("ok")))) as a:
        backend = backends([a.url], send_priority=True)
        for priority in ("BE", "RT"):
            done = threading.Event()
            req = GenerationRequest([{"role": "user", "content": priority}],
                                    SamplingParams(max_tokens=1), priority=priority)
            handle = backend.submit(req, done.set)
            assert done.wait(30) and backend.collect(handle).text == "ok"
        bodies = {s.body["messages"][-1]["content"]: s.body for s in a.seen}
        assert bodies["BE"]["priority"] == 1 and "priority" not in bodies["RT"]


def test_requests_per_minute(backends):
    with StubEndpoint(_script((200, {}, chat_answer("ok")))) as stub:
        backend = backends([stub.url], requests_per_minute=600)  # 10 a second, 10 at once
        done = threading.Semaphore(0)
        req = GenerationRequest([{"role": "user", "content": "x"}], SamplingParams(max_tokens=1))
        t0 = time.monotonic()
        handles = [backend.submit(req, done.release) for _ in range(25)]
        for _ in handles:
            assert done.acquire(timeout=30)
        # 10 go at once, the other 15 at 10 a second: no sooner than 1.5 s.
        assert time.monotonic() - t0 >= 1.4
        assert len(stub.seen) == 25


def test_interactive_rows_go_first_through_the_rate_limit(backends):
    """Bulk rows queued on a spent requests-per-minute budget do not hold a query back: it
    is sent with the next unit of budget."""
    with StubEndpoint(_script((200, {}, chat_answer("ok")))) as stub:
        backend = backends([stub.url], requests_per_minute=600)  # 10 a second, 10 at once
        # After 0.3 s about 13 are sent and the rest wait for budget (a unit per 0.1 s).
        order, before = _bulk_then_query(backend, stub, bulk=20, pause_s=0.3)
        # Besides those sent already, at most the bulk row holding the turn when the query
        # came, and one more if the query's arrival raced a refill, go before it; before,
        # it went last.
        assert before < 19 and order.index("query") <= before + 2, (before, order)


def test_rate_limit_turns_are_taken_part_by_part():
    """A bulk take larger than the bucket does not hold an interactive one back for all of
    its parts, and a take of nothing (a /tokenize call) waits for nobody."""
    from llmdb.backends.replicas import _Limiter

    async def main() -> tuple[float, float]:
        limiter = _Limiter(6000)  # 100 a second, 100 at once
        bulk = asyncio.create_task(limiter.take(600))  # six seconds' worth
        await asyncio.sleep(0.2)
        t0 = time.monotonic()
        await limiter.take(0, True)
        nothing = time.monotonic() - t0
        await limiter.take(50, True)
        query = time.monotonic() - t0
        bulk.cancel()
        return nothing, query

    nothing, query = asyncio.run(main())
    assert nothing < 0.05
    assert query < 2.0  # behind one part of the bulk take at most, not its five seconds


def test_priority_turn_handed_to_a_cancelled_taker_passes_on():
    from llmdb.backends.replicas import _PriorityTurn

    async def main() -> bool:
        turn = _PriorityTurn()
        await turn.acquire(False)
        first = asyncio.create_task(turn.acquire(True))
        second = asyncio.create_task(turn.acquire(False))
        await asyncio.sleep(0)
        turn.release()  # handed to `first`, which is cancelled before it runs
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)
        await asyncio.wait_for(second, 1)  # the turn went on to the next taker
        return first.cancelled()

    assert asyncio.run(main())


def test_priority_turn_order_and_cancellation():
    from llmdb.backends.replicas import _PriorityTurn

    async def main() -> list[str]:
        turn, got = _PriorityTurn(), []

        async def take(name: str, interactive: bool) -> None:
            await turn.acquire(interactive)
            got.append(name)
            await asyncio.sleep(0)
            turn.release()

        await turn.acquire(False)  # held: everyone below queues
        tasks = [asyncio.create_task(take(n, n.startswith("rt"))) for n in
                 ("be1", "be2", "rt1", "gone", "be3", "rt2")]
        await asyncio.sleep(0)
        tasks[3].cancel()  # a bulk taker that gives up while queued
        await asyncio.sleep(0)
        turn.release()
        await asyncio.gather(*tasks, return_exceptions=True)
        await turn.acquire(True)  # free again: taken at once
        return got

    assert asyncio.run(main()) == ["rt1", "rt2", "be1", "be2", "be3"]


def test_tokens_per_minute(backends):
    with StubEndpoint(_script((200, {}, chat_answer("ok")))) as stub:
        # 6,000 tokens a minute = 100 a second; each request is estimated at >= 100 tokens.
        backend = backends([stub.url], tokens_per_minute=6000)
        t0 = time.monotonic()
        for _ in range(3):
            assert generate(backend, "x", max_tokens=100).error is None
        assert time.monotonic() - t0 >= 1.9  # the first fills the bucket; two more wait 1 s


def test_timeout_is_retried_then_the_rows_error(backends):
    async def stall(path, body):
        await asyncio.sleep(2)
        return 200, {}, chat_answer("late")

    with StubEndpoint(stall) as stub:
        result = generate(backends([stub.url], timeout_s=0.3, max_retries=1))
    assert result.finish_reason == "error" and "did not answer in 0.3 s" in result.error
    assert len(stub.seen) == 2


def test_abort_closes_the_request(backends):
    async def stall(path, body):
        await asyncio.sleep(1)
        return 200, {}, chat_answer("late")

    with StubEndpoint(stall) as stub:
        backend = backends([stub.url])
        finished = threading.Event()
        req = GenerationRequest([{"role": "user", "content": "x"}], SamplingParams(max_tokens=1))
        handle = backend.submit(req, finished.set)
        deadline = time.monotonic() + 10
        while not stub.seen:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        backend.abort(handle)
        assert not finished.wait(1.5), "an aborted request reported a result"
        assert backend.pool.replicas[0].in_flight == 0
        with pytest.raises(RuntimeError):
            backend.collect(handle)


def test_an_endpoint_without_logprobs_fails_llm_filter_naming_it(backends):
    # A hosted chat API: answers, but without logprobs, and has no /tokenize.
    with StubEndpoint(_script((200, {}, chat_answer("yes")))) as stub:
        con = llmdb.connect(backend=backends([stub.url]), cache=False)
        with pytest.raises(llmdb.LLMError) as e:
            con.sql("SELECT llm_filter('Is water wet?')").fetchall()
    assert f"the endpoint {stub.url} returned no logprobs" in str(e.value)
    assert "llm_filter and llm_classify need" in str(e.value)


def test_an_endpoint_without_tokenize_fails_llm_classify_naming_it(backends):
    with StubEndpoint(_script((200, {}, chat_answer("yes")))) as stub:
        con = llmdb.connect(backend=backends([stub.url]), cache=False)
        with pytest.raises(llmdb.LLMError, match=f"{stub.url} does not offer"):
            con.sql("SELECT llm_classify('great', ['positive', 'negative'])").fetchall()


def test_top_logprobs_make_the_word_probabilities(backends):
    top = [{"token": "Yes", "logprob": -0.5}, {"token": " yes", "logprob": -2.0},
           {"token": "No", "logprob": -1.5}, {"token": "Maybe", "logprob": -3.0}]
    with StubEndpoint(_script((200, {}, chat_answer("Yes", top)))) as stub:
        backend = backends([stub.url])
        done = threading.Event()
        handle = backend.submit(ChoiceRequest([{"role": "user", "content": "q"}],
                                              ("yes", "no")), done.set)
        assert done.wait(30)
        result = backend.collect(handle)
    assert result.word_probs == pytest.approx((math.exp(-0.5) + math.exp(-2.0),
                                               math.exp(-1.5)))
    sent = stub.seen[0].body
    assert sent["logprobs"] is True and sent["top_logprobs"] == 20 and sent["max_tokens"] == 1


def test_a_key_read_with_a_line_break_is_sent_without_it(backends, monkeypatch):
    # A key read from a file keeps its newline; the HTTP client refused the header with an
    # error quoting it, which became every row's error.
    monkeypatch.setenv("STUB_KEY", "sk-stub-4711\n")
    with StubEndpoint(_script((200, {}, chat_answer("ok")))) as stub:
        assert generate(backends([stub.url], api_key_env="STUB_KEY")).text == "ok"
    assert stub.seen[0].headers["authorization"] == "Bearer sk-stub-4711"
    monkeypatch.setenv("STUB_KEY", "sk-stub\n4711")
    with pytest.raises(ValueError, match="STUB_KEY holds characters") as e:
        OpenAIBackend("stub-model", ["http://127.0.0.1:9/v1"], api_key_env="STUB_KEY")
    assert "4711" not in str(e.value)


def test_a_key_quoted_by_the_server_is_cut_from_errors(backends, monkeypatch):
    key = "sk-stub-quoted-0815"
    monkeypatch.setenv("STUB_KEY", key)
    quoting = {"error": {"message": f"key {key} is over its quota"}}
    with StubEndpoint(_script((401, {}, quoting))) as stub:
        backend = backends([stub.url], api_key_env="STUB_KEY")
        assert generate(backend).error.endswith("answered 401: key *** is over its quota")
        stub.handler = _script((500, {}, quoting))
        assert "key *** is over its quota" in generate(backends(
            [stub.url], api_key_env="STUB_KEY", max_retries=0)).error
        stub.handler = _script((200, {}, {"choices": f"not a list but {key}"}))
        assert generate(backend).error.endswith("answered without choices: "
                                            "{'choices': 'not a list but ***'}")
        con = llmdb.connect(backend=backend, cache=False)
        with pytest.raises(llmdb.LLMError) as e:
            con.sql("SELECT llm_complete('hi')").fetchall()
        assert key not in "".join(traceback.format_exception(e.value))


def _answer_with(**fields) -> dict:
    """chat_answer("x") with fields of its first choice (or, as usage=, its usage) set."""
    answer = chat_answer("x")
    if "usage" in fields:
        answer["usage"] = fields.pop("usage")
    answer["choices"][0].update(fields)
    return answer


@pytest.mark.parametrize(("answer", "error"), [
    ({"choices": []}, "answered without choices"),
    ([1, 2], "answered without choices"),
    ({"choices": [None]}, "answered with a choice that is not an object"),
    # /v1/completions' shape: it was read as an empty answer
    ({"choices": [{"index": 0, "text": "hello", "finish_reason": "stop"}]},
     "answered a choice without a message"),
    (_answer_with(message={"role": "assistant", "content": ["a", "b"]}),
     "answered a message whose content is a list, not text"),
])
def test_a_malformed_answer_is_the_rows_error_naming_the_replica(backends, answer, error):
    with StubEndpoint(_script((200, {}, answer))) as stub:
        result = generate(backends([stub.url]))
    assert result.finish_reason == "error"
    assert result.error.startswith(f"http://127.0.0.1:{stub.port}/v1/chat/completions {error}")


def test_what_an_answer_may_leave_out(backends):
    """Usage counts that are not numbers count 0 (they failed the whole query, under
    on_error='null' too); a message with null content (a reasoning model that spent
    max_tokens thinking) is an empty answer."""
    odd_usage = _answer_with(usage={"prompt_tokens": None, "completion_tokens": "2",
                                    "prompt_tokens_details": None})
    with StubEndpoint(_script((200, {}, odd_usage))) as stub:
        backend = backends([stub.url])
        con = llmdb.connect(backend=backend, cache=False, on_error="null")
        assert con.sql("SELECT llm_complete('hi', max_tokens := 4)").fetchall() == [("x",)]
        stub.handler = _script((200, {}, _answer_with(
            message={"role": "assistant", "content": None}, finish_reason="length")))
        result = generate(backend)
    assert (result.text, result.finish_reason, result.error) == ("", "length", None)


@pytest.mark.parametrize(("logprobs", "error"), [
    ({"content": [{"token": "Yes", "logprob": -1,
                   "top_logprobs": [{"token": "Yes", "logprob": "high"}]}]},
     "a top_logprobs entry that is not a token and its logprob"),
    ({"content": [{"token": "Yes", "logprob": -1,
                   "top_logprobs": [{"token": "Yes", "logprob": 1000.0}]}]},  # (exp overflowed)
     "a top_logprobs entry that is not a token and its logprob"),
    ({"content": {"Yes": -1}}, "logprobs whose content is not a list of tokens"),
])
def test_malformed_logprobs_are_the_rows_error_naming_the_replica(backends, logprobs, error):
    with StubEndpoint(_script((200, {}, _answer_with(logprobs=logprobs)))) as stub:
        backend = backends([stub.url])
        done = threading.Event()
        handle = backend.submit(ChoiceRequest([{"role": "user", "content": "q"}], ("yes",)),
                                done.set)
        assert done.wait(30)
        result = backend.collect(handle)
    assert result.error.startswith(
        f"http://127.0.0.1:{stub.port}/v1/chat/completions answered {error}")


def test_an_answer_the_client_cannot_decode_names_the_replica(backends):
    # A body that says it is gzip and is not: httpx's DecodingError escaped as a bare
    # exception, naming no endpoint.
    with StubEndpoint(_script((200, {"Content-Encoding": "gzip"}, chat_answer("x")))) as stub:
        result = generate(backends([stub.url]))
    assert result.error.startswith(f"http://127.0.0.1:{stub.port}/v1/chat/completions failed: "
                                   "DecodingError")


def test_a_redirect_names_where_it_leads(backends):
    # (An http -> https proxy; not followed: the key would go on to wherever it points.)
    moved = (308, {"Location": "https://example.com/v1/chat/completions"}, {})
    with StubEndpoint(_script(moved)) as stub:
        result = generate(backends([stub.url]))
    assert result.error == (f"http://127.0.0.1:{stub.port}/v1/chat/completions answered 308: "
                            "a redirect to https://example.com/v1/chat/completions; give the "
                            "URL it redirects to as the endpoint")


def test_answers_and_texts_are_tokenized_at_once(backends):
    """/tokenize is one round trip per text: the planner counts every llm_complete answer's
    tokens after its query (for EXPLAIN's output lengths), and llm_count_tokens every row's.
    They were asked one after another, a round trip per row (to a server 50 ms away, 50 s
    per 1,000 rows); now they go out together, as the rows' own requests do."""
    busy = {"now": 0, "most": 0}

    async def handler(path, body):
        if path != "/tokenize":
            return 200, {}, chat_answer(f"answer to {body['messages'][-1]['content']}")
        busy["now"] += 1
        busy["most"] = max(busy["most"], busy["now"])
        await asyncio.sleep(0.1)
        busy["now"] -= 1
        return 200, {}, {"count": 0, "tokens": list(range(len(body["prompt"].split())))}

    with StubEndpoint(handler, tokenize=True) as stub:
        con = llmdb.connect(backend=backends([stub.url], max_concurrency=8), cache=False)
        con.execute("CREATE TABLE t AS SELECT repeat('w ', i::INT) AS x FROM range(1, 13) r(i)")
        assert con.sql("SELECT llm_count_tokens(x) FROM t ORDER BY x").fetchall() == \
            [(i,) for i in range(1, 13)]
        assert busy["most"] == 8, "llm_count_tokens asked its rows one by one"
        busy["most"] = 0
        assert len(con.sql("SELECT llm_complete(x) FROM t").fetchall()) == 12
        counted = [s.body["prompt"] for s in stub.seen if s.path == "/tokenize"]
        assert sorted(counted[12:]) == sorted(f"answer to {'w ' * i}" for i in range(1, 13))
        assert busy["most"] == 8, "the answers' tokens were counted one by one"


def test_an_answer_trickling_in_past_timeout_s_is_timed_out(backends):
    """timeout_s bounds the whole request: httpx's own timeout is per read, so an answer
    sent a byte at a time (a proxy's keep-alive padding, a wedged server) never ran out."""
    from starlette.responses import StreamingResponse

    async def trickle():
        for _ in range(30):
            yield b" "
            await asyncio.sleep(0.1)
        yield json.dumps(chat_answer("late")).encode()

    async def handler(path, body):
        return 200, {}, StreamingResponse(trickle(), media_type="application/json")

    with StubEndpoint(handler) as stub:
        t0 = time.monotonic()
        result = generate(backends([stub.url], timeout_s=0.5, max_retries=0))
    assert result.error == f"{stub.url} did not answer in 0.5 s (TimeoutError) (gave up " \
        "after 1 attempts)"
    assert time.monotonic() - t0 < 2


def test_an_answer_over_the_size_limit_is_the_rows_error(backends, monkeypatch):
    """A broken server's endless answer is cut off (it filled memory, and 200 MB of text to
    a max_tokens=4 request became the row's answer); a gzipped answer is measured and read
    decoded, as hosted APIs send it."""
    from starlette.responses import Response

    from llmdb.backends import replicas

    monkeypatch.setattr(replicas, "MAX_ANSWER_BYTES", 100_000)
    answer = json.dumps(chat_answer("x" * 60_000)).encode()

    async def handler(path, body):
        return 200, {}, Response(gzip.compress(answer), media_type="application/json",
                                 headers={"Content-Encoding": "gzip"})

    with StubEndpoint(handler) as stub:
        backend = backends([stub.url])
        assert generate(backend).text == "x" * 60_000
        answer = json.dumps(chat_answer("x" * 120_000)).encode()  # 1 kB gzipped
        assert generate(backend).error == (f"http://127.0.0.1:{stub.port}/v1/chat/completions "
                                       "answered with more than 100,000 bytes")


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl to make a certificate")
def test_a_certificate_that_fails_verification_is_not_retried(backends, tmp_path, monkeypatch):
    """No retry mends a certificate signed by an unknown CA: each row tried 7 times over
    16 s (20 rows: 19 s, 140 TLS handshakes) before failing. SSL_CERT_FILE trusts it."""
    cert, key = self_signed_certificate(tmp_path)
    with StubEndpoint(_script((200, {}, chat_answer("over TLS"))), tls=(cert, key)) as stub:
        t0 = time.monotonic()
        result = generate(backends([stub.url]))
        assert time.monotonic() - t0 < 5
        assert result.error.startswith(f"{stub.url} is unreachable (ConnectError: [SSL: "
                                       "CERTIFICATE_VERIFY_FAILED]")
        assert result.error.endswith("(its certificate failed verification: for a private "
                                     "CA, set SSL_CERT_FILE to its certificate)")
        monkeypatch.setenv("SSL_CERT_FILE", cert)
        trusting = backends([stub.url])
        assert generate(trusting).text == "over TLS"
        trusting.close()  # (its idle TLS connection held the stub's shutdown for 10 s)


def test_a_spent_quota_is_not_retried(backends):
    # OpenAI's 429 once credits or the monthly budget are spent: each row was retried six
    # times over about 30 s (max_backoff_s), the quota as spent at the end as at the start.
    spent = {"error": {"message": "You exceeded your current quota, please check your plan "
                                  "and billing details.", "type": "insufficient_quota",
                       "code": "insufficient_quota"}}
    with StubEndpoint(_script((429, {}, spent))) as stub:
        result = generate(backends([stub.url]))
    assert result.error == (f"http://127.0.0.1:{stub.port}/v1/chat/completions answered 429: "
                            "You exceeded your current quota, please check your plan and "
                            "billing details.")
    assert len(stub.seen) == 1
