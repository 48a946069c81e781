"""Open a model (GGUF file or HF directory) into config, fp32 weights and tokenizer.

Dequantizing a GGUF takes seconds; the result is cached on disk as safetensors, keyed by
the file's content hash, so later starts only map the cached file.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import platformdirs
import torch
from safetensors.torch import load_file, save_file

from .config import ModelConfig
from .errors import ModelLoadError
from .gguf_file import read_gguf_metadata, read_gguf_weights
from .hf_dir import read_hf_metadata, read_hf_weights
from .tokenizer import ModelTokenizer


@dataclass
class LoadedModel:
    path: Path
    config: ModelConfig
    tokenizer: ModelTokenizer
    weights: dict[str, torch.Tensor]  # HF names and layout, fp32
    fingerprint: str  # sha256 of the weight files' bytes


def cache_dir() -> Path:
    return Path(os.environ.get("LLMDB_CACHE_DIR") or platformdirs.user_cache_dir("llmdb"))


def _fingerprint(files: list[Path]) -> str:
    h = hashlib.sha256()
    for f in files:
        with open(f, "rb") as fh:
            while chunk := fh.read(1 << 22):
                h.update(chunk)
    return h.hexdigest()


def load_model(path: str | Path) -> LoadedModel:
    path = Path(path)
    if not path.exists():
        raise ModelLoadError(f"model path {path} does not exist")
    if path.is_dir():
        config, tokenizer = read_hf_metadata(path)
        files = sorted(path.glob("*.safetensors"))
        weights = read_hf_weights(path)
        return LoadedModel(path, config, tokenizer, weights, _fingerprint(files))
    config, tokenizer = read_gguf_metadata(path)
    fingerprint = _fingerprint([path])
    cached = cache_dir() / "weights" / f"{fingerprint}.safetensors"
    if cached.exists():
        try:
            return LoadedModel(path, config, tokenizer, load_file(str(cached)), fingerprint)
        except Exception:
            cached.unlink(missing_ok=True)  # a damaged cache entry is rebuilt, not fatal
    weights = read_gguf_weights(path, config)
    cached.parent.mkdir(parents=True, exist_ok=True)
    tmp = cached.with_suffix(f".{os.getpid()}.tmp")
    save_file(weights, str(tmp))
    os.replace(tmp, cached)  # atomic: concurrent starts never see half a file
    return LoadedModel(path, config, tokenizer, weights, fingerprint)
