"""How long one engine step takes: a linear model over per-phase features of the batch.

The shape is InferMax's (Sec. 3.2): non-attention work grows with the tokens computed, decode
attention with the K/V read, prefill attention with sum(c^2 + 2cm), plus per-request and
per-phase terms. Two additions: a floor (at small batches a step costs about the time to read
the weights, whatever the FLOPs) and BROS's max(exec, swap) for steps that move cache blocks
between memory tiers. The simulator, EXPLAIN and the policies all ask this module; the
coefficients come from a preset for published hardware or from `llmdb calibrate` here.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import platformdirs

FEATURES = (
    "const",
    "tokens",
    "decode_kv",
    "decode_on",
    "n_decode",
    "prefill_attn",
    "prefill_on",
    "n_prefill",
    "prefill_m",
    "hidden_tokens",
)


@dataclass(frozen=True)
class Chunk:
    """One request's work in one step."""

    computed: int  # tokens already in its cache before this step (m)
    tokens: int  # tokens processed this step (c); 1 for a decode
    decode: bool  # True for a decode step (generating the next token)
    hidden: int = 0  # hidden-cache tokens whose K/V are re-projected this step (Apt-Serve)

    def __post_init__(self) -> None:
        if self.computed < 0 or self.tokens < 1 or self.hidden < 0:
            raise ValueError(f"a chunk needs computed >= 0, tokens >= 1, hidden >= 0: {self}")
        if self.decode and self.tokens != 1:
            raise ValueError(f"a decode processes one token, not {self.tokens}")


def features(chunks: Sequence[Chunk]) -> dict[str, float]:
    """The step's value of each feature in FEATURES (all zero for an empty step)."""
    decode_m = prefill_attn = prefill_m = 0.0
    tokens = hidden = num_decode = num_prefill = 0
    for ch in chunks:
        tokens += ch.tokens
        hidden += ch.hidden
        if ch.decode:
            num_decode += 1
            decode_m += ch.computed
        else:
            num_prefill += 1
            prefill_attn += ch.tokens * ch.tokens + 2 * ch.tokens * ch.computed
            prefill_m += ch.computed
    # InferMax's (1 + 0.1[B > 1]) factors: batched attention kernels lose ~10% against one
    # request's, on the bias and on the per-token term alike.
    decode_mult = 1.1 if num_decode > 1 else 1.0
    prefill_mult = 1.1 if num_prefill > 1 else 1.0
    return {
        "const": 1.0 if chunks else 0.0,
        "tokens": float(tokens),
        "decode_kv": decode_m * decode_mult,
        "decode_on": decode_mult if num_decode else 0.0,
        "n_decode": float(num_decode),
        "prefill_attn": prefill_attn * prefill_mult,
        "prefill_on": prefill_mult if num_prefill else 0.0,
        "n_prefill": float(num_prefill),
        "prefill_m": prefill_m,
        "hidden_tokens": float(hidden),
    }


@dataclass
class CostModel:
    name: str  # "cpu", "llama2-7b-a100", "opt13b-a100", ...
    coefficients: dict[str, float]  # seconds per unit of each feature (non-negative)
    source: str  # where the numbers come from: a calibration file, a preset's derivation
    floor_s: float = 0.0  # memory-bound floor: a non-empty step never takes less
    swap_bytes_per_s: float | None = None  # host <-> device tier bandwidth, for swaps

    def __post_init__(self) -> None:
        unknown = set(self.coefficients) - set(FEATURES)
        if unknown:
            raise ValueError(f"unknown cost-model features {sorted(unknown)}; known: {FEATURES}")
        negative = {k: v for k, v in self.coefficients.items() if v < 0}
        if negative or self.floor_s < 0:
            raise ValueError(f"cost-model coefficients must be non-negative: {negative}")
        # Missing features cost nothing; filling them here keeps step_time a plain dot product.
        self.coefficients = {f: float(self.coefficients.get(f, 0.0)) for f in FEATURES}

    def linear_time(self, chunks: Sequence[Chunk]) -> float:
        feats = features(chunks)
        return sum(self.coefficients[f] * feats[f] for f in FEATURES)

    def step_time(self, chunks: Sequence[Chunk], swap_bytes: int = 0) -> float:
        """Seconds for one step: max(floor, linear) to execute; a swap of swap_bytes runs
        alongside it, so the step takes the longer of the two (BROS)."""
        execute = max(self.floor_s, self.linear_time(chunks)) if chunks else 0.0
        if not swap_bytes:
            return execute
        if not self.swap_bytes_per_s:
            raise ValueError(f"cost model {self.name!r} has no swap bandwidth")
        return max(execute, swap_bytes / self.swap_bytes_per_s)

    @property
    def rho(self) -> float:
        """Seconds to re-project the K/V of one hidden-cache token (Apt-Serve's rho, per
        token of memory)."""
        return self.coefficients["hidden_tokens"]

    def to_dict(self) -> dict:
        return {"name": self.name, "coefficients": dict(self.coefficients),
                "source": self.source, "floor_s": self.floor_s,
                "swap_bytes_per_s": self.swap_bytes_per_s}

    @classmethod
    def from_dict(cls, d: dict) -> CostModel:
        return cls(name=d["name"], coefficients=dict(d["coefficients"]), source=d["source"],
                   floor_s=float(d.get("floor_s", 0.0)),
                   swap_bytes_per_s=d.get("swap_bytes_per_s"))


