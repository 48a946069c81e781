import os
import sys
from pathlib import Path

import pytest
import torch

# The repository's kernels/ directory is llmdb.kernels. With the repository root on sys.path
# (`python -m pytest` puts the working directory there) it is also a top-level `kernels`, which
# shadows Hugging Face's package of that name: transformers imports it (5.2x: "cannot import
# name 'CUDAProperties' from 'kernels'"). So the root leaves sys.path; pytest's importlib
# mode (pyproject.toml) does not put it back, and llmdb comes from its installed package.
_ROOT = Path(__file__).resolve().parent.parent
sys.path[:] = [p for p in sys.path if Path(p or os.curdir).resolve() != _ROOT]

# Triton reads TRITON_INTERPRET when a @triton.jit function is defined, so without a GPU the
# interpreter (CPU tensors) must be chosen before any test module imports a kernel. Setting
# it needs no triton: where triton is missing, its tests skip.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# The suite tests the CPU engine (its references: llama.cpp, transformers on the CPU) on any
# machine; tests/gpu asks for device="cuda" explicitly.
os.environ.setdefault("LLMDB_DEVICE", "cpu")

from llmdb.engine.engine import LLMEngine  # noqa: E402 (after TRITON_INTERPRET is chosen)


@pytest.fixture(scope="session")
def engine_fp32() -> LLMEngine:
    """The bundled SmolLM2-135M in fp32, where batch and chunking must not change tokens."""
    return LLMEngine("smollm2-135m", dtype="fp32", kv_cache_bytes=512 << 20)


@pytest.fixture
def engine(engine_fp32: LLMEngine):
    """The shared fp32 engine, with its scheduler limits restored and its pool checked."""
    sched = engine_fp32.scheduler
    saved = sched.max_num_batched_tokens, sched.max_num_seqs
    yield engine_fp32
    sched.max_num_batched_tokens, sched.max_num_seqs = saved
    assert not engine_fp32.has_unfinished
    assert engine_fp32.pool.num_free == engine_fp32.pool.num_blocks, "blocks leaked"


@pytest.fixture
def backends():
    """make(endpoints, **options): an openai backend of "stub-model" with short backoffs,
    closed after the test (tests/openai_stub.py serves the endpoints)."""
    from llmdb.backends.openai import OpenAIBackend

    made: list[OpenAIBackend] = []

    def make(endpoints, **kw) -> OpenAIBackend:
        b = OpenAIBackend("stub-model", endpoints, **{"backoff_s": 0.05, "max_backoff_s": 0.2,
                                                      **kw})
        made.append(b)
        return b

    yield make
    for b in made:
        b.close()


# The SQL test modules' fixtures; a module opts in with
# `pytestmark = pytest.mark.usefixtures("eng", "own_cache_dir")`.
@pytest.fixture(scope="module")
def eng():
    """The process's shared engine in fp32 (tests/sql_support.start_engine), per module."""
    from .sql_support import start_engine

    return start_engine()


@pytest.fixture
def own_cache_dir(tmp_path, monkeypatch):
    """Each test gets its own result-cache directory (the kernels stay built)."""
    from .sql_support import isolated_cache_dir

    monkeypatch.setenv("LLMDB_CACHE_DIR", str(isolated_cache_dir(tmp_path / "cache")))


@pytest.fixture
def con(eng):
    """A connection with the result cache off."""
    import llmdb

    c = llmdb.connect(cache=False)
    yield c
    c.close()
