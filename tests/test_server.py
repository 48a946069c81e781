"""`llmdb serve` through the official openai client, on the bundled model.

The server runs in-process under uvicorn on a free loopback port; its answers must equal the
engine's own for the same request, streams must add up to the same text, errors must come in
OpenAI's shape with the right status, and a client that goes away must leave no request
running and no block held.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

openai = pytest.importorskip("openai", reason="the openai client is not installed")
uvicorn = pytest.importorskip("uvicorn", reason="uvicorn is not installed")

from llmdb.engine.engine import LLMEngine  # noqa: E402
from llmdb.engine.params import SamplingParams  # noqa: E402
from llmdb.server.app import Limits, create_app  # noqa: E402
from llmdb.server.run import uvicorn_server  # noqa: E402

KEY = "test-key-123"
MODEL = "smollm2-135m"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Server:
    def __init__(self, engine: LLMEngine, **kw):
        self.port = _free_port()
        app = create_app(engine, MODEL, **kw)
        self.server = uvicorn_server(app, "127.0.0.1", self.port, log_level="warning")
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLMEngine(MODEL, dtype="float32")


@pytest.fixture(scope="module")
def server(engine):
    srv = _Server(engine, api_key=KEY, limits=Limits(max_tokens=512, max_concurrent=64))
    yield srv
    srv.stop()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


def _idle(engine: LLMEngine, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while engine.has_unfinished or engine.pool.num_free != engine.pool.num_blocks:
        assert time.monotonic() < deadline, "requests still run or blocks are still held"
        time.sleep(0.05)


def _logits_job_under_way(engine: LLMEngine, timeout: float = 30.0):
    """The engine's one logits request (a prompt_logprobs request's), once it has computed
    some of its tokens."""
    deadline = time.monotonic() + timeout
    while not (jobs := [r for r in list(engine._requests.values())
                        if r.keep_logits and r.num_computed > 0]):
        assert time.monotonic() < deadline, "the logits job never started"
        time.sleep(0.01)
    [job] = jobs
    return job


def test_models_and_health(client, server):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}


def test_completion_equals_the_engine(client, engine):
    prompt = "The capital of France is"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    want = engine.generate([prompt], SamplingParams(max_tokens=12))[0]
    assert r.choices[0].text == want.text
    assert r.usage.completion_tokens == len(want.token_ids)
    assert r.usage.prompt_tokens == want.usage.prompt_tokens
    assert r.choices[0].finish_reason in ("stop", "length")


def test_chat_equals_the_engine_and_streams_the_same_text(client, engine):
    messages = [{"role": "system", "content": "Answer briefly."},
                {"role": "user", "content": "Name a fruit that is yellow."}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20,
                                       temperature=0)
    want = engine.generate([messages], SamplingParams(max_tokens=20))[0]
    assert r.choices[0].message.content == want.text
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20,
                                            temperature=0, stream=True)
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.text
    assert chunks[-1].choices[0].finish_reason == r.choices[0].finish_reason


def test_chat_template_options_shape_the_prompt(client, server, engine):
    """vLLM's chat options: continue_final_message goes on from the assistant's start (the
    answer is what the engine generates after exactly those ids), chat_template_kwargs reach
    the template, and their misuse is a 400 naming it, not a 500 or an option ignored."""
    tok = engine.tokenizer
    start = [{"role": "user", "content": "Name a fruit that is yellow."},
             {"role": "assistant", "content": "A yellow fruit is the"}]
    r = client.chat.completions.create(
        model=MODEL, messages=start, max_tokens=8, temperature=0,
        extra_body={"continue_final_message": True, "add_generation_prompt": False})
    ids = tok.encode_chat(start, add_generation_prompt=False, continue_final=True)
    assert tok.decode(ids, skip_special=False).endswith("<|im_start|>assistant\nA yellow "
                                                       "fruit is the")
    want = engine.generate([ids], SamplingParams(max_tokens=8))[0]
    assert r.choices[0].message.content == want.text
    assert r.usage.prompt_tokens == len(ids)
    url, auth = server.url + "/tokenize", {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(url, headers=auth, json={"messages": start, "add_generation_prompt": False,
                                            "continue_final_message": True})
    assert r.json()["tokens"] == ids
    r = httpx.post(url, headers=auth, json={"messages": start[:1],
                                            "chat_template_kwargs": {"extra": 1}})
    assert r.json()["tokens"] == tok.encode_chat(start[:1])  # (a variable it does not read)
    for body, cause in [
        ({"messages": start, "continue_final_message": True}, "cannot both be true"),
        ({"messages": start[:1], "continue_final_message": True,
          "add_generation_prompt": False}, "assistant message last"),
        ({"messages": start[:1], "chat_template_kwargs": {"messages": []}},
         "'messages' is set by the server")]:
        r = httpx.post(server.url + "/v1/chat/completions", headers=auth,
                       json={"model": MODEL, "max_tokens": 2, **body})
        assert r.status_code == 400 and cause in r.json()["error"]["message"], r.text


def test_stop_strings_never_reach_the_stream(client):
    kw = {"model": MODEL, "prompt": "Count: 1, 2, 3, 4, 5,", "max_tokens": 30,
          "temperature": 0, "stop": [" 7"]}
    full = client.completions.create(**kw).choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(**kw, stream=True))
    assert streamed == full and " 7" not in full


def test_stream_usage_comes_as_openai_sends_it(client):
    """A stream's usage comes only when stream_options.include_usage asks for it, in a
    chunk of its own with no choices after the one that finishes, as OpenAI and vLLM send it
    (clients that read chunk.usage as "the stream is over" would lose that chunk's text)."""
    kw = {"model": MODEL, "max_tokens": 4, "temperature": 0, "stream": True,
          "extra_body": {"ignore_eos": True}}
    for create, request in ((client.completions.create, {"prompt": "Hi"}),
                            (client.chat.completions.create,
                             {"messages": [{"role": "user", "content": "Hi"}]})):
        *body, last = create(stream_options={"include_usage": True}, **request, **kw)
        assert last.choices == [] and last.usage.completion_tokens == 4
        assert body[-1].choices[0].finish_reason == "length"
        assert all(c.usage is None for c in body)
        plain = list(create(**request, **kw))
        assert plain[-1].choices[0].finish_reason == "length"
        assert all(c.usage is None for c in plain)


def test_logprobs(client):
    r = client.chat.completions.create(model=MODEL, max_tokens=4, temperature=0, logprobs=True,
                                       top_logprobs=3,
                                       messages=[{"role": "user", "content": "Hi"}])
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for item in content:
        assert item.logprob <= 0 and len(item.top_logprobs) == 3
        # Greedy: the chosen token is the most likely one.
        assert item.logprob == pytest.approx(max(t.logprob for t in item.top_logprobs))


def test_completion_top_logprobs_hold_the_sampled_token(client, engine):
    """OpenAI and vLLM put the sampled token in its position's top_logprobs even when it is
    not among the k most likely (k + 1 entries then). Sampled hot with a seed, some tokens
    fall outside the top 1; every entry is the engine's own log-probability, whole answer
    and stream alike."""
    prompt, n = "Once upon a time", 16
    want = engine.generate([prompt], SamplingParams(max_tokens=n, temperature=2.0, seed=3,
                                                    logprobs=1, ignore_eos=True))[0]
    text = engine.tokenizer.token_text
    expected = [{text(t): v for t, v in top.items()} | {text(tok): lp}
                for tok, (lp, top) in zip(want.token_ids, want.logprobs, strict=True)]
    assert sum(tok not in top for tok, (_, top) in zip(want.token_ids, want.logprobs,
                                                        strict=True)) >= 3
    kw = {"model": MODEL, "prompt": prompt, "max_tokens": n, "temperature": 2.0, "seed": 3,
          "logprobs": 1, "extra_body": {"ignore_eos": True}}
    whole = client.completions.create(**kw).choices[0].logprobs
    streamed = [c.choices[0].logprobs for c in client.completions.create(**kw, stream=True)
                if c.choices and c.choices[0].logprobs]
    for got in (whole.top_logprobs, [x for p in streamed for x in p.top_logprobs]):
        assert [set(x) for x in got] == [set(x) for x in expected]
        assert got == [pytest.approx(x) for x in expected]
    assert whole.token_logprobs == pytest.approx([lp for lp, _ in want.logprobs])


def test_chat_logprobs_have_openais_shape(server, engine):
    """content[i]: token, logprob, bytes (its UTF-8 bytes) and top_logprobs, a list of
    exactly top_logprobs {token, logprob, bytes}: the sampled token is not added (OpenAI's
    chat API keeps it to k). Sampled hot, so some tokens fall outside the top 2."""
    messages = [{"role": "user", "content": "Tell me a story."}]
    want = engine.generate([messages], SamplingParams(max_tokens=12, temperature=2.0, seed=5,
                                                      logprobs=2, ignore_eos=True))[0]
    assert any(tok not in top for tok, (_, top) in zip(want.token_ids, want.logprobs,
                                                        strict=True))
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                   headers={"Authorization": f"Bearer {KEY}"},
                   json={"model": MODEL, "messages": messages, "max_tokens": 12,
                         "temperature": 2.0, "seed": 5, "logprobs": True, "top_logprobs": 2,
                         "ignore_eos": True})
    content = r.json()["choices"][0]["logprobs"]["content"]
    text = engine.tokenizer.token_text
    assert len(content) == len(want.token_ids)
    for item, (lp, top) in zip(content, want.logprobs, strict=True):
        assert set(item) == {"token", "logprob", "bytes", "top_logprobs"}
        assert item["bytes"] == list(item["token"].encode())
        assert item["logprob"] == pytest.approx(lp)
        assert item["top_logprobs"] == [
            {"token": text(t), "logprob": pytest.approx(v), "bytes": list(text(t).encode())}
            for t, v in top.items()]


