"""Model names served by OpenAI-compatible endpoints: `llmdb models add NAME --endpoint URL`.

Kept beside the engine's registry of model files (remote_models.json in the same config
directory) but apart from it: the engine knows files, not URLs. An entry holds the endpoint
URLs, the served model name, whether it is a base model (base_model, only when it is) and the
NAME of the environment variable that holds the API key, never the key itself.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from llmdb.engine.registry import DEFAULT_MODEL, config_file, locked_update, registered_models

from .endpoints import base_urls

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_FIELDS = ("endpoints", "api_key_env", "served_model", "base_model")


def remote_models_file() -> Path:
    return config_file().with_name("remote_models.json")


def _read(f: Path) -> dict[str, dict[str, Any]]:
    if not f.exists():
        return {}
    try:
        models = json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"the remote model registry {f} is not valid JSON: {e}") from e
    if not isinstance(models, dict):
        raise ValueError(f"the remote model registry {f} holds {_json_type(models)}, not an "
                         "object of model names and their entries")
    for name, entry in models.items():
        _check_entry(entry, f"the remote model registry {f}, entry {name!r}")
        entry.setdefault("served_model", name)
    return models


def _check_entry(entry: Any, where: str) -> None:
    """Raises ValueError, starting with `where`, unless `entry` has the shape
    add_remote_model writes: the file is edited by hand too, and a wrong shape failed a
    later query with a KeyError or a TypeError far from its cause."""
    if not isinstance(entry, dict):
        raise ValueError(f"{where} is {_json_type(entry)}, not an object")
    unknown = sorted(entry.keys() - set(_FIELDS))
    if unknown:
        raise ValueError(f"{where} has the field {unknown[0]!r}, which is none of "
                         f"{', '.join(_FIELDS)}")
    endpoints = entry.get("endpoints")
    if not (isinstance(endpoints, list) and endpoints
            and all(isinstance(u, str) for u in endpoints)):
        what = "has no 'endpoints'" if endpoints is None else \
            f"has 'endpoints' {_json_type(endpoints)}"
        raise ValueError(f"{where} {what}: give a list of one or more endpoint URL strings")
    try:
        base_urls(endpoints)
    except ValueError as e:
        raise ValueError(f"{where}, 'endpoints': {e}") from None
    key = entry.get("api_key_env")
    if key is not None and not (isinstance(key, str) and _ENV_NAME.match(key)):
        # (its value is not repeated: it may be the key itself, pasted in)
        raise ValueError(f"{where} has an 'api_key_env' that is not the NAME of an "
                         "environment variable (letters, digits, _) or null")
    served = entry.get("served_model")
    if served is not None and not (isinstance(served, str) and served):
        raise ValueError(f"{where} has 'served_model' {_json_type(served)}: give the model "
                         "name the endpoints serve, as a string")
    if not isinstance(entry.get("base_model", False), bool):
        raise ValueError(f"{where} has 'base_model' {_json_type(entry['base_model'])}: give "
                         "true or false")


def _json_type(value: Any) -> str:
    """What a JSON value is, in words."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if value == "":
        return "an empty string"
    kinds = {dict: "an object", list: "a list", str: "a string"}
    return kinds.get(type(value), "a number")


def remote_models() -> dict[str, dict[str, Any]]:
    return _read(remote_models_file())


def add_remote_model(name: str, endpoints: list[str], api_key_env: str | None = None,
                     served_model: str | None = None, base_model: bool = False
                     ) -> dict[str, Any]:
    """Store NAME -> endpoints; a name registered as a model file cannot be reused.
    base_model: the served model has no chat template (OpenAIBackend's base_model)."""
    if name == DEFAULT_MODEL or name in registered_models():
        raise ValueError(f"{name!r} is already registered as a model file")
    if not endpoints:
        raise ValueError("give at least one --endpoint URL")
    base_urls(endpoints)  # refuses what is not an http(s) base URL, or holds credentials
    if api_key_env is not None and not _ENV_NAME.match(api_key_env):
        raise ValueError("--api-key-env takes the NAME of an environment variable (letters, "
                         "digits, _), not the key itself")
    entry = {"endpoints": [u.strip() for u in endpoints], "api_key_env": api_key_env,
             "served_model": served_model or name, **({"base_model": True} if base_model else {})}
    with locked_update(remote_models_file(), _read) as models:
        models[name] = entry
    return entry


def remove_remote_model(name: str) -> dict[str, Any]:
    """Drop NAME; returns its entry. Backends made for it keep running."""
    with locked_update(remote_models_file(), _read) as models:
        if name not in models:
            raise ValueError(f"no remote model is registered as {name!r}")
        return models.pop(name)
