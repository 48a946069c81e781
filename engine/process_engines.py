"""One engine per model per process, stepping on a background thread.

Every caller in the process (SQL functions on DuckDB's worker threads, DataFrame calls,
several connections) shares it, so batches form across callers and the model is loaded once.
"""

from __future__ import annotations

import threading
from typing import Any

from .device import resolve_device
from .engine import LLMEngine, _parse_dtype

_engines: dict[str, tuple[LLMEngine, dict[str, Any]]] = {}
_lock = threading.Lock()


def _normalized(options: dict[str, Any]) -> dict[str, Any]:
    out = dict(options)
    device = resolve_device(out.get("device", "auto"))
    if "device" in out:
        out["device"] = device
    if "dtype" in out:
        out["dtype"] = _parse_dtype(out["dtype"], device)
    return out


def shared_engine(model: str = "smollm2-135m", **options: Any) -> LLMEngine:
    """The process's engine for `model`, started on first use with `options`.

    Options that contradict the running engine raise instead of silently starting a second
    copy of the model."""
    wanted = _normalized(options)
    with _lock:
        if model in _engines:
            engine, started_with = _engines[model]
            effective = {**started_with, "dtype": engine.dtype, "device": engine.device}
            clash = {k: v for k, v in wanted.items() if k in effective and effective[k] != v}
            clash.update({k: v for k, v in wanted.items()
                          if k not in effective and v is not None})
            if clash:
                have = ", ".join(f"{k}={effective.get(k, 'default')}" for k in clash)
                want = ", ".join(f"{k}={v}" for k, v in clash.items())
                raise ValueError(
                    f"the {model} engine of this process already runs with {have}; "
                    f"it cannot also run with {want} (one engine per model per process)"
                )
            return engine
        engine = LLMEngine(model, **options)
        engine.start_background_loop()
        _engines[model] = (engine, wanted)
        return engine


def shutdown_engines() -> None:
    with _lock:
        for engine, _ in _engines.values():
            engine.stop_background_loop()
        _engines.clear()
