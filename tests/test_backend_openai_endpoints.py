"""Where the openai backend sends requests and what it says when they fail: base URLs taken
as given (Gemini's, a proxy's prefix), every endpoint named when all are down, and an API key
rotated in the environment while the process runs. Against scripted endpoints
(tests/openai_stub.py); no model runs here."""

from __future__ import annotations

import pytest

pytest.importorskip("uvicorn", reason="uvicorn is not installed")

import llmdb  # noqa: E402
from llmdb.backends.endpoints import base_url  # noqa: E402
from llmdb.backends.openai import OpenAIBackend  # noqa: E402

from .openai_stub import StubEndpoint, chat_answer, free_port, generate  # noqa: E402


def test_base_urls_are_taken_as_given_and_a_bare_host_gets_v1():
    assert base_url("https://generativelanguage.googleapis.com/v1beta/openai/") == \
        "https://generativelanguage.googleapis.com/v1beta/openai"
    assert base_url(" https://h/api/v1/ ") == "https://h/api/v1"
    assert base_url("http://h:8000") == base_url("http://h:8000/") == "http://h:8000/v1"
    assert base_url("http://[::1]:8000") == "http://[::1]:8000/v1"


def _script(*answers):
    """A handler answering with `answers` in turn, then the last one forever."""
    answers = list(answers)

    async def handler(path, body):
        return answers.pop(0) if len(answers) > 1 else answers[0]
    return handler


async def _echo(path, body):
    if path.endswith("/tokenize"):
        return 200, {}, {"count": 2, "tokens": [1, 2]}
    return 200, {}, chat_answer(f"echo: {body['messages'][-1]['content']}")


def test_a_base_url_with_a_path_is_used_as_given(backends):
    """Gemini's OpenAI endpoint (.../v1beta/openai) was taken for a server root: every row
    went to .../v1beta/openai/v1/chat/completions, a 404."""
    with StubEndpoint(_echo, api_path="/v1beta/openai") as stub:
        result = generate(backends([stub.url]))
        assert (result.error, result.text) == (None, "echo: hello")
        assert [s.path for s in stub.seen] == ["/v1beta/openai/chat/completions"]


def test_a_proxy_prefix_keeps_vllms_tokenize_beside_its_v1(backends):
    with StubEndpoint(_echo, tokenize=True, api_path="/team-a/vllm/v1") as stub:
        backend = backends([stub.url])
        assert generate(backend).text == "echo: hello"
        assert backend.count_tokens(["two tokens"]) == [2]
        assert [s.path for s in stub.seen] == ["/team-a/vllm/v1/chat/completions",
                                               "/team-a/vllm/tokenize"]


def test_a_bare_host_is_served_under_v1(backends):
    with StubEndpoint(_echo) as stub:
        bare = stub.url.removesuffix("/v1")
        assert generate(backends([bare])).text == "echo: hello"
        assert [s.path for s in stub.seen] == ["/v1/chat/completions"]


def test_cache_identity_of_a_v1_server_is_its_root():
    """Answers cached before base URLs were taken as given are found under the same key."""
    for url in ("http://h:8000/v1", "http://h:8000"):
        b = OpenAIBackend("m", [url])
        assert b.identity()["endpoints"] == ["http://h:8000"]
        b.close()
    gemini = OpenAIBackend("m", ["https://g.example/v1beta/openai"])
    assert gemini.identity()["endpoints"] == ["https://g.example/v1beta/openai"]
    gemini.close()


def test_a_connection_takes_a_base_url_with_a_path():
    with StubEndpoint(_echo, api_path="/v1beta/openai") as stub:
        con = llmdb.connect(backend="openai", endpoints=[stub.url], cache=False)
        assert con.sql("SELECT llm_complete('hi')").fetchall() == [("echo: hi",)]


def test_all_endpoints_down_names_each_and_its_cause(backends):
    """The error named only the endpoint tried last: of three replicas down, the user saw
    one, and could not tell a dead server from an overloaded one."""
    dead = f"http://127.0.0.1:{free_port()}/v1"
    overloaded = _script((503, {}, {"error": {"message": "the engine is overloaded"}}))
    with StubEndpoint(overloaded) as busy, StubEndpoint(_echo, api_path="/gone") as gone:
        gone.stop()  # (its port refuses connections from now on)
        result = generate(backends([dead, busy.url, gone.url], max_retries=3))
    assert result.finish_reason == "error"
    error = result.error
    assert error.startswith("no endpoint answered (gave up after 4 attempts): ")
    assert f"{dead} is unreachable (ConnectError" in error
    assert f"{busy.url}/chat/completions answered 503: the engine is overloaded" in error
    assert f"{gone.url} is unreachable (ConnectError" in error


def test_an_endpoint_this_row_did_not_reach_is_named_with_why(backends):
    dead = f"http://127.0.0.1:{free_port()}/v1"
    overloaded = _script((503, {}, {"error": {"message": "overloaded"}}))
    with StubEndpoint(overloaded) as busy, StubEndpoint(overloaded) as spare:
        backend = backends([dead, busy.url, spare.url], max_retries=0)
        generate(backend)  # takes the dead one out of rotation
        error = generate(backend).error
    assert error.startswith("no endpoint answered (gave up after 1 attempts): ")
    assert f"{dead} is out of rotation: {dead} is unreachable (ConnectError" in error
    assert error.count("answered 503: overloaded") == 1
    assert error.count(" was not tried") == 1


def test_a_key_rotated_in_the_environment_is_taken_after_a_401(backends, monkeypatch):
    """The key was read once, when the backend was made (and the process shares one backend
    per endpoints): after a rotation every row failed with 401 until a restart. Now a 401
    reads the variable again and, if it changed, the row is sent again with the new key."""
    valid = {"key": "sk-old-1111"}
    monkeypatch.setenv("STUB_KEY", "sk-old-1111")
    with StubEndpoint(_echo) as stub:
        async def check_key(path, body):
            sent = stub.seen[-1].headers["authorization"].removeprefix("Bearer ")
            if sent != valid["key"]:
                return 401, {}, {"error": {"message": f"invalid key {sent}"}}
            return await _echo(path, body)

        stub.handler = check_key
        backend = backends([stub.url], api_key_env="STUB_KEY", max_retries=0)
        assert generate(backend).text == "echo: hello"
        valid["key"] = "sk-new-2222"  # rotated at the provider: the old key is refused
        assert generate(backend).error.endswith("answered 401: invalid key ***")
        monkeypatch.setenv("STUB_KEY", "sk-new-2222\n")  # and in the environment
        assert generate(backend).text == generate(backend).text == "echo: hello"
        sent = [s.headers["authorization"] for s in stub.seen]
        assert sent == ["Bearer sk-old-1111"] * 3 + ["Bearer sk-new-2222"] * 2