# ---- llama2-7b-a100: InferMax's own model -------------------------------------------------
# InferMax's coefficients for Llama-2-7B on one A100 (DESIGN.md, transcribed from its
# artifact), in ms per layer; times 32 layers and / 1000 for seconds per step:
#   other            = 1.91e-3 x tokens + 0.0649
#   decode attention = (8.513e-6 x sum KV read + 0.0192) x (1 + 0.1[B>1]) + 7.4e-4 x B
#   prefill attention= (1.677e-7 x sum(c^2+2cm) + 0.0926) x (1 + 0.1[n>1]) + 1.534e-3 x n
#                      + 9.224e-6 x sum m
# so const = 0.0649, decode_on = 0.0192, prefill_on = 0.0926 and so on, each x 32 / 1000.
# No floor: the model reproduces InferMax's analysis exactly, and it underestimates
# small-batch decode (a lone decode comes out at ~2.8 ms, below the ~9 ms it takes an A100 to
# read 13.5 GB of weights), so never quote absolute latencies from it.
# hidden_tokens (not in InferMax): re-projecting K and V from a hidden state is 2 x h^2 MACs
# per layer; a token's linear layers are 4 h^2 (Q, K, V, O) + 3 h x 11008 (SwiGLU MLP) MACs,
# so rho = 2 x 4096 / (4 x 4096 + 3 x 11008) = 0.1658 of the per-token "other" coefficient.
_LLAMA2_LAYERS = 32
_LLAMA2_MS_PER_LAYER = {
    "const": 0.0649,
    "tokens": 1.91e-3,
    "decode_kv": 8.513e-6,
    "decode_on": 0.0192,
    "n_decode": 7.4e-4,
    "prefill_attn": 1.677e-7,
    "prefill_on": 0.0926,
    "n_prefill": 1.534e-3,
    "prefill_m": 9.224e-6,
    "hidden_tokens": 1.91e-3 * (2 * 4096) / (4 * 4096 + 3 * 11008),
}
# PCIe 4.0 x16: 32 GB/s peak, ~25 GB/s achieved by pinned host copies.
_A100_PCIE_BYTES_PER_S = 25e9


def _llama2_7b_a100() -> CostModel:
    scale = _LLAMA2_LAYERS / 1000.0
    return CostModel(
        name="llama2-7b-a100",
        coefficients={f: v * scale for f, v in _LLAMA2_MS_PER_LAYER.items()},
        source="preset: InferMax's linear model of Llama-2-7B on one A100 (ms per layer x 32 "
               "layers); underestimates small-batch decode, no floor",
        swap_bytes_per_s=_A100_PCIE_BYTES_PER_S,
    )


