"""GGUF files of the Llama architecture (llama; qwen2: Llama with Q/K/V biases; qwen3: with
per-head Q/K norms; phi3: with fused Q/K/V and gate/up, and LongRoPE; smollm3: every fourth
layer without RoPE) and of Gemma 2 and 3 (gemma2, gemma3): config, dequantized weights (HF
names and layout), tokenizer."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from .config import ModelConfig, sliding_windows
from .errors import ModelLoadError
from .rope import LongRope
from .shapes import check_shapes
from .spm import spm_tokenizer
from .tokenizer import ModelTokenizer

# Types the `gguf` package dequantizes and that we have checked against files llama.cpp wrote
# (tests/test_gguf_loader.py); others are refused by name. A Q4_K_M file holds Q5_0 or Q8_0
# tensors wherever a row is not a multiple of 256 values wide (SmolLM2, Qwen2.5-0.5B).
SUPPORTED_TYPES = {"F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
                   "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ3_S", "IQ4_NL", "IQ4_XS"}

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
# llama.cpp's splits for "default" (and a missing pre key): each regex splits every piece the
# previous one left, keeping matches and the text between them as separate pieces.
_DEFAULT_SPLITS = (r"[\p{P}\$\+<=>\^~\|]+", _GPT2_SPLIT, r"\p{N}+", r"[0-9][0-9][0-9]")
_LLAMA3_PRES = ("llama-bpe", "llama3", "llama-v3")
# Qwen2's split: Llama 3's, but digits one by one (llama.cpp spells the case-insensitive
# contractions out; the same matches).
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Mistral's Tekken (Mistral NeMo, Ministral, Mistral Small 3): the split of its
# tokenizer.json, which llama.cpp quotes and approximates (a letter outside a-z counts as
# upper case there, so a word ending in a non-ASCII capital can split differently); the
# model was trained on this one.
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# GPT-4o's (o200k; Phi-4-mini): Tekken's words with English contractions kept on them, and
# digits in threes. Its tokenizer.json's regex, which llama.cpp approximates as it does
# Tekken's.
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Vocabularies whose whole pieces are looked up before merging (llama.cpp's ignore_merges,
# as tiktoken does).
_IGNORE_MERGES = (*_LLAMA3_PRES, "tekken")

# Pre-tokenizers that are one regex split, then bytes to symbols.
_ONE_SPLIT = {**dict.fromkeys((*_LLAMA3_PRES, "smaug-bpe"), _LLAMA3_SPLIT),
              "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT, "tekken": _TEKKEN_SPLIT,
              "gpt-4o": _GPT4O_SPLIT}


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    """The pre-tokenizer llama.cpp applies for a `tokenizer.ggml.pre` name."""
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "default":
        return pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in _DEFAULT_SPLITS]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
    if pre in ("gpt2", "gpt-2"):
        return byte_level
    if pre in ("smollm", "starcoder", "refact", "codeshell", "command-r", "exaone", "minerva"):
        # Digits are split one by one before the GPT-2 regex.
        return pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    if pre in _ONE_SPLIT:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_ONE_SPLIT[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    raise ModelLoadError(f"unsupported GGUF pre-tokenizer {pre!r}")


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def _bpe(reader, tokens: list[str]) -> Tokenizer:
    """Byte-level BPE (tokenizer model 'gpt2'): SmolLM, Llama 3, Qwen2."""
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges", [])]
    pre = _field(reader, "tokenizer.ggml.pre", "default")
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                               ignore_merges=pre in _IGNORE_MERGES))
    tok.pre_tokenizer = _pre_tokenizer(pre)
    tok.decoder = decoders.ByteLevel()
    return tok


TOKENIZER_MODELS = ("gpt2", "llama")


def _tokenizer(reader) -> ModelTokenizer:
    kind = _field(reader, "tokenizer.ggml.model")
    if kind not in TOKENIZER_MODELS:
        raise ModelLoadError(
            f"unsupported GGUF tokenizer model {kind!r} (supported: 'gpt2', byte-level BPE, "
            f"and 'llama', SentencePiece BPE)")
    tokens: list[str] = _field(reader, "tokenizer.ggml.tokens")
    types = _field(reader, "tokenizer.ggml.token_type", [1] * len(tokens))
    spm = kind == "llama"
    # llama.cpp's defaults for a key the file lacks: SentencePiece files (Llama 2) start with
    # BOS and name <unk>, <s>, </s> by their usual ids.
    defaults = {"unk": 0, "bos": 1, "eos": 2} if spm else {}

    def name(key: str) -> str | None:
        i = _field(reader, f"tokenizer.ggml.{key}_token_id", defaults.get(key))
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    space_prefix = spm and bool(_field(reader, "tokenizer.ggml.add_space_prefix", True))
    if spm:
        scores = _field(reader, "tokenizer.ggml.scores")
        if scores is None or len(scores) != len(tokens):
            raise ModelLoadError("GGUF tokenizer model 'llama' needs tokenizer.ggml.scores, "
                                 "a score for every token")
        tok = spm_tokenizer(tokens, scores, types, name("unk"), space_prefix)
    else:
        tok = _bpe(reader, tokens)
    # Control (3) and user-defined (4) tokens are matched whole, before BPE; llama.cpp also
    # matches the unknown token (2) when it parses special tokens. Only control and unknown
    # tokens are special (dropped by decode): llama.cpp prints user-defined ones, e.g. <think>.
    pairs = list(zip(tokens, types, strict=True))
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, ty in pairs if ty in (2, 3)])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t, ty in pairs if ty == 4])
    return ModelTokenizer(
        tokenizer=tok,
        chat_template=_field(reader, "tokenizer.chat_template"),
        bos_token=name("bos"),
        eos_token=name("eos"),
        # (llama.cpp's default where the key is missing: on for SentencePiece and Tekken.)
        add_bos=bool(_field(reader, "tokenizer.ggml.add_bos_token",
                            spm or _field(reader, "tokenizer.ggml.pre") == "tekken")),
        add_eos=bool(_field(reader, "tokenizer.ggml.add_eos_token", False)),
        spm_space_prefix=space_prefix if spm else None,
    )


LLAMA_LIKE = ("llama", "qwen2", "qwen3", "phi3", "smollm3")
# Architectures whose Q/K rows llama.cpp's converter interleaves, each head's two RoPE halves
# (its rotation is GPT-J's there); Qwen's, Phi-3's and Gemma's it leaves alone (rotated NeoX
# style, as in Hugging Face).
PERMUTED_QK = ("llama", "smollm3")
# llama.cpp's SmolLM3: layer i takes no RoPE where (i + 1) % 4 == 0, fixed (no metadata key
# says otherwise; transformers' no_rope_layer_interval default).
_SMOLLM3_NOPE_INTERVAL = 4
ARCHITECTURES = (*LLAMA_LIKE, "gemma2", "gemma3")


def _architecture(reader) -> str:
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ModelLoadError(f"unsupported GGUF architecture {arch!r} "
                             f"(supported: {', '.join(ARCHITECTURES)})")
    return arch


def _tensor_values(reader, name: str, count: int) -> tuple[float, ...] | None:
    """A small F32 tensor's values (None where the file has no such tensor)."""
    t = next((t for t in reader.tensors if t.name == name), None)
    if t is None:
        return None
    values = [float(x) for x in np.asarray(t.data, dtype=np.float32).reshape(-1)]
    if len(values) != count:
        raise ModelLoadError(f"{name} has {len(values)} values for {count} rotary frequencies")
    return tuple(values)


