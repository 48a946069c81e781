"""Every Triton kernel launch the engine makes compiles for NVIDIA GPUs, checked without one.

tests/gpu_compile.py runs the engine's steps on eight model shapes with a Triton driver that
only compiles (bf16, Triton's own ptxas); the interpreter tests (test_triton_kernels.py) run
the same kernels in fp32 and cannot see what only the compiler decides. It found two kernels
that could not compile (a float global read by Gemma's gelu and Gemma 2's softcap) and Gemma's
256-wide attention tiles needing more shared memory than an L4 has.

Two architectures: sm_90 (H100) and sm_89 (L4, RTX 4090: 99 KiB of shared memory a block).
sm_80 (A100) compiles the same pipelines as sm_89 with more shared memory, so sm_89 covers it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="triton is not installed: the GPU kernels are not compiled")

from .gpu_compile import SHAPES  # noqa: E402

SCRIPT = Path(__file__).resolve().parent / "gpu_compile.py"
ARCHS = (90, 89)
KERNELS = {"_attention_kernel", "_merge_splits_kernel", "_rope_write_kernel",
           "_rms_norm_kernel", "_add_rms_norm_kernel", "_gated_act_kernel", "_copy_rows_kernel"}


@pytest.fixture(scope="module")
def compiled() -> dict[int, list[dict]]:
    """Each architecture's records, the two compiles run side by side (one per core)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # Triton's default (it warns while unset)
    procs = {arch: subprocess.Popen([sys.executable, str(SCRIPT), "--arch", str(arch)],
                                    env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True)
             for arch in ARCHS}
    out = {}
    for arch, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=900)
        records = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
        out[arch] = records
        failed = [r for r in records if "error" in r]
        assert not failed, f"sm_{arch}: " + "\n".join(
            f"{r['shape']} {r.get('kernel', '')}: {r['error']}" for r in failed)
        assert proc.returncode == 0, stderr[-3000:]
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_every_kernel_compiles_for_every_shape(compiled, arch):
    records = compiled[arch]
    assert {r["shape"] for r in records} == set(SHAPES)
    assert {r["kernel"] for r in records} == KERNELS
    assert {r["arch"] for r in records} == {f"sm_{arch}"}


@pytest.mark.parametrize("arch", ARCHS)
def test_the_engine_reached_every_kernel_variant(compiled, arch):
    """The steps exercised each variant the models need, so a variant that cannot compile
    would have shown: split-KV, windows, softcaps, prefill and decode tiles, heads of 64 to
    256, no RoPE (OPT), per-head norms (Qwen3, Gemma 3), gelu, K/V re-projected from hidden
    states (no query heads), and bf16 tensors throughout."""
    attention = [r["constexprs"] for r in compiled[arch] if r["kernel"] == "_attention_kernel"]
    for flag in ("SPLIT", "SLIDING", "SOFTCAP"):
        assert {a[flag] for a in attention} == {False, True}, flag
    assert {a["BLOCK_M"] for a in attention} == {16, 64}
    assert {a["HEAD_DIM"] for a in attention} == {64, 96, 128, 256}
    rope = [r["constexprs"] for r in compiled[arch] if r["kernel"] == "_rope_write_kernel"]
    assert {r["HAS_ROPE"] for r in rope} == {False, True}
    assert {r["HAS_NORM"] for r in rope} == {False, True}
    assert 0 in {r["NUM_HEADS"] for r in rope}
    gated = [r["constexprs"] for r in compiled[arch] if r["kernel"] == "_gated_act_kernel"]
    assert {g["GELU"] for g in gated} == {False, True}
    assert {r["signature"]["q_ptr"] for r in compiled[arch]
            if r["kernel"] == "_attention_kernel"} == {"*bf16"}


