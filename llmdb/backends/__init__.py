"""Backends run model calls for llmdb; every backend speaks the contract in base.py.

The in-process engine's backend is `llmdb.backends.local` (imported where used: it loads
torch, which the hash stand-in backend and EXPLAIN's simulation do not need)."""

from .base import (
    Backend,
    BackendResult,
    ChoiceRequest,
    GenerationRequest,
    ModelRequest,
    Prompt,
    RequestTokens,
    ScoreRequest,
    Simulation,
)

__all__ = [
    "Backend",
    "BackendResult",
    "ChoiceRequest",
    "GenerationRequest",
    "ModelRequest",
    "Prompt",
    "RequestTokens",
    "ScoreRequest",
    "Simulation",
]