def test_seeded_sampling_is_reproducible(client):
    kw = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 16, "temperature": 1.0,
          "seed": 7}
    a = client.completions.create(**kw).choices[0].text
    assert client.completions.create(**kw).choices[0].text == a


def test_errors_in_openai_shape(client, server):
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", max_tokens=100_000)
    assert e.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", temperature=7)
    assert "temperature" in e.value.message
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-17", prompt="x")
    r = httpx.post(server.url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                   content=b"{" + b" " * (2 << 20) + b"}")
    assert r.status_code == 413 and r.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                   content=b"not json")
    assert r.status_code == 400 and "error" in r.json()


def test_disconnect_mid_stream_aborts_and_frees_blocks(server, engine):
    body = {"model": MODEL, "prompt": "Write a long story about a dragon.", "max_tokens": 400,
            "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body,
                      headers={"Authorization": f"Bearer {KEY}"}, timeout=30) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
    assert any(line.startswith("data: ") for line in got)
    _idle(engine)
    assert engine.tokens_generated < 400 + 200  # it did not run to its end


def test_a_queued_stream_whose_client_leaves_never_runs(server, engine):
    """A stream still waiting for its turn (no token yet) whose client leaves is aborted
    there: it never takes a place in the batch nor computes a prompt token, and its blocks
    are free, while the request ahead of it runs on. (Starlette's StreamingResponse listens
    on the receive channel for the disconnect with servers of ASGI spec < 2.4, uvicorn 0.54's
    2.3; from 2.4 it would notice only a failed send, at the first token.)"""
    from llmdb.engine.sched.request import Status

    auth = {"Authorization": f"Bearer {KEY}"}
    ahead = {"model": MODEL, "prompt": "Write a long story about a dragon.", "max_tokens": 400,
             "temperature": 0, "ignore_eos": True, "stream": True}
    queued = {**ahead, "prompt": "Write a long story about an owl."}
    ids = engine.encode_prompt(queued["prompt"])
    sched = engine.scheduler
    saved = sched.max_num_seqs
    sched.max_num_seqs = 1  # one request runs at a time: the second waits
    try:
        with httpx.stream("POST", server.url + "/v1/completions", json=ahead, headers=auth,
                          timeout=30) as running:
            lines = running.iter_lines()
            [next(lines) for _ in range(4)]  # its tokens come: it holds the one place
            [first] = [r for r in engine._requests.values() if r.status is Status.RUNNING]
            with httpx.stream("POST", server.url + "/v1/completions", json=queued,
                              headers=auth, timeout=30) as r:
                assert next(r.iter_lines()).startswith("data: ")  # its opening chunk only
                deadline = time.monotonic() + 10
                while not (jobs := [q for q in list(engine._requests.values())
                                    if q.prompt_ids == ids]):
                    assert time.monotonic() < deadline, "the second request was not queued"
                    time.sleep(0.01)
                [job] = jobs
                assert job.status is Status.WAITING
            deadline = time.monotonic() + 10
            while job.finish_reason is None:
                assert time.monotonic() < deadline, "the departed client's request still waits"
                time.sleep(0.02)
            assert first.finish_reason is None, "it was aborted only once the first ended"
        assert job.finish_reason == "abort" and job.num_computed == 0
    finally:
        sched.max_num_seqs = saved
    _idle(engine)


