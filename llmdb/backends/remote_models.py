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


def remote_models_file() -> Path:
    return config_file().with_name("remote_models.json")


def _read(f: Path) -> dict[str, dict[str, Any]]:
    if not f.exists():
        return {}
    try:
        return json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"the remote model registry {f} is not valid JSON: {e}") from e


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
