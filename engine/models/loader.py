"""Open a model (GGUF file or HF directory) into config, weights and tokenizer.

Dequantizing a GGUF and parsing its tokenizer metadata take seconds; both are cached on
disk (safetensors and JSON), keyed by the file's content hash, so later starts only read
the cached files.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer

from llmdb.kernels.host import cache_dir

from .config import ModelConfig
from .errors import ModelLoadError
from .gguf_file import gguf_files, read_gguf_metadata, read_gguf_weights
from .hf_dir import hf_tensor_shapes, read_hf_metadata, read_hf_weights, weight_files
from .shapes import check_shapes
from .tokenizer import ModelTokenizer


@dataclass
class LoadedModel:
    path: Path
    config: ModelConfig
    tokenizer: ModelTokenizer
    weights: dict[str, torch.Tensor]  # HF names and layout; fp32 from GGUF, as stored from HF
    fingerprint: str  # sha256 of the weight files' bytes


def _fingerprint(files: list[Path]) -> str:
    """sha256 of the files' bytes, remembered by path, size and modification time: hashing a
    7B model's 13 GB takes most of a start-up, and its files do not change between starts."""
    stamp = json.dumps([[str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns]
                        for f in files])
    memo = cache_dir() / "fingerprints" / (hashlib.sha256(stamp.encode()).hexdigest() + ".txt")
    if memo.exists():
        return memo.read_text().strip()
    h = hashlib.sha256()
    for f in files:
        with open(f, "rb") as fh:
            while chunk := fh.read(1 << 22):
                h.update(chunk)
    digest = h.hexdigest()
    memo.parent.mkdir(parents=True, exist_ok=True)
    _atomic_write(memo, lambda tmp: tmp.write_text(digest))
    return digest


def check_model(path: str | Path) -> ModelConfig:
    """The config of a loadable model, read from its metadata alone (no weights): a GGUF file
    or a Hugging Face directory with config.json, tokenizer.json and safetensors. Raises
    ModelLoadError naming what is wrong otherwise (`llmdb models add` runs this)."""
    path = Path(path)
    if not path.exists():
        raise ModelLoadError(f"model path {path} does not exist")
    if path.is_dir():
        config, _ = read_hf_metadata(path)
        _check_shapes(path, hf_tensor_shapes(path), config)
        return config
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ModelLoadError(f"{path} is neither a GGUF file nor a model directory")
    return read_gguf_metadata(path)[0]


def load_model(path: str | Path) -> LoadedModel:
    path = Path(path)
    if not path.exists():
        raise ModelLoadError(f"model path {path} does not exist")
    if path.is_dir():
        config, tokenizer = read_hf_metadata(path)
        _check_shapes(path, hf_tensor_shapes(path), config)  # (before reading gigabytes)
        weights = read_hf_weights(path)
        return LoadedModel(path, config, tokenizer, weights, _fingerprint(weight_files(path)))
    fingerprint = _fingerprint(gguf_files(path))
    cached = cache_dir() / "weights" / f"{fingerprint}.safetensors"
    meta = cached.with_suffix(".json")
    if cached.exists() and meta.exists():
        try:
            config, tokenizer = _read_meta(meta)
            return LoadedModel(path, config, tokenizer, load_file(str(cached)), fingerprint)
        except Exception:  # a damaged cache entry is rebuilt, not fatal
            cached.unlink(missing_ok=True)
    config, tokenizer = read_gguf_metadata(path)
    weights = read_gguf_weights(path, config)  # (shapes checked with the metadata)
    cached.parent.mkdir(parents=True, exist_ok=True)
    # Weights first, metadata last: a half-written entry is never taken for a whole one.
    _atomic_write(cached, lambda tmp: save_file(weights, str(tmp)))
    _atomic_write(meta, lambda tmp: tmp.write_text(_meta_json(config, tokenizer)))
    return LoadedModel(path, config, tokenizer, weights, fingerprint)


def _check_shapes(path: Path, shapes: dict, config: ModelConfig) -> None:
    try:
        check_shapes(shapes, config)
    except ModelLoadError as e:
        raise ModelLoadError(f"{path}: {e}") from None


def _atomic_write(target: Path, write) -> None:
    tmp = target.with_suffix(f".{os.getpid()}.tmp")
    write(tmp)
    os.replace(tmp, target)  # atomic: concurrent starts never see half a file


def _meta_json(config: ModelConfig, tokenizer: ModelTokenizer) -> str:
    return json.dumps({
        "config": dataclasses.asdict(config),
        "tokenizer": tokenizer.tokenizer.to_str(),
        "chat_template": tokenizer.chat_template,
        "bos_token": tokenizer.bos_token,
        "eos_token": tokenizer.eos_token,
        "add_bos": tokenizer.add_bos,
        "add_eos": tokenizer.add_eos,
        "spm_space_prefix": tokenizer.spm_space_prefix,
    })


def _read_meta(path: Path) -> tuple[ModelConfig, ModelTokenizer]:
    meta = json.loads(path.read_text())
    cfg = meta["config"]
    for key in ("eos_token_ids", "rope_divisors", "rope_long_divisors", "layer_windows",
                "rope_local_layers", "nope_layers"):
        cfg[key] = tuple(cfg.get(key, ()))  # (JSON has lists, not tuples)
    tokenizer = ModelTokenizer(
        tokenizer=Tokenizer.from_str(meta["tokenizer"]),
        chat_template=meta["chat_template"],
        bos_token=meta["bos_token"],
        eos_token=meta["eos_token"],
        add_bos=meta["add_bos"],
        add_eos=meta.get("add_eos", False),  # (absent from entries written before them)
        spm_space_prefix=meta.get("spm_space_prefix"),
    )
    return ModelConfig(**cfg), tokenizer