def test_clients_that_leave_together_end_together(server, engine, monkeypatch):
    """engine.abort waits for the step under way to end. Called on the event loop, it held
    up every other request, one step per client that left (40 streams dropped together:
    /health took 14 s); awaited from a thread pool, the aborts queued behind the pool's
    threads were dropped when the handlers were cancelled, their requests left running.
    Here every abort is held until all have begun and /health has answered."""
    leaving = 8  # more than the default thread pool's threads on a machine of 1 to 3 cores
    held, begun = threading.Event(), threading.Semaphore(0)
    abort = engine.abort

    def held_abort(request_id: str) -> None:
        begun.release()
        held.wait(60)
        abort(request_id)

    def leave(i: int) -> None:
        body = {"model": MODEL, "prompt": f"Write a long story about dragon {i}.",
                "max_tokens": 400, "temperature": 0, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body,
                          headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as r:
            lines = r.iter_lines()
            [next(lines) for _ in range(3)]

    monkeypatch.setattr(engine, "abort", held_abort)
    try:
        with ThreadPoolExecutor(leaving) as pool:
            list(pool.map(leave, range(leaving)))
        for _ in range(leaving):
            assert begun.acquire(timeout=30), "a request of a client that left was not aborted"
        assert httpx.get(server.url + "/health", timeout=5).json() == {"status": "ok"}
    finally:
        held.set()
    _idle(engine, timeout=30)


def test_metrics(server, client):
    client.completions.create(model=MODEL, prompt="Hello", max_tokens=3)
    text = httpx.get(server.url + "/metrics").text
    for name in ("llmdb_requests_running", "llmdb_requests_waiting", "llmdb_blocks_in_use",
                 "llmdb_generated_tokens_total", "llmdb_generation_tokens_per_second"):
        assert name in text


def test_concurrency_limit_answers_429(engine):
    srv = _Server(engine, api_key=None, limits=Limits(max_concurrent=1))
    try:
        body = {"prompt": "Tell me everything.", "max_tokens": 200, "ignore_eos": True,
                "stream": True}
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=30) as r:
            lines = r.iter_lines()  # held: a dropped iterator closes the connection
            next(lines)
            second = httpx.post(srv.url + "/v1/completions", json={"prompt": "Hi"}, timeout=30)
            # Prompt log-probabilities (seconds of work for a long prompt) wait for a slot too.
            third = httpx.post(srv.url + "/v1/completions", timeout=30, json={
                "prompt": "word " * 400, "max_tokens": 1, "prompt_logprobs": 1})
        assert second.status_code == 429
        assert second.json()["error"]["type"] == "rate_limit_error"
        assert second.headers["retry-after"] == "1"
        assert third.status_code == 429
    finally:
        srv.stop()
    _idle(engine)