def _compile(*args: str) -> list[dict]:
    """gpu_compile.py's records for these arguments, none of them an error."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    done = subprocess.run([sys.executable, str(SCRIPT), *args], env=env, capture_output=True,
                          text=True, timeout=900)
    records = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    failed = [f"{r['shape']} {r.get('kernel')}: {r['error']}" for r in records if "error" in r]
    assert not failed, "\n".join(failed)
    assert done.returncode == 0, done.stderr[-3000:]
    return records


def test_fp32_tiles_fit_an_l4():
    """fp32 on sm_89 (L4, A10, RTX 4090: 99 KiB of shared memory a block): with bf16's tiles
    its attention needed 115 KiB at head dim 128 and 140 KiB at 256, so every fp32 step of
    such a model failed to launch there. gpu_compile.py marks a kernel over the limit as an
    error."""
    records = _compile("--arch", "89", "--dtype", "fp32", "--shape", "qwen3-0.6b",
                       "--shape", "gemma3-1b")
    attention = [r["constexprs"] for r in records if r["kernel"] == "_attention_kernel"]
    assert {a["HEAD_DIM"] for a in attention} == {128, 256}
    assert {a["BLOCK_M"] for a in attention} == {16, 32}  # decode and prefill tiles


# Bytes a thread may spill to local memory (cuobjdump's STACK and LOCAL): none on sm_90; on
# sm_89 the 64-row prefill attention tile spills 24-80 bytes at heads of 96 to 256.
SPILL_LIMIT = {90: 0, 89: 128}


@pytest.mark.parametrize("arch", ARCHS)
def test_no_kernel_spills_its_tile(compiled, arch):
    """The hidden-cache copy kernel held a whole row of OPT-13B's hidden states (5,120
    columns padded to 8,192) in one tile and spilled 4.9 KB a thread on sm_90."""
    spilled = [f"{r['shape']} {r['kernel']} {r['constexprs']}: stack {r['stack']}, local "
               f"{r['local']}" for r in compiled[arch]
               if r["stack"] + r["local"] > SPILL_LIMIT[arch]]
    assert not spilled, "\n".join(spilled)


@pytest.mark.parametrize("arch", ARCHS)
def test_attention_is_not_specialized_on_values_that_change_per_step(compiled, arch):
    """Triton makes a constexpr of an int argument equal to 1 (and specializes multiples of
    16), so such an argument compiles variants mid-run, a second or so each. The hidden
    cache's scratch block tables are as wide as the step's longest hidden context: their
    row stride was 1 for contexts of one block."""
    per_step = {"num_seqs", "num_tokens", "num_splits", "window", "stride_bt"}
    for r in compiled[arch]:
        if r["kernel"] == "_attention_kernel":
            assert not per_step & r["constexprs"].keys(), (r["shape"], r["constexprs"])


@pytest.mark.parametrize("arch", ARCHS)
def test_batch_invariant_mode_compiles(arch):
    """LLMEngine(batch_invariant=True): every linear layer through the Triton matmul (one tile
    shape for every row count, biases on OPT, K/V re-projection from hidden states) and the
    attention in its prefill tile only, never split, in bf16 within the architecture's shared
    memory and without spills; the row-wise log-softmax and scan (kernels/gpu/rowwise.py)."""
    records = _compile("--arch", str(arch), "--batch-invariant", "--shape", "smollm2-135m",
                       "--shape", "opt-13b")
    matmuls = [r for r in records if r["kernel"] == "_matmul_kernel"]
    assert {r["signature"]["x_ptr"] for r in matmuls} == {"*bf16"}
    assert all(r["stack"] + r["local"] == 0 for r in matmuls)
    attention = [r["constexprs"] for r in records if r["kernel"] == "_attention_kernel"]
    assert {a["BLOCK_M"] for a in attention} == {64}
    assert {a["SPLIT"] for a in attention} == {False}
    # Log-probabilities of bf16 logits, and top-p's scan of fp32 ones, without spills.
    rows = [r for r in records if r["kernel"] in ("_log_softmax_kernel", "_cumsum_kernel")]
    assert {(r["kernel"], r["signature"]["x_ptr"]) for r in rows} == {
        ("_log_softmax_kernel", "*bf16"), ("_cumsum_kernel", "*fp32")}
    assert all(r["stack"] + r["local"] == 0 for r in rows)
