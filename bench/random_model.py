"""Write a Hugging Face model directory with seeded random weights of a real model's shape.

GPU benchmarks need the published shapes (SmolLM2-135M, Llama-3.2-1B, Llama-2-7B, OPT-125M,
OPT-1.3B, OPT-13B, Qwen2.5, Qwen3, Phi-3-mini, Gemma 2 and 3), but the GPU machine has no
internet and the real checkpoints are too large to carry.
Speed does not depend on the weight values, so a directory with random weights of the right
shape serves every engine (ours, transformers, the bare decoder) with the same bytes.

The directory holds config.json, generation_config.json, safetensors shards (with an index
json above one shard, as Hugging Face writes them), tokenizer.json and tokenizer_config.json,
so that both `llmdb.engine.models.load_model` and `transformers.AutoModelForCausalLM` open it.
A `random_model.json` marker, written last, says what was generated; a directory with a
matching marker is reused instead of rewritten.

Usage: python bench/random_model.py --shape llama3.2-1b OUT_DIR [--seed 0] [--dtype bf16]

This file imports neither llmdb nor transformers: it runs on a bare torch install.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, models, pre_tokenizers

STD = 0.02  # small enough that 40 layers of bf16 residual stream stay finite
MAX_SHARD_BYTES = 2 << 30
MARKER = "random_model.json"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
PHI3_CHAT = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + '<|end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}"
)


@dataclass(frozen=True)
class Shape:
    """One model's published dimensions and special tokens (what config.json needs)."""

    # "llama", "qwen2" (Llama with Q/K/V biases), "qwen3" (per-head Q/K norms), "phi3" (fused
    # Q/K/V and gate/up, LongRoPE), "gemma2", "gemma3", "opt"
    arch: str
    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    max_pos: int
    bos: int
    eos: int
    pad: int | None
    specials: dict[int, str]  # id -> token text
    add_bos: bool
    tie: bool = True
    head_dim: int | None = None
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    chat_template: str | None = None
    rope_scaling: dict | None = None  # config.json's, as published
    # config.json's keys beyond Llama's (Gemma's windows, softcaps, attention scale, Phi-3's
    # pretrained context, ...)
    extra: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def dim(self) -> int:
        return self.head_dim or self.hidden // self.heads


_LLAMA2_SPECIALS = {0: "<unk>", 1: "<s>", 2: "</s>"}
_OPT_SPECIALS = {0: "<s>", 1: "<pad>", 2: "</s>", 3: "<unk>"}
_GEMMA_SPECIALS = {0: "<pad>", 1: "<eos>", 2: "<bos>", 3: "<unk>", 105: "<start_of_turn>",
                   106: "<end_of_turn>"}


def _longrope(rotary_dim: int, stretch: float) -> dict:
    """A LongRoPE entry of Phi-3's form. Made-up factors (short near 1, long growing to
    `stretch` at the lowest frequency): speed does not depend on their values."""
    half = rotary_dim // 2
    return {"type": "longrope", "short_factor": [1.0 + 0.1 * i / half for i in range(half)],
            "long_factor": [stretch ** (i / (half - 1)) for i in range(half)]}


