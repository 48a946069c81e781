"""Builds and loads the C++ CPU kernels in csrc/ with ctypes.

Why not a torch C++ extension: including torch's headers makes every build take about a
minute; these kernels only need raw pointers, so a plain shared library builds in a second,
at first use, for this machine's own instruction set, and is cached by source and CPU.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from .host import cache_dir, cpu_info

SOURCES = [Path(__file__).parent / "csrc" / n
           for n in ("row_attention.cpp", "elementwise.cpp", "sampling.cpp", "cache_write.cpp")]
HEADERS = [Path(__file__).parent / "csrc" / "bf16.h"]  # (part of the build's cache key)


COMPILE_FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-std=c++17")
# The sampler's scores and the rotated Q/K must be torch's: no reassociation, no reciprocal
# for a division, no approximate logarithm, no multiply-add torch does not do.
EXACT_SOURCES = {"sampling.cpp", "cache_write.cpp"}


@functools.cache
def load_library() -> ctypes.CDLL | None:
    """The compiled kernels, or None where no C++ compiler is available."""
    if os.environ.get("LLMDB_NO_CPP_KERNELS"):
        return None
    compiler = shutil.which(os.environ.get("CXX", "g++")) or shutil.which("c++")
    if compiler is None or not all(s.exists() for s in SOURCES + HEADERS):
        return None
    source_bytes = b"".join(s.read_bytes() for s in SOURCES + HEADERS)
    cpu = cpu_info()  # -march=native: a build is this CPU's own
    cpu_key = " ".join([cpu.model, *sorted(cpu.flags)]).encode()
    flags = " ".join([*COMPILE_FLAGS, *sorted(EXACT_SOURCES)]).encode()
    key = hashlib.sha256(source_bytes + cpu_key + flags).hexdigest()[:16]
    lib_path = cache_dir() / "kernels" / f"llmdb_kernels_{key}.so"
    if not lib_path.exists():
        lib_path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=lib_path.parent) as tmp:
            out = Path(tmp) / lib_path.name
            objects = [str(Path(tmp) / f"{s.stem}.o") for s in SOURCES]
            # Compiled with -ffast-math, linked without it: at link time GCC adds
            # crtfastmath.o, whose constructor turns on flush-to-zero in the thread that
            # loads the library, the user's (their subnormal floats would become 0).
            compiles = [[compiler, *COMPILE_FLAGS, *(["-fno-fast-math"]
                                                    if s.name in EXACT_SOURCES else []),
                         "-c", str(s), "-o", o] for s, o in zip(SOURCES, objects, strict=True)]
            # The sources compile side by side (the attention kernel's fixed shapes take
            # most of the build), then link.
            procs = [subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                      text=True) for cmd in compiles]
            stderr = [p.communicate()[1] for p in procs]
            errors = [err for p, err in zip(procs, stderr, strict=True) if p.returncode]
            if not errors:
                link = subprocess.run([compiler, "-shared", "-fopenmp", *objects, "-o", str(out)],
                                      capture_output=True, text=True)
                errors = [link.stderr] if link.returncode else []
            if errors:
                raise RuntimeError("building the C++ kernels failed:\n" + "\n".join(errors))
            os.replace(out, lib_path)  # atomic: concurrent builders never see half a file
    lib = ctypes.CDLL(str(lib_path))
    args = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 6 + [
        ctypes.c_float, ctypes.c_int64, ctypes.c_float, ctypes.c_int, ctypes.c_void_p]
    for name in ("llmdb_row_attention_f32", "llmdb_row_attention_bf16"):
        getattr(lib, name).argtypes = args
        getattr(lib, name).restype = None
    for name in ("llmdb_rms_norm_bf16", "llmdb_rms_norm_f32"):
        getattr(lib, name).argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 2 + [
            ctypes.c_float, ctypes.c_int]
        getattr(lib, name).restype = None
    for name in ("llmdb_silu_mul_bf16", "llmdb_silu_mul_f32"):
        getattr(lib, name).argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2 + [
            ctypes.c_int]
        getattr(lib, name).restype = None
    for name in ("llmdb_gumbel_argmax_bf16", "llmdb_gumbel_argmax_f32"):
        getattr(lib, name).argtypes = [ctypes.c_void_p] + [ctypes.c_int64] * 3 + [
            ctypes.c_void_p] * 6 + [ctypes.c_float] * 2 + [ctypes.c_void_p, ctypes.c_int]
        getattr(lib, name).restype = None
    for name in ("llmdb_row_max_bf16", "llmdb_row_max_f32"):
        getattr(lib, name).argtypes = [ctypes.c_void_p] + [ctypes.c_int64] * 3 + [
            ctypes.c_void_p] * 2 + [ctypes.c_int]
        getattr(lib, name).restype = None
    for name in ("llmdb_rope_write_kv_bf16", "llmdb_rope_write_kv_f32"):
        getattr(lib, name).argtypes = [ctypes.c_void_p] * 8 + [ctypes.c_int64] * 6 + [
            ctypes.c_int]
        getattr(lib, name).restype = None
    return lib


@functools.cache
def supports_shape(heads: int, kv_heads: int, dim: int) -> bool:
    """The kernel keeps a query group and a head in fixed-size stack arrays."""
    lib = load_library()
    return (lib is not None and heads % kv_heads == 0
            and heads // kv_heads <= lib.llmdb_max_group() and dim <= lib.llmdb_max_dim())


def _check_cpu(*tensors: torch.Tensor) -> None:
    """The kernels read raw host pointers: a tensor elsewhere would be read as garbage."""
    bad = [t.device for t in tensors if t.device.type != "cpu"]
    if bad:
        raise ValueError(f"the C++ CPU kernels got a tensor on {bad[0]}")


def row_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int, scale: float,
    out: torch.Tensor, window: int = 0, softcap: float = 0.0,
) -> None:
    """out[r] = softmax(q[r] K_r^T * scale) V_r for each query row r, in place: a decode, or
    one position of a prefill chunk, with its own block table and number of visible keys
    (of which a window > 0 keeps the last `window`; softcap > 0 caps the scaled scores as
    softcap * tanh(s / softcap)).

    q, out [R, H, D] contiguous; caches [slots, KVH, D]; block_tables [R, max_blocks] int64;
    context_lens [R] int64."""
    _check_cpu(q, k_cache, v_cache, block_tables, context_lens, out)
    lib = load_library()
    fn = {torch.float32: lib.llmdb_row_attention_f32,
          torch.bfloat16: lib.llmdb_row_attention_bf16}[q.dtype]
    s, h, d = q.shape
    fn(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
       context_lens.data_ptr(), s, h, k_cache.shape[1], d, block_size, block_tables.shape[1],
       scale, window, softcap, torch.get_num_threads(), out.data_ptr())


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Contiguous bf16 or fp32 x [rows, dim] -> [rows, dim] of its dtype, weight of the same
    dtype; see csrc/elementwise.cpp."""
    _check_cpu(x, weight)
    lib = load_library()
    fn = {torch.float32: lib.llmdb_rms_norm_f32, torch.bfloat16: lib.llmdb_rms_norm_bf16}[x.dtype]
    out = torch.empty_like(x)
    fn(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], eps,
       torch.get_num_threads())
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """Contiguous bf16 or fp32 [rows, 2 * ffn] -> silu(gate) * up [rows, ffn] of its dtype."""
    _check_cpu(gate_up)
    lib = load_library()
    fn = {torch.float32: lib.llmdb_silu_mul_f32,
          torch.bfloat16: lib.llmdb_silu_mul_bf16}[gate_up.dtype]
    rows, ffn = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(rows, ffn, dtype=gate_up.dtype)
    fn(gate_up.data_ptr(), out.data_ptr(), rows, ffn, torch.get_num_threads())
    return out


