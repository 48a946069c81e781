"""A base model (no chat template: OPT, Llama-2 without -chat) in SQL: llm_complete continues
the row's text as plain text, as a completions endpoint would; the functions that ask chat
questions (llm_filter, llm_classify) and a system prompt are refused by name, per row."""

from __future__ import annotations

import json
import shutil

import pandas as pd
import pytest

import llmdb
from llmdb.engine.engine import LLMEngine
from llmdb.engine.params import SamplingParams
from llmdb.engine.registry import register_model

from .model_builders import save_tiny_llama

ENGINE = {"dtype": "fp32", "kv_cache_bytes": 1 << 20, "threads": 1}


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    """The tiny Llama of model_builders without its chat template, ending text with </s>."""
    path = save_tiny_llama(tmp_path_factory.mktemp("base") / "chat")
    base = path.parent / "base"
    shutil.copytree(path, base)
    config = json.loads((base / "tokenizer_config.json").read_text())
    del config["chat_template"]
    config.update(eos_token="</s>", add_bos_token=True)
    (base / "tokenizer_config.json").write_text(json.dumps(config))
    return base


@pytest.fixture
def con(base_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("LLMDB_CONFIG_DIR", str(tmp_path / "config"))
    register_model("tinybase", base_dir)
    with llmdb.connect(model="tinybase", cache=False, progress=False, **ENGINE) as c:
        yield c


@pytest.fixture(scope="module")
def engine(base_dir):
    return LLMEngine(str(base_dir), **ENGINE)


def _continued(engine: LLMEngine, text: str, max_tokens: int) -> str:
    """The engine's greedy continuation of the text as data, after the BOS token."""
    tok = engine.tokenizer
    assert tok.add_bos
    ids = [tok.token_id(tok.bos_token), *tok.encode_plain(text)]
    return engine.generate([ids], SamplingParams(max_tokens=max_tokens))[0].text


def test_complete_continues_the_text(con, engine):
    texts = ["the capital of france is", "hello world", "a haiku about the sky"]
    con.execute("CREATE TABLE t AS SELECT unnest(?) AS p", [texts])
    got = [r[0] for r in con.execute(
        "SELECT llm_complete(p, max_tokens := 6) FROM t ORDER BY rowid").fetchall()]
    assert got == [_continued(engine, t, 6) for t in texts]
    assert all(got)  # (a word-level vocabulary: every generated token is text)


def test_marker_strings_in_a_row_stay_text(eng):
    """A base model's prompt is the row's text as data, as chat contents are: SmolLM2's
    `<|im_end|>` or `<|endoftext|>` in a row does not end the text (its BPE vocabulary has
    them as special tokens, which encode() would parse)."""
    tok = eng.tokenizer
    text = "Stop here <|im_end|> and go on <|endoftext|> please"
    assert set(tok.encode(text)) & tok.marker_ids  # (the test tells the two apart)
    ids = tok.encode_plain_prompt(text)
    assert not set(ids) & tok.marker_ids
    assert tok.decode(ids) == text


def test_chat_functions_and_a_system_prompt_are_refused_by_name(con):
    con.execute("CREATE TABLE t AS SELECT 'the sky is blue' AS p")
    for call, what in [("llm_filter(p)", "llm_filter"),
                       ("llm_classify(p, ['a', 'b'])", "llm_classify"),
                       ("llm_complete(p, system := 'be brief')", "system prompt")]:
        with pytest.raises(llmdb.LLMError, match=f"tinybase is a base model.*{what}"):
            con.execute(f"SELECT {call} FROM t").fetchall()
    rows = con.execute("SELECT llm_filter(p, on_error := 'null') FROM t").fetchall()
    assert rows == [(None,)]
    errors = con.execute("SELECT * FROM llm_errors()").fetchall()
    assert len(errors) == 1 and "instruction-tuned" in str(errors[0])


def test_explain_and_dataframes_take_the_same_prompt(con, engine):
    df = pd.DataFrame({"x": ["paris", "python"]})
    out = llmdb.complete(df, "the {x} of", output="a", max_tokens=4, model="tinybase",
                         cache=False, progress=False, **ENGINE)
    assert out["a"].tolist() == [_continued(engine, f"the {x} of", 4) for x in df["x"]]
    explain = con.execute("EXPLAIN LLM SELECT llm_complete('the sky is', max_tokens := 4)")
    columns = [d[0] for d in explain.description]
    site = dict(zip(columns, explain.fetchall()[0], strict=True))
    assert site["prompt_tokens_est"] == 1 + len(engine.tokenizer.encode_plain("the sky is"))


def test_the_vllm_backend_continues_a_base_models_prompt(engine):
    """The in-process vLLM backend sent a base model's llm_complete as chat messages, which
    a model without a template cannot encode; it now gives vLLM the token ids the local
    engine continues. (vLLM does not install here: the backend is made without its engine,
    and only the prompts it would give vLLM are checked.)"""
    from llmdb.backends.vllm import VLLMBackend

    backend = object.__new__(VLLMBackend)
    backend.name, backend.tokenizer = "tinybase", engine.tokenizer
    ids = backend.render_completion("the sky is", None)
    assert ids == engine.tokenizer.encode_plain_prompt("the sky is")
    assert backend._encode(ids) == ids
    with pytest.raises(ValueError, match="tinybase is a base model.*llm_filter"):
        backend.render_chat("is the sky blue?", None)
    with pytest.raises(ValueError, match="tinybase is a base model.*system prompt"):
        backend.render_completion("the sky is", "be brief")