# ---- opt13b-a100: a roofline of OPT-13B on one A100-40GB ----------------------------------
# Hardware: 1.5 TB/s HBM, of which we take 80% (1.2 TB/s) as achievable by streaming reads;
# 312 TFLOP/s fp16 dense, of which we take 50% (156 TFLOP/s), typical of the mix of GEMM
# shapes in a serving step. Model: 40 layers, hidden 5120, FFN 20480, vocab 50272,
# 26 GB of fp16 weights.
#   floor / const : weights / bandwidth = 26e9 / 1.2e12 = 21.7 ms; every step reads them.
#   tokens        : linear layers, 2 x 12 h^2 x 40 = 25.2 GFLOP per token / 156 TFLOP/s.
#   decode_kv     : K and V of a cached token, 2 x 40 x 5120 x 2 bytes = 819,200 B / 1.2 TB/s
#                   (its 0.8 MFLOP of attention math is negligible at 1 FLOP per byte).
#   prefill_attn  : QK^T and PV over sum_i (m + i) = (c^2 + 2cm) / 2 query-key pairs, 4h FLOPs
#                   each per layer: 2 x 5120 x 40 = 409,600 FLOPs per unit / 156 TFLOP/s.
#   prefill_m     : a chunk reads its cached prefix's K/V once: 819,200 B / 1.2 TB/s.
#   n_decode, n_prefill: the LM head of the sampled row, 2 x 5120 x 50272 FLOPs, plus the
#                   per-request overhead fitted below.
#   hidden_tokens (rho): re-projecting K and V from a hidden state, 2 x h^2 x 2 FLOPs per
#                   layer = 4.19 GFLOP per token / 156 TFLOP/s = 26.9 us.
# Fit to Apt-Serve's one published figure, "a single decode iteration with 50 requests using
# OPT-13B takes approximately 120 ms": we assume the 50 requests fill the cache memory left
# beside the weights, 12 GB (vLLM's figure for a 13B model on an A100-40GB), i.e. 14,648
# tokens, 293 of context each. The roofline alone gives 21.7 ms (weights) + 11.0 ms (KV, with
# the 1.1 multi-request factor) + 8.1 ms (FLOPs) = 40.8 ms there; no context that fits in
# memory closes the gap (even 2,048 each, 84 GB of KV, would not fit). So the remaining
# 79.2 ms is taken as per-request overhead growing with the batch, 1.58 ms per request
# (per-sequence input preparation, sampling and detokenization in a 2023 vLLM step, and
# paged attention below bandwidth at short contexts), charged to prefill requests alike.
# A lone decode then costs ~24 ms, a plausible single-stream OPT-13B step on an A100.
OPT13B_LAYERS, OPT13B_HIDDEN, OPT13B_VOCAB = 40, 5120, 50272
OPT13B_WEIGHT_BYTES = 26e9
OPT13B_KV_BYTES_PER_TOKEN = 2 * OPT13B_LAYERS * OPT13B_HIDDEN * 2
A100_BYTES_PER_S = 1.5e12 * 0.8
A100_FLOPS = 312e12 * 0.5
APT_SERVE_DECODE_BATCH, APT_SERVE_DECODE_S = 50, 0.120
APT_SERVE_KV_BYTES = 12e9
# 293 tokens of context per request: the 12 GB cache shared by 50 requests.
APT_SERVE_CONTEXT = round(APT_SERVE_KV_BYTES / OPT13B_KV_BYTES_PER_TOKEN / APT_SERVE_DECODE_BATCH)


def _opt13b_roofline() -> dict[str, float]:
    h, layers = OPT13B_HIDDEN, OPT13B_LAYERS
    kv_read = OPT13B_KV_BYTES_PER_TOKEN / A100_BYTES_PER_S
    lm_head = 2 * h * OPT13B_VOCAB / A100_FLOPS
    return {
        "const": OPT13B_WEIGHT_BYTES / A100_BYTES_PER_S,
        "tokens": 2 * 12 * h * h * layers / A100_FLOPS,
        "decode_kv": kv_read,
        "n_decode": lm_head,
        "prefill_attn": 2 * h * layers / A100_FLOPS,
        "n_prefill": lm_head,
        "prefill_m": kv_read,
        "hidden_tokens": 2 * h * h * 2 * layers / A100_FLOPS,
    }


