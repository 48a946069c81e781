"""A base (non-chat) model behind an OpenAI-compatible server, registered as one: llm_complete
continues the prompt as plain text through /completions, as the local engine continues it
(DESIGN: a base model continues llm_complete's prompt); the chat functions and a system prompt
are refused naming the model. Against a scripted endpoint that refuses chat, as vLLM does for
a model without a chat template."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("uvicorn", reason="uvicorn is not installed")

import llmdb  # noqa: E402
from llmdb import cli  # noqa: E402

from .openai_stub import StubEndpoint  # noqa: E402


async def _base_model_server(path, body):
    if path.endswith("/chat/completions"):  # (vLLM's answer for a model without a template)
        return 400, {}, {"error": {"message": "the model has no chat template"}}
    return 200, {}, {"id": "cmpl-stub", "object": "text_completion", "model": body["model"],
                     "choices": [{"index": 0, "text": f" ... after {body['prompt']!r}",
                                  "finish_reason": "length"}],
                     "usage": {"prompt_tokens": 6, "completion_tokens": 3}}


@pytest.fixture
def stub():
    with StubEndpoint(_base_model_server) as s:
        yield s


@pytest.fixture
def config_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMDB_CONFIG_DIR", str(tmp_path / "config"))


def test_a_registered_base_model_continues_the_prompt(stub, config_dir, capsys):
    assert cli.main(["models", "add", "far", "--endpoint", stub.url, "--served-model-name",
                     "org/base-7b", "--base-model"]) == 0
    assert cli.main(["models", "list"]) == 0
    assert f"far\topenai: {stub.url} as org/base-7b (a base model)" in capsys.readouterr().out
    con = llmdb.connect(model="far", cache=False)
    rows = con.sql("SELECT llm_complete('The capital of France is', max_tokens := 3, "
                   "stop := ['.'])").fetchall()
    assert rows == [(" ... after 'The capital of France is'",)]
    [seen] = stub.seen
    assert seen.path == "/v1/completions"
    assert seen.body == {"model": "org/base-7b", "prompt": "The capital of France is",
                         "max_tokens": 3, "temperature": 0.0, "stop": ["."]}
    stats = json.loads(con.sql("SELECT llm_stats()").fetchall()[0][0])["last_query"]
    assert (stats["prompt_tokens"], stats["generated_tokens"]) == (6, 3)


def test_chat_questions_to_a_base_model_are_refused_naming_it(stub):
    con = llmdb.connect(model="far", backend="openai", endpoints=[stub.url], base_model=True,
                        cache=False)
    for call, what in [("llm_filter('the sky is blue')", "llm_filter"),
                       ("llm_classify('the sky', ['a', 'b'])", "llm_classify"),
                       ("llm_complete('the sky', system := 'be brief')", "system prompt")]:
        with pytest.raises(llmdb.LLMError, match=f"far is a base model.*{what}"):
            con.sql(f"SELECT {call}").fetchall()
    assert not stub.seen


def test_a_chat_model_still_sends_chat(stub):
    con = llmdb.connect(model="far", backend="openai", endpoints=[stub.url], cache=False,
                        on_error="null")
    assert con.sql("SELECT llm_complete('hi')").fetchall() == [(None,)]
    assert [s.path for s in stub.seen] == ["/v1/chat/completions"]
