"""Choosing the backend: per connection (llmdb.connect(backend=...)) or per model in the
registry (`llmdb models add NAME --endpoint URL --api-key-env VAR`), and the API key kept out
of SQL, registry files, the result cache, logs and errors. Against a scripted endpoint
(tests/openai_stub.py) that checks the key; no model runs here."""

from __future__ import annotations

import json
import logging

import pytest

pytest.importorskip("uvicorn", reason="uvicorn is not installed")

import llmdb  # noqa: E402
from llmdb import cli  # noqa: E402
from llmdb.backends.openai import OpenAIBackend  # noqa: E402
from llmdb.backends.remote_models import remote_models  # noqa: E402

from .openai_stub import StubEndpoint, chat_answer  # noqa: E402

SECRET = "sk-test-5e3f9a0c7b1d4e62"
KEY_VAR = "LLMDB_TEST_REMOTE_KEY"


@pytest.fixture
def config_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMDB_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.setenv("LLMDB_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path


@pytest.fixture
def keyed_stub():
    """An endpoint that answers only requests carrying the key."""
    async def handler(path, body):
        return 200, {}, chat_answer(f"echo: {body['messages'][-1]['content']}")

    stub = StubEndpoint(handler)
    yield stub
    stub.stop()


def _files_text(root) -> str:
    return "\n".join(p.read_bytes().decode("utf-8", "replace")
                     for p in root.rglob("*") if p.is_file())


def test_connection_options_are_checked():
    with pytest.raises(ValueError, match="backend='openai' needs endpoints"):
        llmdb.connect(backend="openai")
    with pytest.raises(ValueError, match="backend must be 'local', 'openai' or a Backend"):
        llmdb.connect(backend="vllm-but-misspelt")
    with pytest.raises(ValueError, match="need backend='openai'"):
        llmdb.connect(backend="local", endpoints=["http://127.0.0.1:1"])
    with pytest.raises(ValueError, match="need backend='openai'"):
        llmdb.connect(max_concurrency=4)
    with pytest.raises(TypeError, match="openai backend options are endpoints"):
        llmdb.connect(endpoint="http://127.0.0.1:1")


def test_an_unknown_model_fails_at_connect(config_dir):
    """Not in the first query's rows, each of them NULL under on_error='null'."""
    import duckdb

    unknown = r"unknown model 'smolm2-135m'; registered models: smollm2-135m"
    with pytest.raises(ValueError, match=unknown):
        llmdb.connect(model="smolm2-135m", on_error="null")
    with pytest.raises(ValueError, match=unknown):
        llmdb.register(duckdb.connect(), model="smolm2-135m", on_error="null")
    # Names with a backend: registered, the stand-in, served at endpoints, a Backend object.
    cli.main(["models", "add", "remote", "--endpoint", "http://127.0.0.1:9/v1"])
    for model in ("smollm2-135m", "hash-standin", "remote"):
        llmdb.connect(model=model).close()
    llmdb.connect(model="any", backend="openai", endpoints=["http://127.0.0.1:9/v1"]).close()
    llmdb.connect(model="mine", backend=llmdb.connect(model="hash-standin").session.backend()
                  ).close()


def test_a_missing_key_variable_is_named(monkeypatch):
    monkeypatch.delenv(KEY_VAR, raising=False)
    con = llmdb.connect(backend="openai", endpoints=["http://127.0.0.1:9/v1"],
                        api_key_env=KEY_VAR, cache=False)
    with pytest.raises(ValueError, match=f"environment variable {KEY_VAR} .* is not set"):
        con.sql("SELECT llm_complete('hi')").fetchall()


def test_per_connection_openai_backend_sends_the_key(keyed_stub, monkeypatch, config_dir):
    monkeypatch.setenv(KEY_VAR, SECRET)
    con = llmdb.connect(backend="openai", endpoints=[keyed_stub.url], api_key_env=KEY_VAR,
                        model="stub-model", cache=False, max_concurrency=3)
    assert con.sql("SELECT llm_complete('hello')").fetchall() == [("echo: hello",)]
    seen = keyed_stub.seen[-1]
    assert seen.headers["authorization"] == f"Bearer {SECRET}"
    assert seen.body["model"] == "stub-model"
    backend = con.session.backend()
    assert isinstance(backend, OpenAIBackend)
    assert backend.pool.limits.max_concurrency == 3
    assert SECRET not in repr(backend.identity())


def test_registry_entry_runs_on_its_endpoints_and_never_stores_the_key(
        keyed_stub, monkeypatch, config_dir, capsys, caplog):
    caplog.set_level(logging.DEBUG)  # httpx and httpcore log every request at this level
    monkeypatch.setenv(KEY_VAR, SECRET)
    # Two names of the one stub, a base URL and a root: two replicas.
    other = keyed_stub.url.removesuffix("/v1").replace("127.0.0.1", "localhost")
    assert cli.main(["models", "add", "far-model", "--endpoint", keyed_stub.url,
                     "--endpoint", other, "--api-key-env", KEY_VAR,
                     "--served-model-name", "served-name"]) == 0
    entry = remote_models()["far-model"]
    assert entry == {"endpoints": [keyed_stub.url, other],
                     "api_key_env": KEY_VAR, "served_model": "served-name"}
    assert cli.main(["models", "list"]) == 0
    listed = capsys.readouterr().out
    assert "far-model\topenai:" in listed and f"${KEY_VAR}" in listed

    con = llmdb.connect(model="far-model")  # the result cache is on: its files are checked
    con.execute("CREATE TABLE t AS SELECT 'row ' || i AS x FROM range(5) r(i)")
    rows = con.sql("SELECT llm_complete(x) AS a FROM t ORDER BY x").fetchall()
    assert rows == [(f"echo: row {i}",) for i in range(5)]
    assert {s.body["model"] for s in keyed_stub.seen} == {"served-name"}
    assert all(s.headers["authorization"] == f"Bearer {SECRET}" for s in keyed_stub.seen)
    assert con.sql("SELECT llm_complete('row 1', model := 'far-model')").fetchall() == \
        [("echo: row 1",)]  # from the result cache
    assert len(keyed_stub.seen) == 5

    written = _files_text(config_dir)
    assert "served-name" in written and "echo: row 1" in written  # registry and cache read
    assert SECRET not in written
    out = capsys.readouterr()
    assert SECRET not in out.out + out.err + caplog.text
    assert "HTTP Request" in caplog.text  # the logs were captured: they hold no key


def test_a_wrong_key_is_an_error_that_does_not_echo_it(monkeypatch):
    async def guarded(path, body):
        return 401, {}, {"error": {"message": "missing or wrong API key"}}

    with StubEndpoint(guarded) as stub:
        monkeypatch.setenv(KEY_VAR, SECRET)
        con = llmdb.connect(backend="openai", endpoints=[stub.url], api_key_env=KEY_VAR,
                            cache=False)
        with pytest.raises(llmdb.LLMError) as e:
            con.sql("SELECT llm_complete('hi')").fetchall()
    assert "answered 401: missing or wrong API key" in str(e.value)
    assert SECRET not in str(e.value)


def test_registry_refuses_keys_credentials_and_name_clashes(config_dir, tmp_path, capsys):
    def add(*args):
        return cli.main(["models", "add", *args])

    assert add("m", "--endpoint", "http://h:1", "--api-key-env", SECRET) == 2
    assert "NAME of an environment variable" in capsys.readouterr().err
    assert add("m", "--endpoint", "http://user:pw@h:1") == 2
    assert "no credentials in an endpoint URL" in capsys.readouterr().err
    assert add("m", "--endpoint", "ftp://h") == 2
    assert add("smollm2-135m", "--endpoint", "http://h:1") == 2
    assert add("m") == 2
    assert "PATH" in capsys.readouterr().err
    assert add("m", "--endpoint", "http://h:1") == 0
    assert add("m", str(tmp_path)) == 2
    assert "already registered as a remote model" in capsys.readouterr().err
    assert not (config_dir / "config" / "models.json").exists()
    assert json.loads((config_dir / "config" / "remote_models.json").read_text())["m"][
        "api_key_env"] is None


@pytest.mark.parametrize(("url", "error"), [
    ("http://h:8000/v1/chat/completions", "is an API path; give the base URL"),
    ("http://h:8000/v1/completions/", "is an API path; give the base URL"),
    ("http://h:8000/v1?api_key=x", "without a ?query"),
    ("http://h:8000/v1#models", "without a ?query"),
    ("http://h:99999/v1", "Port out of range"),
    ("http://:8000/v1", "is not an http(s) URL"),
])
def test_registry_refuses_what_is_not_a_base_url(config_dir, capsys, url, error):
    # Each was registered, then failed every row (404s, a port httpx refused at connect).
    assert cli.main(["models", "add", "m", "--endpoint", url]) == 2
    assert error in capsys.readouterr().err
    assert not remote_models()


def test_base_urls_are_given_once(config_dir):
    # One server twice would be two replicas, each sent max_concurrency requests.
    with pytest.raises(ValueError, match=r"'http://h:1/v1' is given twice \(as http://h:1/v1\)"):
        llmdb.connect(backend="openai", endpoints=["http://h:1", "http://h:1/v1"])
    with pytest.raises(ValueError, match="is an API path"):  # at connect, not per row
        llmdb.connect(endpoints="http://h:1/v1/chat/completions")
    assert llmdb.connect(endpoints="http://h:1/v1").session.options.endpoints == ["http://h:1/v1"]
    # One server, however its URL is written: one backend, one max_concurrency for it.
    backends = {id(llmdb.connect(endpoints=[url]).session.backend())
                for url in ("http://h:1/v1", "http://h:1/", " http://h:1")}
    assert len(backends) == 1
    assert cli.main(["models", "add", "m", "--endpoint", "http://h:1/",
                     "--endpoint", "http://h:1"]) == 2
