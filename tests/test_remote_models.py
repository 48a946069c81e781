"""remote_models.json edited by hand: a wrong shape is refused when the file is read, naming
the file, the entry and the field (before, a KeyError or TypeError deep inside a query)."""

from __future__ import annotations

import json
import re

import pytest

import llmdb
from llmdb import cli
from llmdb.backends.remote_models import remote_models, remote_models_file

URL = "http://127.0.0.1:9/v1"


@pytest.fixture
def registry(tmp_path, monkeypatch):
    """write(content): remote_models.json holding `content` (JSON)."""
    monkeypatch.setenv("LLMDB_CONFIG_DIR", str(tmp_path / "config"))

    def write(content) -> None:
        f = remote_models_file()
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(json.dumps(content))
    return write


@pytest.mark.parametrize("content, entry, error", [
    ([{"endpoints": [URL]}], None, "holds a list, not an object of model names"),
    ({"m": [URL]}, "m", "is a list, not an object"),
    ({"m": {}}, "m", "has no 'endpoints': give a list of one or more endpoint URL strings"),
    ({"m": {"endpoints": URL}}, "m", "has 'endpoints' a string: give a list"),
    ({"m": {"endpoints": []}}, "m", "has 'endpoints' a list: give a list of one or more"),
    ({"m": {"endpoints": [URL, 8000]}}, "m", "has 'endpoints' a list: give a list"),
    ({"m": {"endpoints": ["ftp://h"]}}, "m", "'endpoints': endpoint 'ftp://h' is not an http"),
    ({"m": {"endpoints": [URL, URL]}}, "m", "'endpoints': endpoint .* is given twice"),
    ({"m": {"endpoint": [URL]}}, "m", "has the field 'endpoint', which is none of endpoints"),
    ({"ok": {"endpoints": [URL]}, "m": {"endpoints": [URL], "api_key_env": 5}}, "m",
     "has an 'api_key_env' that is not the NAME of an environment variable"),
    ({"m": {"endpoints": [URL], "served_model": ["a"]}}, "m", "has 'served_model' a list"),
    ({"m": {"endpoints": [URL], "served_model": ""}}, "m", "'served_model' an empty string"),
    ({"m": {"endpoints": [URL], "base_model": "yes"}}, "m", "has 'base_model' a string: give"),
])
def test_a_wrong_shape_is_refused_naming_the_file_entry_and_field(registry, content, entry,
                                                                   error):
    registry(content)
    where = f"the remote model registry {remote_models_file()}" + \
        (f", entry {entry!r}" if entry else "")
    with pytest.raises(ValueError, match=f"^{re.escape(where)}.*{error}"):
        remote_models()


def test_a_key_pasted_as_the_variable_name_is_not_repeated(registry):
    registry({"m": {"endpoints": [URL], "api_key_env": "sk-secret-1234"}})
    with pytest.raises(ValueError) as e:
        remote_models()
    assert "sk-secret" not in str(e.value)


def test_the_errors_reach_connect_and_the_cli(registry, capsys):
    registry({"m": {"endpoints": URL}})
    with pytest.raises(ValueError, match="entry 'm' has 'endpoints' a string"):
        llmdb.connect(model="m")
    assert cli.main(["models", "list"]) == 2
    assert "entry 'm' has 'endpoints' a string" in capsys.readouterr().err


def test_a_hand_written_minimal_entry_works(registry, capsys):
    """Only endpoints: served as its own name, no key, a chat model."""
    registry({"m": {"endpoints": [URL]}})
    assert remote_models() == {"m": {"endpoints": [URL], "served_model": "m"}}
    assert cli.main(["models", "list"]) == 0
    assert f"m\topenai: {URL} as m" in capsys.readouterr().out
    assert cli.main(["models", "remove", "m"]) == 0
    assert remote_models() == {}