def _opt13b_a100() -> CostModel:
    coef = _opt13b_roofline()
    probe = [Chunk(APT_SERVE_CONTEXT, 1, True)] * APT_SERVE_DECODE_BATCH
    roofline = CostModel("roofline", coef, "").linear_time(probe)
    overhead = (APT_SERVE_DECODE_S - roofline) / APT_SERVE_DECODE_BATCH
    coef["n_decode"] += overhead
    coef["n_prefill"] += overhead
    return CostModel(
        name="opt13b-a100",
        coefficients=coef,
        source=f"preset: roofline of OPT-13B on one A100-40GB (80% of 1.5 TB/s, 50% of 312 "
               f"TFLOP/s) plus {overhead * 1e3:.2f} ms per request, fitted to Apt-Serve's "
               f"~120 ms for 50 decodes at {APT_SERVE_CONTEXT} tokens of context",
        floor_s=coef["const"],
        swap_bytes_per_s=_A100_PCIE_BYTES_PER_S,
    )


# ---- cpu: this machine --------------------------------------------------------------------
# Built-in default for SmolLM2-135M in bf16 on a 2-core AVX512-BF16 CPU (torch, 2 threads),
# used until `llmdb calibrate` has written a file: the coefficients of a full calibration on
# this VM at 0e65b37 (prepacked oneDNN weights, every query through the C++ attention kernel,
# all model work on one compute thread; 2026-11-22, 66 steps x 4 passes, 2 of 266 runs
# disturbed by other load and retried; held-out MAPE 7.1% per step, training 4.7%),
# rounded. A lone decode takes ~22 ms (30 layers of small ops: overhead, not FLOPs), each
# further decode ~0.9 ms, a prefill token ~0.69 ms plus attention. It puts a 400-request
# decode step at ~90 tokens of context at ~440 ms. (Earlier calibrations the same day: lone
# decode 46 ms and prefill token 0.85 ms before these kernels; 45 ms when the calibration's
# own slot arithmetic ran off the compute thread, see engine/compute.py.)
_CPU_DEFAULT = {
    "const": 0.0193,
    "tokens": 6.92e-4,
    "decode_kv": 1.67e-6,
    "decode_on": 0.0012,
    "n_decode": 1.90e-4,
    "prefill_attn": 2.03e-7,
    "prefill_on": 0.0,
    "n_prefill": 0.0,
    "prefill_m": 1.20e-5,
    # Not measurable (no hidden cache in the engine): K/V projection's share of a token's
    # linear-layer work in SmolLM2, 6.25% of "tokens" (see calibrate.kv_projection_fraction).
    "hidden_tokens": 5.2e-5,
}
_CPU_DEFAULT_FLOOR_S = 0.022
# A host-tier copy reads and writes: half the ~26 GB/s this machine reads at.
CPU_SWAP_BYTES_PER_S = 13e9


def _cpu_default() -> CostModel:
    return CostModel(
        name="cpu",
        coefficients=dict(_CPU_DEFAULT),
        source="built-in default for a 2-core AVX512-BF16 CPU (SmolLM2-135M, bf16); run "
               "`llmdb calibrate` to measure this machine",
        floor_s=_CPU_DEFAULT_FLOOR_S,
        swap_bytes_per_s=CPU_SWAP_BYTES_PER_S,
    )


PRESETS = ("llama2-7b-a100", "opt13b-a100", "cpu")


def cost_model_path(name: str = "cpu") -> Path:
    base = os.environ.get("LLMDB_CACHE_DIR") or platformdirs.user_cache_dir("llmdb")
    return Path(base) / f"costmodel-{name}.json"


def load_cost_model(name: str | None = None) -> CostModel:
    """None or "cpu": the calibrated file if present, else the built-in default; other names
    are presets. `.source` says which."""
    if name not in (None, "cpu"):
        return preset(name)
    path = cost_model_path("cpu")
    if not path.exists():
        return _cpu_default()
    try:
        data = json.loads(path.read_text())
        model = CostModel.from_dict(data)
    except (OSError, ValueError, KeyError, TypeError) as e:
        fallback = _cpu_default()
        fallback.source += f" (the calibration file {path} is unreadable: {e})"
        return fallback
    model.source = f"calibrated {data.get('date', '?')} at {path}"
    return model


def preset(name: str) -> CostModel:
    if name == "llama2-7b-a100":
        return _llama2_7b_a100()
    if name == "opt13b-a100":
        return _opt13b_a100()
    if name == "cpu":
        return load_cost_model("cpu")
    raise ValueError(f"unknown cost model {name!r}; presets: {', '.join(PRESETS)}")
