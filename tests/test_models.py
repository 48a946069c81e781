"""Model registry, GGUF loading errors, dtype choice and the weight cache."""

from __future__ import annotations

import shutil

import pytest
import torch

from llmdb.cli import main as cli
from llmdb.engine.engine import LLMEngine
from llmdb.engine.models import ModelLoadError, load_model
from llmdb.engine.registry import registered_models, resolve_model


@pytest.fixture
def config_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMDB_CONFIG_DIR", str(tmp_path / "config"))
    return tmp_path


def test_default_model_resolves_to_the_bundled_gguf():
    path = resolve_model("smollm2-135m")
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.exists()


def test_unknown_model_name_is_a_clear_error(config_dir):
    with pytest.raises(ModelLoadError, match=r"unknown model 'nope'.*llmdb models add"):
        LLMEngine("nope")


def test_register_a_model_by_cli_and_use_it(config_dir, capsys):
    gguf = resolve_model("smollm2-135m")
    assert cli(["models", "add", "mine", str(gguf)]) == 0
    assert registered_models()["mine"] == str(gguf.resolve())
    assert resolve_model("mine", allow_paths=False) == gguf.resolve()
    assert cli(["models", "list"]) == 0
    assert "mine" in capsys.readouterr().out
    assert cli(["models", "add", "other", str(config_dir / "missing.gguf")]) == 2
    assert "does not exist" in capsys.readouterr().err


@pytest.mark.parametrize("where", ["file", "endpoint"])
@pytest.mark.parametrize("name", ["hash-standin", "", "  "])
def test_a_name_no_connection_would_reach_is_refused(config_dir, capsys, name, where):
    """The stand-in's name was registered, and llmdb.connect(model="hash-standin") went on
    answering with hashes, never loading the file; an empty name made a blank row in
    `llmdb models list`."""
    from llmdb.backends.remote_models import remote_models

    target = [str(resolve_model("smollm2-135m"))] if where == "file" else [
        "--endpoint", "http://127.0.0.1:9/v1"]
    assert cli(["models", "add", name, *target]) == 2
    err = capsys.readouterr().err
    assert ("built in" in err) if name.strip() else ("name cannot be empty" in err)
    assert name not in registered_models() and name not in remote_models()


def test_truncated_gguf_is_a_clear_error(tmp_path):
    src = resolve_model("smollm2-135m")
    bad = tmp_path / "truncated.gguf"
    with open(src, "rb") as f:
        bad.write_bytes(f.read(src.stat().st_size // 2))
    with pytest.raises(ModelLoadError, match="truncated|corrupt"):
        load_model(bad)


def test_corrupt_gguf_is_a_clear_error(tmp_path):
    bad = tmp_path / "garbage.gguf"
    bad.write_bytes(b"GGUF" + bytes(range(256)) * 64)
    with pytest.raises(ModelLoadError, match="cannot read GGUF"):
        load_model(bad)
    (tmp_path / "empty.gguf").write_bytes(b"")
    with pytest.raises(ModelLoadError):
        load_model(tmp_path / "empty.gguf")


def test_weight_cache_gives_the_same_weights(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMDB_CACHE_DIR", str(tmp_path / "cache"))
    src = resolve_model("smollm2-135m")
    local = tmp_path / "model.gguf"
    shutil.copy(src, local)
    first = load_model(local)  # dequantizes and writes the cache
    cached = list((tmp_path / "cache" / "weights").glob("*.safetensors"))
    assert len(cached) == 1
    second = load_model(local)  # reads the cache
    assert first.fingerprint == second.fingerprint
    for name, w in first.weights.items():
        assert torch.equal(w, second.weights[name]), name


def test_gguf_config_and_tokenizer():
    m = load_model(resolve_model("smollm2-135m"))
    c = m.config
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim) == (
        30, 576, 9, 3, 64)
    assert (c.ffn_size, c.vocab_size, c.rope_theta, c.tie_embeddings) == (
        1536, 49152, 100000.0, True)
    assert 2 in c.eos_token_ids
    text = m.tokenizer.apply_chat_template([{"role": "user", "content": "Hi 123"}])
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    ids = m.tokenizer.encode(text)
    assert ids[0] == 1 and m.tokenizer.decode(ids, skip_special=False) == text
    # Digits are split one by one, as llama.cpp's smollm pre-tokenizer does.
    assert len(m.tokenizer.encode("123")) == 3


def test_registering_a_file_that_is_no_model_fails_at_add_time(config_dir, capsys):
    not_model = config_dir / "passwd"
    not_model.write_text("root:x:0:0:root:/root:/bin/bash\n")
    assert cli(["models", "add", "bad", str(not_model)]) == 2
    assert "neither a GGUF file nor a model directory" in capsys.readouterr().err
    empty_dir = config_dir / "empty"
    empty_dir.mkdir()
    assert cli(["models", "add", "bad", str(empty_dir)]) == 2
    assert "config.json" in capsys.readouterr().err
    assert "bad" not in registered_models()


def test_cli_help_version_and_file_errors(config_dir, capsys, tmp_path):
    with pytest.raises(SystemExit):
        cli(["--version"])
    assert "llmdb 0.1.0" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli(["--help"])
    out = capsys.readouterr().out
    assert "examples:" in out and "llm_classify(text, labels" in out
    assert cli(["sql", "-f", str(tmp_path / "missing.sql")]) == 2
    assert "cannot read" in capsys.readouterr().err
    job = tmp_path / "job.sql"
    job.write_text("SELECT 1;\nSELECT * FROM no_such_table;\n")
    assert cli(["sql", "-f", str(job), "--no-progress"]) == 2
    assert "statement 2 of 2 (SELECT * FROM no_such_table)" in capsys.readouterr().err