SHAPES: dict[str, Shape] = {
    # HuggingFaceTB/SmolLM2-135M-Instruct
    "smollm2-135m": Shape(
        "llama", vocab=49152, hidden=576, layers=30, heads=9, kv_heads=3, ffn=1536,
        max_pos=8192, rope_theta=100000.0, bos=1, eos=2, pad=2, add_bos=False,
        specials={0: "<|endoftext|>", 1: "<|im_start|>", 2: "<|im_end|>"},
        chat_template=CHATML),
    # meta-llama/Llama-3.2-1B
    "llama3.2-1b": Shape(
        "llama", vocab=128256, hidden=2048, layers=16, heads=32, kv_heads=8, ffn=8192,
        head_dim=64, max_pos=131072, rope_theta=500000.0, bos=128000, eos=128001, pad=None,
        add_bos=True, specials={128000: "<|begin_of_text|>", 128001: "<|end_of_text|>"},
        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    # Qwen/Qwen2.5-0.5B-Instruct
    "qwen2.5-0.5b": Shape(
        "qwen2", vocab=151936, hidden=896, layers=24, heads=14, kv_heads=2, ffn=4864,
        max_pos=32768, rope_theta=1000000.0, norm_eps=1e-6, bos=151643, eos=151645,
        pad=151643, add_bos=False, chat_template=CHATML,
        specials={151643: "<|endoftext|>", 151644: "<|im_start|>", 151645: "<|im_end|>"}),
    # Qwen/Qwen3-0.6B
    "qwen3-0.6b": Shape(
        "qwen3", vocab=151936, hidden=1024, layers=28, heads=16, kv_heads=8, ffn=3072,
        head_dim=128, max_pos=40960, rope_theta=1000000.0, norm_eps=1e-6, bos=151643,
        eos=151645, pad=151643, add_bos=False, chat_template=CHATML,
        specials={151643: "<|endoftext|>", 151644: "<|im_start|>", 151645: "<|im_end|>"}),
    # microsoft/Phi-3-mini-128k-instruct and Phi-3.5-mini-instruct (MHA: 32 heads of 96 =
    # hidden; Phi-3-mini-4k's sliding window aside, its shape too)
    "phi3-mini": Shape(
        "phi3", vocab=32064, hidden=3072, layers=32, heads=32, kv_heads=32, ffn=8192,
        max_pos=131072, rope_scaling=_longrope(96, 60.0), tie=False, bos=1, eos=32000,
        pad=32000, add_bos=False, chat_template=PHI3_CHAT,
        specials={0: "<unk>", 1: "<s>", 2: "</s>", 32000: "<|endoftext|>",
                  32001: "<|assistant|>", 32007: "<|end|>", 32010: "<|user|>"},
        extra={"original_max_position_embeddings": 4096}),
    # meta-llama/Llama-2-7b-hf
    "llama2-7b": Shape(
        "llama", vocab=32000, hidden=4096, layers=32, heads=32, kv_heads=32, ffn=11008,
        max_pos=4096, tie=False, bos=1, eos=2, pad=None, add_bos=True,
        specials=_LLAMA2_SPECIALS),
    # facebook/opt-125m, facebook/opt-1.3b and facebook/opt-13b
    "opt-125m": Shape(
        "opt", vocab=50272, hidden=768, layers=12, heads=12, kv_heads=12, ffn=3072,
        max_pos=2048, bos=2, eos=2, pad=1, add_bos=True, specials=_OPT_SPECIALS),
    "opt-1.3b": Shape(
        "opt", vocab=50272, hidden=2048, layers=24, heads=32, kv_heads=32, ffn=8192,
        max_pos=2048, bos=2, eos=2, pad=1, add_bos=True, specials=_OPT_SPECIALS),
    "opt-13b": Shape(
        "opt", vocab=50272, hidden=5120, layers=40, heads=40, kv_heads=40, ffn=20480,
        max_pos=2048, bos=2, eos=2, pad=1, add_bos=True, specials=_OPT_SPECIALS),
    # Test shapes: seconds on a CPU. GQA, an untied head and a non-default RoPE base, so a
    # loader that drops any of them disagrees with transformers.
    "tiny-llama": Shape(
        "llama", vocab=320, hidden=64, layers=3, heads=4, kv_heads=2, ffn=160, max_pos=512,
        rope_theta=100000.0, tie=False, bos=1, eos=2, pad=0, add_bos=False,
        specials=_LLAMA2_SPECIALS),
    # MHA (kv_heads = heads): a Llama whose hidden states are smaller than its K/V, the
    # shape of Llama-2-7B for the hidden cache (Apt-Serve).
    "tiny-llama-mha": Shape(
        "llama", vocab=320, hidden=64, layers=3, heads=4, kv_heads=4, ffn=160, max_pos=512,
        rope_theta=100000.0, tie=False, bos=1, eos=2, pad=0, add_bos=False,
        specials=_LLAMA2_SPECIALS),
    # Q/K/V biases (Qwen2) on the MHA shape: re-projected K/V carry their bias.
    "tiny-qwen2-mha": Shape(
        "qwen2", vocab=320, hidden=64, layers=3, heads=4, kv_heads=4, ffn=160, max_pos=512,
        rope_theta=100000.0, tie=False, bos=1, eos=2, pad=0, add_bos=False,
        specials=_LLAMA2_SPECIALS),
    # Qwen3's per-head Q/K norms and a head_dim of its own, on the MHA shape: re-projected K
    # is normalized too.
    "tiny-qwen3-mha": Shape(
        "qwen3", vocab=320, hidden=64, layers=3, heads=4, kv_heads=4, ffn=160, head_dim=32,
        max_pos=512, rope_theta=100000.0, tie=False, bos=1, eos=2, pad=0, add_bos=False,
        specials=_LLAMA2_SPECIALS),
    # Phi-3's fused weights and LongRoPE on the MHA shape: re-projected K/V come from the fused
    # weight's rows and rotate by the scaled table.
    "tiny-phi3": Shape(
        "phi3", vocab=320, hidden=64, layers=3, heads=4, kv_heads=4, ffn=160, max_pos=512,
        rope_scaling=_longrope(16, 8.0), tie=False, bos=1, eos=2, pad=0, add_bos=False,
        specials=_LLAMA2_SPECIALS, extra={"original_max_position_embeddings": 128}),
    # google/gemma-3-1b-pt (the -it model's generation_config also stops at <end_of_turn>)
    "gemma3-1b": Shape(
        "gemma3", vocab=262144, hidden=1152, layers=26, heads=4, kv_heads=1, ffn=6912,
        head_dim=256, max_pos=32768, rope_theta=1000000.0, norm_eps=1e-6, bos=2, eos=1,
        pad=0, add_bos=True, specials=_GEMMA_SPECIALS,
        extra={"query_pre_attn_scalar": 256, "sliding_window": 512,
               "sliding_window_pattern": 6, "rope_local_base_freq": 10000.0,
               "attn_logit_softcapping": None, "final_logit_softcapping": None}),
    # google/gemma-2-2b
    "gemma2-2b": Shape(
        "gemma2", vocab=256000, hidden=2304, layers=26, heads=8, kv_heads=4, ffn=9216,
        head_dim=256, max_pos=8192, norm_eps=1e-6, bos=2, eos=1, pad=0, add_bos=True,
        specials={**_GEMMA_SPECIALS, 106: "<start_of_turn>", 107: "<end_of_turn>"},
        extra={"query_pre_attn_scalar": 256, "sliding_window": 4096,
               "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}),
    # Gemma at test size: wider heads than hidden / heads, one K/V head (Gemma 3 1B's), a
    # query_pre_attn_scalar of its own, a logit cap (Gemma 2), the local RoPE (Gemma 3); the
    # windows as long as the context.
    "tiny-gemma2": Shape(
        "gemma2", vocab=320, hidden=64, layers=4, heads=4, kv_heads=2, ffn=160, head_dim=32,
        max_pos=512, norm_eps=1e-6, bos=2, eos=1, pad=0, add_bos=True,
        specials=_GEMMA_SPECIALS,
        extra={"query_pre_attn_scalar": 24, "sliding_window": 512,
               "attn_logit_softcapping": None, "final_logit_softcapping": 30.0}),
    "tiny-gemma3": Shape(
        "gemma3", vocab=320, hidden=64, layers=6, heads=4, kv_heads=1, ffn=160, head_dim=32,
        max_pos=512, rope_theta=1000000.0, norm_eps=1e-6, bos=2, eos=1, pad=0, add_bos=True,
        specials=_GEMMA_SPECIALS,
        extra={"query_pre_attn_scalar": 24, "sliding_window": 512,
               "sliding_window_pattern": 6, "rope_local_base_freq": 100.0}),
    "tiny-opt": Shape(
        "opt", vocab=288, hidden=64, layers=3, heads=4, kv_heads=4, ffn=160, max_pos=512,
        bos=2, eos=2, pad=1, add_bos=True, specials=_OPT_SPECIALS),
}


# ---- tensors ---------------------------------------------------------------------------------


def tensor_shapes(s: Shape) -> dict[str, tuple[int, ...]]:
    """Every parameter's Hugging Face name and shape, in checkpoint order."""
    if s.arch in ("llama", "qwen2", "qwen3", "phi3", "gemma2", "gemma3"):
        return _llama_shapes(s)
    if s.arch == "opt":
        return _opt_shapes(s)
    raise ValueError(f"unknown architecture {s.arch!r}")


def _llama_shapes(s: Shape) -> dict[str, tuple[int, ...]]:
    h, q, kv, f = s.hidden, s.heads * s.dim, s.kv_heads * s.dim, s.ffn
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (s.vocab, h)}
    for i in range(s.layers):
        p = f"model.layers.{i}."
        if s.arch == "phi3":
            attn = {p + "self_attn.qkv_proj.weight": (q + 2 * kv, h)}
            mlp = {p + "mlp.gate_up_proj.weight": (2 * f, h)}
        else:
            attn = {p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                    p + "self_attn.v_proj.weight": (kv, h)}
            mlp = {p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h)}
        out |= {
            p + "input_layernorm.weight": (h,),
            **attn,
            p + "self_attn.o_proj.weight": (h, q),
            p + "post_attention_layernorm.weight": (h,),
            **mlp,
            p + "mlp.down_proj.weight": (h, f),
        }
        if s.arch == "qwen2":
            out |= {p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                    p + "self_attn.v_proj.bias": (kv,)}
        if s.arch in ("qwen3", "gemma3"):
            out |= {p + "self_attn.q_norm.weight": (s.dim,),
                    p + "self_attn.k_norm.weight": (s.dim,)}
        if s.arch in ("gemma2", "gemma3"):  # norms of the sublayers' outputs too
            out |= {p + "pre_feedforward_layernorm.weight": (h,),
                    p + "post_feedforward_layernorm.weight": (h,)}
    out["model.norm.weight"] = (h,)
    if not s.tie:
        out["lm_head.weight"] = (s.vocab, h)
    return out


def _opt_shapes(s: Shape) -> dict[str, tuple[int, ...]]:
    h, f, d = s.hidden, s.ffn, "model.decoder."
    # OPT's learned position table has two extra rows: positions start at offset 2.
    out: dict[str, tuple[int, ...]] = {d + "embed_tokens.weight": (s.vocab, h),
                                       d + "embed_positions.weight": (s.max_pos + 2, h)}
    for i in range(s.layers):
        p = f"{d}layers.{i}."
        for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
            out |= {p + f"self_attn.{proj}.weight": (h, h), p + f"self_attn.{proj}.bias": (h,)}
        out |= {
            p + "self_attn_layer_norm.weight": (h,), p + "self_attn_layer_norm.bias": (h,),
            p + "fc1.weight": (f, h), p + "fc1.bias": (f,),
            p + "fc2.weight": (h, f), p + "fc2.bias": (h,),
            p + "final_layer_norm.weight": (h,), p + "final_layer_norm.bias": (h,),
        }
    out |= {d + "final_layer_norm.weight": (h,), d + "final_layer_norm.bias": (h,)}
    return out


def num_params(s: Shape) -> int:
    return sum(_numel(shape) for shape in tensor_shapes(s).values())


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for x in shape:
        n *= x
    return n


def make_tensor(name: str, shape: tuple[int, ...], seed: int, device: torch.device,
                dtype: torch.dtype, norm_weight: float = 1.0) -> torch.Tensor:
    """One parameter, seeded by (seed, name) so that sharding never changes a value.

    Norm weights are norm_weight (1; 0 for Gemma, whose norms scale by 1 + w) and norm biases
    0, as a freshly initialized model has them; every other tensor is N(0, STD). CPU and CUDA
    generators give different numbers for one seed: a directory's weights depend on the
    device that wrote it (its marker records which).
    """
    is_norm = "norm" in name
    if is_norm:
        fill = norm_weight if name.endswith("weight") else 0.0
        return torch.full(shape, fill, dtype=dtype)
    g = torch.Generator(device=device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    t = torch.randn(shape, generator=g, device=device, dtype=torch.float32).mul_(STD)
    return t.to(dtype).cpu()


def plan_shards(shapes: dict[str, tuple[int, ...]], elem_bytes: int,
                max_bytes: int = MAX_SHARD_BYTES) -> list[list[str]]:
    """Consecutive parameters grouped so that no shard passes max_bytes (unless one tensor
    alone does)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, shape in shapes.items():
        n = _numel(shape) * elem_bytes
        if shards[-1] and size + n > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    return shards


# ---- metadata ------------------------------------------------------------------------------


def config_json(s: Shape, dtype: torch.dtype) -> dict:
    """config.json as the published checkpoint has it."""
    common = {
        "vocab_size": s.vocab, "hidden_size": s.hidden, "num_hidden_layers": s.layers,
        "num_attention_heads": s.heads, "max_position_embeddings": s.max_pos,
        "bos_token_id": s.bos, "eos_token_id": s.eos, "pad_token_id": s.pad,
        "tie_word_embeddings": s.tie, "torch_dtype": str(dtype).removeprefix("torch."),
        "use_cache": True,
    }
    llama_like = {
        "num_key_value_heads": s.kv_heads, "head_dim": s.dim, "intermediate_size": s.ffn,
        "hidden_act": "silu", "rms_norm_eps": s.norm_eps, "rope_theta": s.rope_theta,
        "rope_scaling": s.rope_scaling, "attention_dropout": 0.0, "initializer_range": STD,
    }
    if s.arch == "llama":
        return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **common,
                **llama_like, "attention_bias": False, "mlp_bias": False}
    if s.arch == "qwen2":
        return {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", **common,
                **llama_like, "use_sliding_window": False}
    if s.arch == "qwen3":
        return {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", **common,
                **llama_like, "attention_bias": False, "use_sliding_window": False}
    if s.arch == "phi3":
        return {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3", **common,
                **llama_like, "sliding_window": None, "resid_pdrop": 0.0, "embd_pdrop": 0.0,
                **s.extra}
    if s.arch in ("gemma2", "gemma3"):
        names = {"gemma2": ("Gemma2ForCausalLM", "gemma2"),
                 "gemma3": ("Gemma3ForCausalLM", "gemma3_text")}[s.arch]
        return {"architectures": [names[0]], "model_type": names[1], **common, **llama_like,
                "hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh",
                "attention_bias": False, **s.extra}
    return {
        "architectures": ["OPTForCausalLM"], "model_type": "opt", **common,
        "ffn_dim": s.ffn, "word_embed_proj_dim": s.hidden, "do_layer_norm_before": True,
        "activation_function": "relu", "enable_bias": True,
        "layer_norm_elementwise_affine": True, "dropout": 0.0, "attention_dropout": 0.0,
        "layerdrop": 0.0, "init_std": STD,
    }


def build_tokenizer(s: Shape) -> Tokenizer:
    """A word-level tokenizer in which every id 0..vocab-1 is a token.

    Benchmarks feed token ids, so the tokenizer need only be valid and cover the vocabulary:
    special tokens sit at the model's real ids, every other id is the word `w<id>`.
    """
    vocab = {s.specials.get(i, f"w{i}"): i for i in range(s.vocab)}
    unk = s.specials.get(0, s.specials[s.eos])
    tok = Tokenizer(models.WordLevel(vocab, unk_token=unk))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([s.specials[i] for i in sorted(s.specials)])
    return tok


def tokenizer_config(s: Shape) -> dict:
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": s.specials[s.bos],
        "eos_token": s.specials[s.eos],
        "unk_token": s.specials.get(0, s.specials[s.eos]),
        "add_bos_token": s.add_bos,
        "model_max_length": s.max_pos,
    }
    if s.pad is not None:
        cfg["pad_token"] = s.specials.get(s.pad, f"w{s.pad}")
    if s.chat_template:
        cfg["chat_template"] = s.chat_template
    return cfg


# ---- writing -------------------------------------------------------------------------------


def _default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _marker(shape: str, seed: int, dtype: torch.dtype, device: torch.device) -> dict:
    return {"shape": shape, "seed": seed, "dtype": str(dtype).removeprefix("torch."),
            "device": device.type, "std": STD, "params": num_params(SHAPES[shape])}


def is_complete(out_dir: Path, shape: str, seed: int, dtype: torch.dtype) -> bool:
    """True when out_dir already holds this shape, seed and dtype (from any device)."""
    try:
        m = json.loads((out_dir / MARKER).read_text())
    except (OSError, json.JSONDecodeError):
        return False
    want = _marker(shape, seed, dtype, torch.device("cpu"))
    return all(m.get(k) == want[k] for k in ("shape", "seed", "dtype", "std", "params"))


def write_random_model(shape: str, out_dir: str | Path, seed: int = 0,
                       dtype: torch.dtype = torch.bfloat16, *, device: str | None = None,
                       reuse: bool = True, max_shard_bytes: int = MAX_SHARD_BYTES,
                       log=None) -> Path:
    """Write (or reuse) a random-weight HF directory of SHAPES[shape]; returns its path."""
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; known: {', '.join(SHAPES)}")
    s, out = SHAPES[shape], Path(out_dir)
    if reuse and is_complete(out, shape, seed, dtype):
        return out
    dev = torch.device(device) if device else _default_device()
    out.mkdir(parents=True, exist_ok=True)
    (out / MARKER).unlink(missing_ok=True)
    for old in [*out.glob("*.safetensors"), out / "model.safetensors.index.json"]:
        old.unlink(missing_ok=True)  # a previous shape's shards would be loaded too
    _write_weights(s, out, seed, dtype, dev, max_shard_bytes, log)
    write_metadata(s, out, dtype)
    (out / MARKER).write_text(json.dumps(_marker(shape, seed, dtype, dev), indent=2))
    return out


def _write_weights(s: Shape, out: Path, seed: int, dtype: torch.dtype, dev: torch.device,
                   max_shard_bytes: int, log) -> None:
    shapes = tensor_shapes(s)
    norm_weight = 0.0 if s.arch in ("gemma2", "gemma3") else 1.0
    elem = torch.tensor([], dtype=dtype).element_size()
    shards = plan_shards(shapes, elem, max_shard_bytes)
    n = len(shards)
    names = (["model.safetensors"] if n == 1
             else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)])
    weight_map = {}
    for fname, shard in zip(names, shards, strict=True):
        tensors = {k: make_tensor(k, shapes[k], seed, dev, dtype, norm_weight) for k in shard}
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(shard, fname)
        if log:
            log(f"wrote {fname} ({sum(t.nbytes for t in tensors.values()) >> 20} MB)")
        del tensors
    if n > 1:
        total = sum(_numel(v) for v in shapes.values()) * elem
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def write_metadata(s: Shape, out: Path, dtype: torch.dtype) -> None:
    (out / "config.json").write_text(json.dumps(config_json(s, dtype), indent=2))
    gen = {"bos_token_id": s.bos, "eos_token_id": s.eos}
    if s.pad is not None:
        gen["pad_token_id"] = s.pad
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2))
    build_tokenizer(s).save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(s), indent=2))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", required=True, choices=list(SHAPES))
    ap.add_argument("out_dir")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="bf16", choices=list(DTYPES))
    ap.add_argument("--device", default=None, help="where to generate (default: cuda if any)")
    ap.add_argument("--force", action="store_true", help="rewrite even if the marker matches")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    s = SHAPES[args.shape]
    gb = num_params(s) * DTYPES[args.dtype].itemsize / 1e9
    print(f"{args.shape}: {num_params(s) / 1e6:.1f}M params, {gb:.2f} GB", file=sys.stderr)
    path = write_random_model(args.shape, args.out_dir, args.seed, DTYPES[args.dtype],
                              device=args.device, reuse=not args.force,
                              log=lambda m: print(m, file=sys.stderr, flush=True))
    print(f"{path} ready in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