def gumbel_argmax(logits: torch.Tensor, top: torch.Tensor, top_ids: torch.Tensor,
                  temperature: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor,
                  keys: torch.Tensor, g_max: float, u_max: float) -> torch.Tensor:
    """Tokens [N] int64 drawn from bf16 or fp32 logits [N, V] (rows contiguous): per row the
    argmax of (logit - top) / temperature plus the noise of (key, token id) over the tokens
    top-k and then top-p keep (top_k 0 and top_p >= 1: all), where top and top_ids are the
    rows' maxima [N] fp32 and their ids; see csrc/sampling.cpp."""
    _check_cpu(logits, top, top_ids, temperature, top_p, top_k, keys)
    fn = {torch.float32: load_library().llmdb_gumbel_argmax_f32,
          torch.bfloat16: load_library().llmdb_gumbel_argmax_bf16}[logits.dtype]
    if logits.stride(-1) != 1:
        raise ValueError("gumbel_argmax reads each row of logits contiguously")
    top, temperature = top.float().contiguous(), temperature.float().contiguous()
    top_p = top_p.float().contiguous()
    top_ids, keys = top_ids.long().contiguous(), keys.long().contiguous()
    top_k = top_k.long().contiguous()
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    fn(logits.data_ptr(), logits.shape[0], logits.shape[1], logits.stride(0), top.data_ptr(),
       top_ids.data_ptr(), temperature.data_ptr(), top_p.data_ptr(), top_k.data_ptr(),
       keys.data_ptr(), g_max, u_max, out.data_ptr(), torch.get_num_threads())
    return out