def test_shutdown_aborts_what_does_not_finish_in_time(engine):
    srv = _Server(engine, api_key=None, shutdown_timeout_s=0.5)
    body = {"prompt": "Write a very long essay.", "max_tokens": 500, "ignore_eos": True}
    result = {}

    def call():
        result["r"] = httpx.post(srv.url + "/v1/completions", json=body, timeout=60)

    t = threading.Thread(target=call)
    t.start()
    deadline = time.monotonic() + 20
    while not engine.has_unfinished:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    srv.stop()
    t.join(30)
    r = result["r"]  # a retryable answer, not a partial text under a non-OpenAI reason
    assert r.status_code == 503 and "retry" in r.json()["error"]["message"]
    _idle(engine)


def test_shutdown_aborts_prompt_logprobs_still_being_computed(engine):
    """Prompt log-probabilities are a request like any other to shutdown: once the grace time
    is over their logits job is aborted mid-way and the caller gets a retryable 503."""
    sched = engine.scheduler
    saved = sched.max_num_batched_tokens
    sched.max_num_batched_tokens = 64  # a job of many short steps: shutdown lands mid-way
    prompt = "verse " * 1000
    n = len(engine.encode_prompt(prompt))
    srv = _Server(engine, api_key=None, shutdown_timeout_s=0.5)
    result = {}

    def call():
        result["r"] = httpx.post(srv.url + "/v1/completions", timeout=60, json={
            "prompt": prompt, "max_tokens": 1, "prompt_logprobs": 1})

    t = threading.Thread(target=call)
    t.start()
    try:
        job = _logits_job_under_way(engine)
    finally:
        srv.stop()
        t.join(30)
        sched.max_num_batched_tokens = saved
    assert not t.is_alive(), "no answer: shutdown waited for the whole logits job"
    r = result["r"]
    assert r.status_code == 503 and "retry" in r.json()["error"]["message"]
    assert job.finish_reason == "abort" and job.num_computed < n
    _idle(engine)


