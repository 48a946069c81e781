"""The model registry as users run it: `llmdb models add|list|remove` from several shells at
once, a registry file damaged by hand, a registered model moved away, paths with ~."""

from __future__ import annotations

import json
import multiprocessing
import shutil
from pathlib import Path

import pytest

from llmdb.cli import main as cli
from llmdb.engine.engine import LLMEngine
from llmdb.engine.models import ModelLoadError
from llmdb.engine.params import SamplingParams
from llmdb.engine.registry import (
    config_file,
    register_model,
    registered_models,
    resolve_model,
)

from .model_builders import save_tiny_llama


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("registry") / "llama")


@pytest.fixture
def config_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMDB_CONFIG_DIR", str(tmp_path / "config"))
    return tmp_path / "config"


def _engine(model: str) -> LLMEngine:
    return LLMEngine(model=model, dtype="fp32", kv_cache_bytes=1 << 20, threads=1)


def _add_at_once(barrier, name: str, path: str) -> None:
    barrier.wait()
    register_model(name, path)


def test_models_added_at_the_same_time_are_all_kept(config_dir, model_dir):
    """Each `models add` read the file, added its name and wrote it back: of several at once,
    the last write dropped the names the others had added."""
    n = 6
    ctx = multiprocessing.get_context("fork")
    barrier = ctx.Barrier(n)
    procs = [ctx.Process(target=_add_at_once, args=(barrier, f"m{i}", str(model_dir)))
             for i in range(n)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0] * n
    assert {f"m{i}" for i in range(n)} <= registered_models().keys()


@pytest.mark.parametrize("text, cause", [("{not json", "not valid JSON"),
                                         ('["a", "b"]', "not an object of names and paths")])
def test_a_damaged_registry_is_named(config_dir, model_dir, capsys, text, cause):
    """`models add` over a damaged file raised a bare JSONDecodeError (or, over a list,
    TypeError); every reader names the file."""
    config_dir.mkdir()
    config_file().write_text(text)
    assert cli(["models", "add", "mine", str(model_dir)]) == 2
    err = capsys.readouterr().err
    assert f"the model registry {config_file()} is {cause}" in err
    assert cli(["models", "list"]) == 2
    assert cause in capsys.readouterr().err
    assert config_file().read_text() == text  # left for the user to mend, not overwritten


def test_a_registered_model_that_moved_is_named_with_its_name(config_dir, model_dir,
                                                              tmp_path):
    """The error said only 'model path X does not exist', not which name pointed there nor
    how to mend it."""
    moved = shutil.copytree(model_dir, tmp_path / "moved")
    register_model("mine", moved)
    shutil.rmtree(moved)
    with pytest.raises(ModelLoadError, match=r"model 'mine' is registered as .*moved, which "
                                             r"no longer exists.*llmdb models add mine"):
        _engine("mine")


def test_add_again_says_what_it_replaced_and_remove_forgets(config_dir, model_dir, tmp_path,
                                                            capsys):
    other = shutil.copytree(model_dir, tmp_path / "other")
    assert cli(["models", "add", "mine", str(model_dir)]) == 0
    assert capsys.readouterr().out == f"registered mine -> {model_dir.resolve()}\n"
    assert cli(["models", "add", "mine", str(other)]) == 0
    assert capsys.readouterr().out == (f"registered mine -> {other.resolve()} "
                                       f"(was {model_dir.resolve()})\n")
    assert registered_models()["mine"] == str(other.resolve())

    engine = _engine("mine")  # loaded before the name is removed: it keeps running
    assert cli(["models", "remove", "mine"]) == 0
    assert capsys.readouterr().out == f"removed mine (was {other.resolve()})\n"
    assert "mine" not in registered_models()
    assert other.exists()  # the files are the user's
    [result] = engine.generate([[1, 7, 30]], SamplingParams(max_tokens=3, ignore_eos=True))
    assert result.error is None and len(result.token_ids) == 3
    with pytest.raises(ModelLoadError, match="unknown model 'mine'"):
        resolve_model("mine", allow_paths=False)

    assert cli(["models", "remove", "mine"]) == 2
    assert "no model file is registered as 'mine'" in capsys.readouterr().err
    assert cli(["models", "remove", "smollm2-135m"]) == 2
    assert "built in and cannot be removed" in capsys.readouterr().err
    assert json.loads(config_file().read_text()) == {}


def test_a_path_with_a_tilde_is_the_home_directory(config_dir, model_dir, tmp_path,
                                                   monkeypatch):
    """LLMEngine("~/models/x") called the path an unknown model; `models add` expands it."""
    monkeypatch.setenv("HOME", str(tmp_path))
    shutil.copytree(model_dir, tmp_path / "my model")
    assert resolve_model("~/my model") == tmp_path / "my model"
    assert _engine("~/my model").config.num_layers == 2


def test_remove_forgets_a_remote_model_and_says_what_it_was(config_dir, capsys):
    """`models remove` refused a remote model: once added, its name could not be freed."""
    from llmdb.backends.remote_models import remote_models

    assert cli(["models", "add", "far", "--endpoint", "http://gpu1:8000/v1", "--endpoint",
                "http://gpu2:8000", "--served-model-name", "org/big"]) == 0
    assert cli(["models", "add", "near", "--endpoint", "http://gpu3:8000/v1"]) == 0
    capsys.readouterr()
    assert cli(["models", "remove", "far"]) == 0
    assert capsys.readouterr().out == \
        "removed far (was http://gpu1:8000/v1, http://gpu2:8000 as org/big)\n"
    assert list(remote_models()) == ["near"]
    assert cli(["models", "remove", "far"]) == 2
    assert "no model file is registered as 'far'" in capsys.readouterr().err
