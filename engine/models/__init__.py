"""Models: config, loaders (GGUF, HF directories), tokenizer, and the decoders.

The loaders (and torch with them) load on first use (PEP 562), so that code which only needs
a ModelConfig (the cost model, the simulator, EXPLAIN) does not load torch."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .config import ModelConfig
from .errors import ModelLoadError

_LAZY = {"LoadedModel": ".loader", "load_model": ".loader", "ModelTokenizer": ".tokenizer"}

if TYPE_CHECKING:
    from .loader import LoadedModel, load_model
    from .tokenizer import ModelTokenizer


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name], __name__), name)
    globals()[name] = value
    return value


__all__ = ["LoadedModel", "ModelConfig", "ModelLoadError", "ModelTokenizer", "load_model"]