def test_api_key_rules(monkeypatch):
    from llmdb.server.run import api_key_for, is_loopback

    assert is_loopback("127.0.0.1") and is_loopback("localhost") and not is_loopback("0.0.0.0")
    assert api_key_for("127.0.0.1", "LLMDB_TEST_KEY", no_auth=True) is None
    with pytest.raises(ValueError, match="loopback"):
        api_key_for("0.0.0.0", "LLMDB_TEST_KEY", no_auth=True)
    monkeypatch.delenv("LLMDB_TEST_KEY", raising=False)
    with pytest.raises(ValueError, match="LLMDB_TEST_KEY"):
        api_key_for("0.0.0.0", "LLMDB_TEST_KEY", no_auth=False)
    monkeypatch.setenv("LLMDB_TEST_KEY", "k")
    assert api_key_for("0.0.0.0", "LLMDB_TEST_KEY", no_auth=False) == "k"


def test_serve_fails_at_once_on_a_taken_port(monkeypatch, capsys):
    """`llmdb serve` on a port another server holds says so, naming host:port, before it
    loads the model (a user waited for the load, then got uvicorn's bind error)."""
    from llmdb import cli
    from llmdb.engine import engine as engine_module

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(engine_module, "LLMEngine", refuse)
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        assert cli.main(["serve", "--no-auth", "--host", "127.0.0.1", "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert f"127.0.0.1:{port}" in err and "in use" in err, err


def test_serve_answers_on_the_port_it_bound_first(engine, monkeypatch):
    """serve() takes its port before the model loads (no other server can take it during
    the load, even one that reuses addresses as uvicorn does) and uvicorn serves on it."""
    from llmdb.engine import engine as engine_module
    from llmdb.server import run

    def load(*args, **kwargs) -> LLMEngine:
        with socket.socket() as other:
            other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            with pytest.raises(OSError):
                other.bind(("127.0.0.1", port))
                other.listen()
        return engine

    servers = []
    make = run.uvicorn_server
    monkeypatch.setattr(engine_module, "LLMEngine", load)
    monkeypatch.setattr(run, "uvicorn_server", lambda *a, **k: servers.append(make(*a, **k))
                        or servers[-1])
    port = _free_port()
    thread = threading.Thread(target=run.serve, daemon=True, args=(
        MODEL, "127.0.0.1", port, None, Limits(), 1.0))
    thread.start()
    deadline = time.monotonic() + 30
    while not (servers and servers[0].started):
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.02)
    try:
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                       json={"prompt": "Hello", "max_tokens": 3, "temperature": 0})
        want = engine.generate(["Hello"], SamplingParams(max_tokens=3))[0]
        assert r.json()["choices"][0]["text"] == want.text
    finally:
        if servers:
            servers[0].should_exit = True
        thread.join(30)
    _idle(engine)


def test_prompt_logprobs_equal_the_engine_scores(client, engine):
    prompt = "The quick brown fox jumps over the lazy dog"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1,
                                  extra_body={"prompt_logprobs": 2})
    got = r.choices[0].model_extra["prompt_logprobs"]
    ids = engine.encode_prompt(prompt)
    assert got[0] is None and len(got) == len(ids)
    scores = engine.score(ids[:1], [ids[1:]])  # log-likelihood of the rest of the prompt
    total = sum(entry[str(tok)]["logprob"] for entry, tok in zip(got[1:], ids[1:], strict=True))
    assert total == pytest.approx(scores[0], abs=1e-3)
    assert all(len(entry) in (2, 3) for entry in got[1:])  # its token and the top 2