def row_max(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of bf16 or fp32 logits [N, V] (rows contiguous): the largest value (fp32) and
    the first index holding it, NaN first where a row has one, as torch's max(-1) gives."""
    _check_cpu(logits)
    if logits.stride(-1) != 1:
        raise ValueError("row_max reads each row of logits contiguously")
    fn = {torch.float32: load_library().llmdb_row_max_f32,
          torch.bfloat16: load_library().llmdb_row_max_bf16}[logits.dtype]
    top = torch.empty(logits.shape[0], dtype=torch.float32)
    ids = torch.empty(logits.shape[0], dtype=torch.int64)
    fn(logits.data_ptr(), logits.shape[0], logits.shape[1], logits.stride(0), top.data_ptr(),
       ids.data_ptr(), torch.get_num_threads())
    return top, ids


def rope_write_kv(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor | None,
                  sin: torch.Tensor | None, slots: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, heads: int, kv_heads: int, written: int
                  ) -> torch.Tensor:
    """Q [T, heads, D] rotated, from the contiguous projection qkv [T, (heads + 2 kv_heads) *
    D]; rows below `written` also write their rotated K and their V into slot slots[r] of
    the caches [slots, kv_heads, D]. cos, sin: fp32 [positions, R/2] tables (None: no
    rotation). See csrc/cache_write.cpp."""
    _check_cpu(qkv, positions, slots, k_cache, v_cache, *([cos, sin] if cos is not None else []))
    fn = {torch.float32: load_library().llmdb_rope_write_kv_f32,
          torch.bfloat16: load_library().llmdb_rope_write_kv_bf16}[qkv.dtype]
    rows, dim = qkv.shape[0], k_cache.shape[-1]
    q = torch.empty(rows, heads, dim, dtype=qkv.dtype)
    half = 0 if cos is None else cos.shape[-1]
    table = (0, 0) if cos is None else (cos.data_ptr(), sin.data_ptr())
    fn(qkv.data_ptr(), positions.data_ptr(), *table, slots.data_ptr(), k_cache.data_ptr(),
       v_cache.data_ptr(), q.data_ptr(), rows, written, heads, kv_heads, dim, half,
       torch.get_num_threads())
    return q
