"""Backends run model calls for llmdb; every backend speaks the contract in base.py."""

from .base import (
    Backend,
    BackendResult,
    ChoiceRequest,
    GenerationRequest,
    ModelRequest,
    Prompt,
    ScoreRequest,
)
from .local import LocalBackend, local_backend

__all__ = [
    "Backend",
    "BackendResult",
    "ChoiceRequest",
    "GenerationRequest",
    "LocalBackend",
    "ModelRequest",
    "Prompt",
    "ScoreRequest",
    "local_backend",
]