def _rope_fields(reader, arch: str, rotary: int, context: int) -> dict:
    """ModelConfig's RoPE fields for heads that rotate `rotary` dimensions. Phi-3's
    LongRoPE (rope.py) is a pair of tensors, rope_factors_short and rope_factors_long, with
    the pretrained context and the factor on cos and sin in metadata; llama.cpp takes the
    factor as written, 1 when absent."""
    divisors = _rope_divisors(reader, arch, rotary)
    long = _tensor_values(reader, "rope_factors_long.weight", rotary // 2)
    if long is None:
        return {"rope_divisors": divisors}
    if divisors:
        raise ModelLoadError("GGUF LongRoPE (rope_factors_long) with another RoPE scaling "
                             "(rope_freqs or a linear factor) is not supported")
    short = _tensor_values(reader, "rope_factors_short.weight", rotary // 2)
    if short is None:
        raise ModelLoadError("GGUF LongRoPE: rope_factors_long without rope_factors_short")
    return LongRope(
        short, long, int(_field(reader, f"{arch}.rope.scaling.original_context_length", context)),
        float(_field(reader, f"{arch}.rope.scaling.attn_factor", 1.0)),
    ).config_fields()


def _rope_divisors(reader, arch: str, rotary: int) -> tuple[float, ...]:
    """The divisor of each rotary frequency (rope.py): llama.cpp divides them by the
    `rope_freqs` tensor (Llama 3.1's scheme, written by its converter) and by a linear
    scaling factor; other scaling types are refused."""
    scaling = _field(reader, f"{arch}.rope.scaling.type", "linear")  # llama.cpp's default
    factor = float(_field(reader, f"{arch}.rope.scaling.factor",
                          _field(reader, f"{arch}.rope.scale_linear")) or 1.0)
    if scaling not in ("none", "linear") or (scaling == "none" and factor != 1.0):
        raise ModelLoadError(
            f"GGUF RoPE scaling {scaling!r} (factor {factor}) is not supported (supported: "
            f"linear, and Llama 3's frequency factors)")
    factors = _tensor_values(reader, "rope_freqs.weight", rotary // 2)
    if factors is None:
        return () if factor == 1.0 else (factor,) * (rotary // 2)
    return tuple(factor * f for f in factors)


# Architectures whose sliding windows llama.cpp reads ({arch}.attention.sliding_window):
# (its default layer pattern: every n-th layer global, 0: all local; the window it assumes
# where the file names none, 0: none). llama, qwen2 and qwen3 are not among them: llama.cpp
# runs them with full attention whatever the metadata says (a Mistral 7B v0.1 GGUF, arch
# llama, included), and so do we.
SLIDING_PATTERNS: dict[str, tuple[int, int]] = {"gemma2": (2, 4096), "gemma3": (6, 0)}


def _sliding_layers(reader, arch: str, num_layers: int) -> list[bool]:
    """Which layers slide, as llama.cpp reads it: {arch}.attention.sliding_window_pattern, a
    flag a layer or a number n (layer i slides unless i % n == n - 1: llama.cpp's
    set_swa_pattern), or the architecture's default."""
    pattern = _field(reader, f"{arch}.attention.sliding_window_pattern",
                     SLIDING_PATTERNS[arch][0])
    if isinstance(pattern, list):
        if len(pattern) != num_layers:
            raise ModelLoadError(f"{arch}.attention.sliding_window_pattern has {len(pattern)} "
                                 f"flags for {num_layers} layers")
        return [bool(f) for f in pattern]
    n = int(pattern)
    return [n == 0 or i % n < n - 1 for i in range(num_layers)]


def _layer_windows(reader, arch: str, num_layers: int, context: int) -> tuple[int, ...]:
    """ModelConfig.layer_windows as llama.cpp reads them: the window, and which layers
    slide."""
    if arch not in SLIDING_PATTERNS:
        return ()
    window = int(_field(reader, f"{arch}.attention.sliding_window", SLIDING_PATTERNS[arch][1]))
    return sliding_windows(_sliding_layers(reader, arch, num_layers), window, context)


def _gemma_settings(reader, arch: str, get, layers: int, hidden: int, heads: int,
                    head_dim: int) -> dict:
    """ModelConfig's Gemma fields as llama.cpp sets them: some from the file, some fixed by
    llama.cpp for the architecture (Gemma 3's local RoPE base, the attention scale, softcap
    defaults)."""
    # llama.cpp scales scores by head_dim ** -0.5, except in the 27B models (told by their
    # layer count), whose query_pre_attn_scalar is hidden / heads; the files do not say.
    big = layers == (46 if arch == "gemma2" else 62)
    scale = (hidden // heads if big else head_dim) ** -0.5
    if arch == "gemma2":
        return dict(attn_scale=scale, attn_softcap=float(get("attn_logit_softcapping", 50.0)),
                    logit_softcap=float(get("final_logit_softcapping", 30.0)))
    get("attention.sliding_window")  # (llama.cpp refuses a Gemma 3 file without it)
    sliding = _sliding_layers(reader, arch, layers)
    return dict(attn_scale=scale, logit_softcap=float(get("final_logit_softcapping", 0.0)),
                rope_local_layers=tuple(i for i, s in enumerate(sliding) if s),
                rope_local_theta=10_000.0)


def _config(reader, arch: str, tokenizer: ModelTokenizer, has_output: bool) -> ModelConfig:
    def get(key: str, default=None):
        v = _field(reader, f"{arch}.{key}", default)
        if v is None:
            raise ModelLoadError(f"GGUF metadata key {arch}.{key} is missing")
        return v

    hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
    # Qwen3's heads are not hidden / heads wide: key_length says (llama.cpp writes it then).
    head_dim = int(get("attention.key_length", hidden // heads))
    # Phi-4-mini rotates 96 of its 128 head dimensions: the first ones, in Hugging Face's
    # layout; Llama's rows are permuted for another rotation (_unpermute), whole heads only.
    rotary = int(get("rope.dimension_count", head_dim))
    if rotary != head_dim and (arch in PERMUTED_QK or not 0 < rotary < head_dim or rotary % 2):
        raise ModelLoadError(f"GGUF {arch} RoPE over {rotary} of {head_dim} head dimensions "
                             f"is not supported")
    num_layers, context = int(get("block_count")), int(get("context_length"))
    gemma = {} if arch in LLAMA_LIKE else _gemma_settings(reader, arch, get, num_layers,
                                                           hidden, heads, head_dim)
    eos = [tokenizer.token_id(tokenizer.eos_token)] if tokenizer.eos_token else []
    # Chat models end a turn with their own token; stopping there is what users expect.
    for end_of_turn in ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>",
                        "<|endoftext|>"):
        i = tokenizer.token_id(end_of_turn)
        if i is not None and i not in eos:
            eos.append(i)
    # (Phi-3-mini-4k's file names a sliding window, which llama.cpp ignores for phi3.)
    return ModelConfig(
        arch=arch if gemma else "llama",
        vocab_size=len(_field(reader, "tokenizer.ggml.tokens")),
        hidden_size=hidden,
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=int(get("attention.head_count_kv", heads)),
        head_dim=head_dim,
        ffn_size=int(get("feed_forward_length")),
        max_context=context,
        norm_eps=float(get("attention.layer_norm_rms_epsilon")),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rotary_dim=0 if rotary == head_dim else rotary,
        **_rope_fields(reader, arch, rotary, context),
        tie_embeddings=not has_output,
        bos_token_id=tokenizer.token_id(tokenizer.bos_token) if tokenizer.bos_token else None,
        eos_token_ids=tuple(eos),
        layer_windows=_layer_windows(reader, arch, num_layers, context),
        nope_layers=tuple(i for i in range(num_layers) if arch == "smollm3"
                          and (i + 1) % _SMOLLM3_NOPE_INTERVAL == 0),
        **gemma,
    )


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's converter, which interleaves each head's two RoPE halves."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_qkv": "self_attn.qkv_proj",  # Phi-3's fused Q, K and V rows
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",  # Qwen3's per-head norms
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Gemma's four norms a layer: llama.cpp's ffn_norm is the norm before the MLP, which Llama's
# checkpoints call post_attention_layernorm and Gemma's pre_feedforward_layernorm.
_GEMMA_LAYER_NAMES = {
    **_LAYER_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# Phi-3's ffn_up is its gate_up_proj: gate rows then up rows, as ggml's swiglu reads them.
_ARCH_LAYER_NAMES = {"phi3": {**_LAYER_NAMES, "ffn_up": "mlp.gate_up_proj"},
                     "gemma2": _GEMMA_LAYER_NAMES, "gemma3": _GEMMA_LAYER_NAMES}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# RoPE scaling tensors: read into the config (its rope fields), not weights.
_ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")


def _hf_name(gguf_name: str, arch: str) -> str:
    base, _, suffix = gguf_name.rpartition(".")
    parts = base.split(".")
    names = _ARCH_LAYER_NAMES.get(arch, _LAYER_NAMES)
    if parts[0] == "blk" and len(parts) == 3 and parts[2] in names:
        return f"model.layers.{parts[1]}.{names[parts[2]]}.{suffix}"
    if base in _TOP_NAMES:
        return f"{_TOP_NAMES[base]}.{suffix}"
    raise ModelLoadError(f"unexpected tensor {gguf_name!r} in a GGUF file")


def _open(path: Path):
    import gguf

    try:
        return gguf.GGUFReader(str(path))
    except Exception as e:  # the reader raises bare ValueError/IndexError on damaged files
        raise ModelLoadError(f"cannot read GGUF file {path}: truncated or corrupt ({e})") from e


# llama.cpp's gguf-split (and the converter's --split-max-size) names a model's files
# PREFIX-00001-of-00003.gguf and so on: the first holds the metadata, each some tensors.
_SPLIT_NAME = re.compile(r"(.*)-(\d{5})-of-(\d{5})\.gguf")


def gguf_files(path: Path) -> list[Path]:
    """The files of the model at `path`: the file itself, or each part of a split model
    (`path` being its first)."""
    m = _SPLIT_NAME.fullmatch(path.name)
    if m is None or m[3] == "00001":
        return [path]
    if m[2] != "00001":
        raise ModelLoadError(f"{path} is part {int(m[2])} of a split model: give its first "
                             f"file, {m[1]}-00001-of-{m[3]}.gguf")
    files = [path.with_name(f"{m[1]}-{i:05d}-of-{m[3]}.gguf") for i in range(1, int(m[3]) + 1)]
    missing = [f.name for f in files if not f.exists()]
    if missing:
        raise ModelLoadError(f"{path} is the first of {len(files)} files of a split model, "
                             f"and {', '.join(missing)} is missing")
    return files


@dataclass
class _Model:
    """What the functions here read of a GGUFReader, over a model's files: the metadata
    (the first file's) and every file's tensors."""

    fields: dict
    tensors: list


def _open_model(path: Path) -> _Model:
    readers = [_open(f) for f in gguf_files(path)]
    count = _field(readers[0], "split.count", 1)
    if count != len(readers):
        raise ModelLoadError(f"{path} is the first of {count} files of a split model "
                             f"(split.count), which are found by their names: "
                             f"PREFIX-00001-of-{count:05d}.gguf and so on")
    return _Model(readers[0].fields, [t for r in readers for t in r.tensors])


def _check_tensor_types(reader) -> None:
    for t in reader.tensors:
        kind = t.tensor_type.name
        if kind not in SUPPORTED_TYPES:
            raise ModelLoadError(
                f"tensor {t.name} has unsupported type {kind} (supported: "
                f"{', '.join(sorted(SUPPORTED_TYPES))}); llama.cpp's llama-quantize "
                f"--allow-requantize writes one of them")


def read_gguf_metadata(path: Path) -> tuple[ModelConfig, ModelTokenizer]:
    reader = _open_model(path)
    try:  # (the file is named here: a connection opens a model by its registered name)
        arch = _architecture(reader)  # first: another model fails on that, not on its vocabulary
        _check_tensor_types(reader)  # (here, not after dequantizing the tensors before it)
        tokenizer = _tokenizer(reader)
        has_output = any(t.name == "output.weight" for t in reader.tensors)
        config = _config(reader, arch, tokenizer, has_output)
        # (GGUF lists a tensor's dimensions innermost first)
        check_shapes({_hf_name(t.name, arch): tuple(int(d) for d in reversed(t.shape))
                      for t in reader.tensors if t.name not in _ROPE_TENSORS}, config)
        return config, tokenizer
    except ModelLoadError as e:
        raise ModelLoadError(f"{path}: {e}") from None


def read_gguf_weights(path: Path, config: ModelConfig) -> dict[str, torch.Tensor]:
    """All tensors dequantized to fp32, named and laid out as in a Hugging Face checkpoint
    (their types checked by read_gguf_metadata, which comes first)."""
    import gguf

    reader = _open_model(path)
    arch = _architecture(reader)
    permuted = arch in PERMUTED_QK
    # It stores Gemma's norm weights w as the 1 + w they scale by: back to w, in fp32 (exact
    # for the stored values from 0.5 up; below, within an ulp of what llama.cpp scales by).
    shifted_norms = arch not in LLAMA_LIKE
    weights = {}
    for t in reader.tensors:
        if t.name in _ROPE_TENSORS:
            continue
        kind = t.tensor_type.name
        try:
            w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        except Exception as e:
            raise ModelLoadError(f"cannot dequantize {t.name} ({kind}) in {path}: {e}") from e
        expected = tuple(int(d) for d in reversed(t.shape))  # GGUF lists dims innermost first
        if w.size != int(np.prod(expected)):
            raise ModelLoadError(f"tensor {t.name} in {path} is truncated")
        w = w.reshape(expected)
        if permuted and t.name.endswith("attn_q.weight"):
            w = _unpermute(w, config.num_heads)
        elif permuted and t.name.endswith("attn_k.weight"):
            w = _unpermute(w, config.num_kv_heads)
        elif shifted_norms and t.name.endswith("norm.weight"):
            w = w - np.float32(1.0)
        weights[_hf_name(t.name, arch)] = torch.from_numpy(np.require(w, requirements=["C", "W"]))
    return weights