def test_a_failed_prompt_logprobs_step_is_answered_in_openai_shape(client, engine,
                                                                   monkeypatch):
    """The engine fails a request whose step raised; the server says so as it does for a
    completion (500, OpenAI's error body), not with its framework's bare error page."""
    launch = engine.runner.launch

    def failing(*args, **kwargs):
        monkeypatch.setattr(engine.runner, "launch", launch)  # this step only
        raise RuntimeError("injected step failure")

    _idle(engine)
    monkeypatch.setattr(engine.runner, "launch", failing)
    with pytest.raises(openai.InternalServerError) as e:
        client.completions.create(model=MODEL, prompt="The sky is", max_tokens=1,
                                  extra_body={"prompt_logprobs": 1})
    error = e.value.body
    assert error["type"] == "server_error"
    assert "prompt log-probabilities failed" in error["message"]
    assert "injected step failure" in error["message"]
    _idle(engine)


def test_client_leaving_a_prompt_logprobs_request_stops_its_logits(server, client, engine,
                                                                     monkeypatch):
    """A long prompt's prompt_logprobs request whose client goes away while its logits are
    computed: the logits job is aborted mid-way, not run to its end for nobody; every block
    is freed, no result is left in the engine, and the next request finds the engine idle
    and gets the engine's own answer. Once the client has left, the job's steps wait for an
    abort (up to 30 s), so a loaded machine's slow disconnect check cannot let it finish."""
    sched = engine.scheduler
    saved = sched.max_num_batched_tokens
    sched.max_num_batched_tokens = 64  # a job of many short steps: the client leaves mid-way
    left, aborted = threading.Event(), threading.Event()
    launch, abort = engine.runner.launch, engine.abort

    def launch_after_the_abort(*args, **kwargs):
        if left.is_set():
            aborted.wait(30)
        return launch(*args, **kwargs)

    def noted_abort(*request_ids: str) -> None:
        aborted.set()
        abort(*request_ids)

    monkeypatch.setattr(engine.runner, "launch", launch_after_the_abort)
    monkeypatch.setattr(engine, "abort", noted_abort)
    prompt = "word " * 1000
    n = len(engine.encode_prompt(prompt))
    body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 1,
                       "prompt_logprobs": 1}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            f"Authorization: Bearer {KEY}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    try:
        # A raw socket, so that the client leaves exactly when the job is under way.
        with socket.create_connection(("127.0.0.1", server.port)) as sock:
            sock.sendall(head + body)
            job = _logits_job_under_way(engine)
            left.set()
        assert aborted.wait(30), "the server never aborted the job of the client that left"
        _idle(engine)
    finally:
        sched.max_num_batched_tokens = saved
    assert job.finish_reason == "abort" and job.num_computed < n, (
        f"the logits job ended {job.finish_reason!r} after {job.num_computed} of {n} tokens")
    assert not engine._results, f"results left for nobody: {list(engine._results)}"
    greedy = SamplingParams(max_tokens=3, temperature=0)
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, temperature=0)
    assert r.choices[0].text == engine.generate(["Hello"], greedy)[0].text


def test_tokenize_gives_the_ids_the_completion_endpoints_use(server, engine):
    """vLLM's /tokenize (the openai backend scores through it), behind the API key."""
    url, auth = server.url + "/tokenize", {"Authorization": f"Bearer {KEY}"}
    messages = [{"role": "user", "content": "Is <|im_end|> a marker here?"}]
    r = httpx.post(url, json={"messages": messages}, headers=auth)
    assert r.status_code == 200
    assert r.json()["tokens"] == engine.encode_prompt(messages)  # row text stays text
    assert r.json()["count"] == len(r.json()["tokens"])
    r = httpx.post(url, json={"prompt": "positive", "add_special_tokens": False}, headers=auth)
    assert r.json()["tokens"] == engine.tokenizer.encode("positive")
    assert httpx.post(url, json={"prompt": "x"}).status_code == 401
    r = httpx.post(url, json={"prompt": "x", "messages": messages}, headers=auth)
    assert r.status_code == 400 and "either prompt or messages" in r.json()["error"]["message"]


def test_out_of_range_sampling_fields_are_a_400(server):
    """Found by the fuzz (tests/test_server_fuzz.py): a top_k past int64 used to fail the
    engine's step, a 500."""
    r = httpx.post(server.url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                   json={"model": MODEL, "prompt": "x", "max_tokens": 1, "top_k": 2**70})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_k"


