"""Compile every Triton kernel the engine launches, for an NVIDIA GPU, on a machine without one.

CI has no GPU: tests/test_triton_kernels.py runs the kernels in Triton's interpreter, in fp32.
That checks their arithmetic, not that they compile: bf16 and fp16 types, tl.dot's layouts,
shared memory and registers are decided by Triton's compiler and ptxas only, and a kernel the
interpreter runs can still fail to compile or need more shared memory than a GPU has.

So this runs the engine on the CPU with its Triton kernels (attention="triton"), in the dtype
the GPU would use, with Triton's driver replaced by one that compiles each launch for the given
architecture and launches nothing. Triton compiles to a cubin with the ptxas it ships, and
cuobjdump (shipped too) reads the cubin's registers and spills. The engine's steps are real:
chunked prefills, decode steps through (emulated) CUDA graphs with split-KV for the target's SM
count, hidden-cache requests beside KV ones where the model has the hidden cache. Every kernel
output is left unwritten, so the tokens are meaningless; only what compiles is checked.

Models: bench/random_model.py's shapes, cut to a few layers (every kind of layer the model
has), with zero weights made in memory (only shapes decide what compiles; nothing is written
or read but config.json and the tokenizer).

Usage (TRITON_INTERPRET must be unset): python tests/gpu_compile.py --arch 90 [--dtype bf16]
[--shape NAME ...] [--batch-invariant] (the engine's batch-invariant mode: its Triton matmul
for every linear layer, one attention tile, kernels/gpu/rowwise.py's log-softmax and scan).
One JSON line per compiled kernel; exit 1 if any failed to compile or asks for more shared
memory than the architecture has.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import random_model  # noqa: E402

# Dynamic shared memory a block may opt into, and SM counts (the split-KV choice depends on
# them), from NVIDIA's CUDA C Programming Guide (compute capabilities table) and the GPUs'
# data sheets.
ARCHS = {
    70: {"gpu": "V100", "max_shared": 96 * 1024, "sms": 80},
    75: {"gpu": "T4", "max_shared": 64 * 1024, "sms": 40},
    80: {"gpu": "A100", "max_shared": 163 * 1024, "sms": 108},
    86: {"gpu": "A10 / RTX 3090", "max_shared": 99 * 1024, "sms": 72},
    89: {"gpu": "L4 / L40S / RTX 4090", "max_shared": 99 * 1024, "sms": 58},
    90: {"gpu": "H100", "max_shared": 227 * 1024, "sms": 132},
}
# Layers kept per shape: enough for each kind of layer (Gemma 3: five windowed, then global).
SHAPES = {"smollm2-135m": 1, "llama3.2-1b": 1, "qwen3-0.6b": 1, "phi3-mini": 1,
          "llama2-7b": 1, "opt-13b": 1, "gemma2-2b": 2, "gemma3-1b": 6}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class CompileOnlyDriver:
    """What Triton's launcher asks of its driver before it compiles (a device, a stream, the
    target); with warmup it stops there, so nothing needs a GPU."""

    def __init__(self, target) -> None:
        self.target = target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device=None) -> int:
        return 0

    def get_current_target(self):
        return self.target


def _resources(cubin: bytes) -> dict[str, int]:
    """REG, STACK, SHARED (static) and LOCAL (spills) of the cubin's kernel, per cuobjdump."""
    import triton.backends.nvidia as nvidia

    tool = Path(nvidia.__file__).parent / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([str(tool), "--dump-resource-usage", f.name], check=True,
                              capture_output=True, text=True).stdout
    line = next(s for s in text.splitlines() if "REG:" in s)
    fields = dict(part.split(":", 1) for part in line.split())
    return {k.lower(): int(fields[k]) for k in ("REG", "STACK", "SHARED", "LOCAL")}


class Recorder:
    """Replaces JITFunction.run: compiles each new specialization for the target, launches
    nothing, and keeps one record per compiled kernel."""

    def __init__(self, arch: int) -> None:
        self.arch, self.shape, self.records = arch, "", []
        self.compiling: str | None = None  # the kernel being compiled (named if it fails)
        self._seen: set[int] = set()

    def install(self) -> None:
        from triton.runtime.jit import JITFunction

        run, recorder = JITFunction.run, self

        def compile_only(fn, *args, grid, warmup, **kwargs):
            recorder.compiling = fn.__name__
            t0 = time.perf_counter()
            kernel = run(fn, *args, grid=grid, warmup=True, **kwargs)
            if id(kernel) not in recorder._seen:
                recorder._seen.add(id(kernel))
                recorder.add(fn, kernel, time.perf_counter() - t0)
            recorder.compiling = None
            return kernel

        JITFunction.run = compile_only

    def add(self, fn, kernel, seconds: float) -> None:
        src, meta = kernel.src, kernel.metadata
        # (ASTSource keys a constexpr by its argument's index path: (i,))
        consts = {fn.arg_names[k[0]] if isinstance(k, tuple) else k: v
                  for k, v in src.constants.items()}
        self.records.append({
            "kernel": fn.__name__, "shape": self.shape, "arch": f"sm_{self.arch}",
            "constexprs": consts,
            "signature": {k: v for k, v in src.signature.items() if v != "constexpr"},
            "num_warps": meta.num_warps, "num_stages": meta.num_stages,
            "dynamic_shared": meta.shared, **_resources(kernel.asm["cubin"]),
            "compile_s": round(seconds, 2),
        })