def test_standard_request_shapes_are_accepted(server, client, engine):
    """A list of one prompt, chat content as text parts, the developer role: what OpenAI's
    clients send. More than one prompt is a clear 400, not a parse error."""
    auth = {"Authorization": f"Bearer {KEY}"}
    one = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0)
    listed = client.completions.create(model=MODEL, prompt=["Hello"], max_tokens=4,
                                       temperature=0)
    assert listed.choices[0].text == one.choices[0].text
    r = httpx.post(server.url + "/v1/completions", headers=auth,
                   json={"prompt": ["a", "b"], "max_tokens": 1})
    assert r.status_code == 400 and "one prompt per request" in r.json()["error"]["message"]
    plain = client.chat.completions.create(model=MODEL, max_tokens=4, temperature=0, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi\nthere"}])
    parts = client.chat.completions.create(model=MODEL, max_tokens=4, temperature=0, messages=[
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi"},
                                     {"type": "text", "text": "there"}]}])
    assert parts.choices[0].message.content == plain.choices[0].message.content


def test_null_options_take_their_defaults(server):
    """OpenAI's API (and vLLM's) reads an optional field sent as null as one not sent, and
    clients send them so ("temperature": null): the answer is the default's, not a 400. A
    required field sent as null is still a 400 naming it."""
    url, auth = server.url, {"Authorization": f"Bearer {KEY}"}
    nulls = dict.fromkeys(["temperature", "top_p", "top_k", "n", "stream", "priority",
                           "ignore_eos", "max_tokens", "stop", "stream_options"])
    for path, request in (("/v1/completions", {"prompt": "Once upon a time"}),
                          ("/v1/chat/completions", {"messages": [
                              {"role": "user", "content": "Name a cat."}], "logprobs": None,
                              "add_generation_prompt": None})):
        body = {**request, "max_completion_tokens": 6, "seed": 11}
        want = httpx.post(url + path, headers=auth, json=body, timeout=60)
        got = httpx.post(url + path, headers=auth, json={**body, **nulls}, timeout=60)
        assert got.status_code == 200, got.text
        assert got.json()["choices"] == want.json()["choices"]
    r = httpx.post(url + "/v1/completions", headers=auth, json={"prompt": None})
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("prompt")


@pytest.mark.parametrize("field,value", [
    ("presence_penalty", 0.5), ("frequency_penalty", 1.0), ("logit_bias", {"5": 10}),
    ("echo", True), ("best_of", 2), ("suffix", "!"), ("min_tokens", 3),
    ("response_format", {"type": "json_object"})])