def _zero_weights(shape: random_model.Shape, dtype: torch.dtype):
    """loader.read_hf_weights' stand-in: every tensor of the shape, zeros, made in memory."""
    def read(path: Path) -> dict[str, torch.Tensor]:
        return {name: torch.zeros(dims, dtype=dtype)
                for name, dims in random_model.tensor_shapes(shape).items()}
    return read


def skip_dense_linears() -> None:
    """Linear layers outside the batch-invariant mode are torch's (cuBLAS on a GPU): no Triton
    kernel, and with nothing launched their results are never read. Computed anyway, in bf16
    on a CPU without native bf16, they took most of the run (a 7B or 13B layer's GEMMs and a
    vocabulary projection a step), so they return an uninitialized tensor of their shape: the
    layout a Triton kernel downstream sees is the same."""
    from llmdb.kernels.linear import Linear

    compute = Linear.__call__

    def shaped_only(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        if self.invariant_matmul is not None:  # the Triton matmul: compiled, as the rest
            return compute(self, x, out)
        return out if out is not None else x.new_empty(x.shape[0], self.out_features)

    Linear.__call__ = shaped_only


def run_shape(name: str, layers: int, dtype: torch.dtype, arch: int, root: Path,
              batch_invariant: bool = False) -> None:
    """The engine's steps on one model: chunked prefills beside decodes, decode steps through
    emulated CUDA graphs (split-KV where few sequences run), hidden-cache requests."""
    from llmdb.engine import cuda_graphs
    from llmdb.engine.cuda_graphs import StepGraphs
    from llmdb.engine.engine import LLMEngine
    from llmdb.engine.models import loader
    from llmdb.engine.params import SamplingParams

    shape = replace(random_model.SHAPES[name], layers=layers)
    path = root / name
    path.mkdir(parents=True, exist_ok=True)
    random_model.write_metadata(shape, path, dtype)
    loader.read_hf_weights = _zero_weights(shape, dtype)
    loader.hf_tensor_shapes = lambda path: {  # (no files to read the headers of)
        name: list(dims) for name, dims in random_model.tensor_shapes(shape).items()}
    loader.weight_files = lambda path: []  # (nor any to fingerprint)
    cuda_graphs._num_sms = lambda device: ARCHS[arch]["sms"]
    engine = LLMEngine(str(path), device="cpu", dtype=str(dtype).removeprefix("torch."),
                       attention="triton", cuda_graphs=False, kv_cache_bytes=256 << 20,
                       max_num_seqs=8, max_num_batched_tokens=64,
                       batch_invariant=batch_invariant)
    engine.runner.graphs = StepGraphs(engine.runner, 8, emulate=True)
    engine.runner.graphs.capture_all()
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    # 300 tokens: prefill chunks over a cached prefix, then decodes over 19 blocks (splits).
    prompts = [[5 + i % 50 for i in range(300)], [7] * 9, [9] * 2]
    ids = [engine.add_request(p, params) for p in prompts]
    if batch_invariant:
        from llmdb.kernels.gpu import rowwise

        # Log-probabilities by rowwise.log_softmax; top-p's sums by rowwise.cumsum, which
        # only a GPU's sampler calls (the CPU's draws in C++): called here.
        ids.append(engine.add_request([11] * 5, SamplingParams(max_tokens=2, logprobs=2)))
        rowwise.cumsum(torch.zeros(2, engine.config.vocab_size))
    if engine.hidden_cache:  # one request keeps hidden states instead of K/V (Apt-Serve)
        engine._requests[ids[1]].cache_type = "hidden"
    while engine.has_unfinished:
        engine.step()
    for i in ids:
        engine.wait(i)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", type=int, default=90, choices=sorted(ARCHS))
    ap.add_argument("--dtype", default="bf16", choices=list(DTYPES))
    ap.add_argument("--shape", action="append", choices=list(SHAPES),
                    help="a shape to run (repeatable; default: all)")
    ap.add_argument("--batch-invariant", action="store_true",
                    help="run the engine with batch_invariant=True")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        ap.error("TRITON_INTERPRET=1 runs kernels in the interpreter: unset it")
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver

    driver.set_active(CompileOnlyDriver(GPUTarget("cuda", args.arch, 32)))
    recorder = Recorder(args.arch)
    recorder.install()
    skip_dense_linears()
    limit = ARCHS[args.arch]["max_shared"]
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.shape or list(SHAPES):
            recorder.shape, done = name, len(recorder.records)
            try:
                run_shape(name, SHAPES[name], DTYPES[args.dtype], args.arch, Path(tmp),
                          args.batch_invariant)
            except Exception as exc:  # noqa: BLE001 (reported as the shape's error)
                recorder.records.append({"shape": name, "kernel": recorder.compiling,
                                         "error": f"{type(exc).__name__}: {exc}"[:2000]})
            for rec in recorder.records[done:]:
                rec["dtype"] = args.dtype
                need = rec.get("dynamic_shared", 0) + rec.get("shared", 0)
                if "error" not in rec and need > limit:
                    rec["error"] = (f"needs {need} bytes of shared memory a block; "
                                    f"sm_{args.arch} has {limit}")
                failed += "error" in rec
                print(json.dumps({"name": "gpu_compile", **rec}), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