def test_options_not_implemented_are_refused_not_ignored(server, field, value):
    auth = {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(server.url + "/v1/completions", headers=auth,
                   json={"prompt": "x", "max_tokens": 1, field: value})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field and "not supported" in r.json()["error"]["message"]


def test_option_rules(server):
    """Defaults of unimplemented options pass; top_logprobs needs logprobs; an unknown path
    answers in OpenAI's shape; the Authorization scheme is Bearer, in any case."""
    url, auth = server.url, {"Authorization": f"Bearer {KEY}"}
    ok = httpx.post(url + "/v1/completions", headers=auth, json={
        "prompt": "x", "max_tokens": 1, "presence_penalty": 0, "logit_bias": {}, "echo": False})
    assert ok.status_code == 200
    chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
    r = httpx.post(url + "/v1/chat/completions", headers=auth, json={**chat, "top_logprobs": 2})
    assert r.status_code == 400 and "logprobs" in r.json()["error"]["message"]
    r = httpx.post(url + "/v1/chat/completions", headers=auth, json={**chat, "prompt_logprobs": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"
    r = httpx.post(url + "/v1/completions", headers=auth, json={"prompt": "", "max_tokens": 1})
    # The engine's refusal, without the server's own request id (the client never sees it).
    assert r.status_code == 400 and r.json()["error"]["message"] == (
        "empty prompt: there is nothing to condition on"), r.text
    r = httpx.get(url + "/v1/nothing", headers=auth)
    assert r.status_code == 404 and r.json()["error"]["message"]
    r = httpx.post(url + "/v1/completions", headers=auth, content=b'{"prompt": ')
    assert r.status_code == 400 and r.json()["error"]["param"] is None
    assert httpx.get(url + "/v1/models", headers={"Authorization": KEY}).status_code == 401
    assert httpx.get(url + "/v1/models",
                     headers={"Authorization": f"bearer {KEY}"}).status_code == 200


def test_default_max_tokens_stays_within_the_limit(engine):
    """A request without max_tokens on a server whose limit is below the default of 256
    gets the limit, not a 400 it never asked for; usage can be left off a stream."""
    srv = _Server(engine, api_key=None, limits=Limits(max_tokens=8))
    try:
        r = httpx.post(srv.url + "/v1/completions", timeout=60,
                       json={"prompt": "Count: 1, 2,", "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
        with httpx.stream("POST", srv.url + "/v1/completions", timeout=60, json={
                "prompt": "Hi", "max_tokens": 2, "stream": True,
                "stream_options": {"include_usage": False}}) as s:
            chunks = [line for line in s.iter_lines() if line.startswith("data: {")]
        assert chunks and all('"usage"' not in c for c in chunks)
    finally:
        srv.stop()
    _idle(engine)


def test_streams_carry_the_logprobs_of_their_tokens(client):
    """Each chunk carries its tokens' log-probabilities; together they are the answer's."""
    kw = {"model": MODEL, "max_tokens": 12, "temperature": 0,
          "extra_body": {"ignore_eos": True}}
    whole = client.completions.create(prompt="The capital of France is", logprobs=2, **kw)
    chunks = list(client.completions.create(prompt="The capital of France is", logprobs=2,
                                            stream=True, **kw))
    parts = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    want = whole.choices[0].logprobs
    assert [t for p in parts for t in p.tokens] == want.tokens
    assert [x for p in parts for x in p.token_logprobs] == pytest.approx(want.token_logprobs)
    assert [x for p in parts for x in p.text_offset] == want.text_offset
    assert [x for p in parts for x in p.top_logprobs] == [
        pytest.approx(x) for x in want.top_logprobs]
    messages = [{"role": "user", "content": "Name a colour."}]
    whole = client.chat.completions.create(messages=messages, logprobs=True, top_logprobs=2,
                                           **kw)
    chunks = list(client.chat.completions.create(messages=messages, logprobs=True,
                                                 top_logprobs=2, stream=True, **kw))
    got = [e for c in chunks if c.choices and c.choices[0].logprobs
           for e in c.choices[0].logprobs.content]
    assert [e.token for e in got] == [e.token for e in whole.choices[0].logprobs.content]
    assert [len(e.top_logprobs) for e in got] == [2] * len(got)


def test_prompt_logprob_ranks_equal_a_row_by_row_count():
    """_ranked's vectorized ranks against counting each row's larger values, ties included."""
    from llmdb.server.app import _ranked

    g = torch.Generator().manual_seed(0)
    logits = torch.randint(0, 6, (7, 12), generator=g).float()  # many ties
    own = torch.randint(0, 12, (7,), generator=g).tolist()
    for k in (0, 1, 3):
        rows = _ranked(logits, own, k)
        lp = logits.log_softmax(-1)
        for row, r, tok in zip(rows, lp, own, strict=True):
            assert row[0][0] == tok and len(row) == len({tok, *r.topk(k).indices.tolist()})
            for t, value, rank in row:
                assert value == pytest.approx(float(r[t]))
                assert rank == int((r > r[t]).sum()) + 1


TOOL_CALL = {"id": "call_1", "type": "function",
             "function": {"name": "lookup", "arguments": "{}"}}


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize"])
@pytest.mark.parametrize("message, param, cause", [
    ({"role": "user", "content": None}, "messages.1.content",
     "messages.1.content: content must be text (null only in an assistant message with "
     "tool_calls)"),
    ({"role": "user"}, "messages.1.content",
     "messages.1.content: content must be text (null only in an assistant message with "
     "tool_calls)"),
    # OpenAI's API takes it; this server makes no tool calls, so it cannot render one.
    ({"role": "assistant", "content": None, "tool_calls": [TOOL_CALL]}, "messages.1.tool_calls",
     "messages.1.tool_calls: tool calls are not supported by this server"),
])
def test_a_message_without_text_is_a_400_naming_its_index_and_field(server, path, message,
                                                                    param, cause):
    auth = {"Authorization": f"Bearer {KEY}"}
    messages = [{"role": "system", "content": "Answer briefly."}, message,
                {"role": "user", "content": "Hi"}]
    r = httpx.post(server.url + path, headers=auth, json={"messages": messages, "max_tokens": 1})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert r.json()["error"]["message"] == cause
