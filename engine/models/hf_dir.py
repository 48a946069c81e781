"""Hugging Face model directories: config.json, *.safetensors, tokenizer.json."""

from __future__ import annotations

import json
from pathlib import Path

import jinja2
import torch
from safetensors import safe_open
from tokenizers import Tokenizer

from .config import ModelConfig, sliding_windows
from .errors import ModelLoadError
from .rope import LONGROPE_KINDS, hf_divisors, hf_longrope
from .tokenizer import ModelTokenizer

# Mistral, Qwen2, Qwen3, Phi-3 and SmolLM3 are Llama's decoder, read into its config (Qwen2's
# Q/K/V biases, Qwen3's per-head Q/K norms and Phi-3's fused qkv_proj and gate_up_proj, like
# any bias a Llama checkpoint has, come with the weights; SmolLM3's layers without RoPE are
# ModelConfig.nope_layers).
LLAMA_LIKE = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
              "Phi3ForCausalLM", "SmolLM3ForCausalLM")
GEMMA = {"Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3"}
# Gemma 3 4B, 12B and 27B: an image encoder beside Gemma 3's text decoder, whose settings
# config.json nests under text_config and whose weights are stored under language_model.
# Only the text decoder is read (read_hf_weights leaves the vision tower on disk).
MULTIMODAL = {"Gemma3ForConditionalGeneration": "Gemma3ForCausalLM"}
SUPPORTED_ARCHITECTURES = (*LLAMA_LIKE, *GEMMA, *MULTIMODAL, "OPTForCausalLM")
# transformers' Gemma3TextConfig defaults, which Google's multimodal configs rely on: their
# text_config names only what differs (Gemma 3 4B's: sizes, layer count, RoPE scaling and
# window), and the Llama-style fallbacks below would be wrong for the rest (head_dim 256,
# not hidden / heads; 131,072 positions; query_pre_attn_scalar 256). The RoPE bases'
# defaults are in _gemma_config.
GEMMA3_TEXT_DEFAULTS = {
    "vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216,
    "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4,
    "head_dim": 256, "max_position_embeddings": 131_072, "rms_norm_eps": 1e-6,
    "bos_token_id": 2, "eos_token_id": 1, "tie_word_embeddings": True,
    "query_pre_attn_scalar": 256, "sliding_window": 4096,
}


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text()) if path.exists() else {}
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} holds a JSON {type(data).__name__}, not an object")
    return data


def _token_text(tok) -> str | None:
    return tok.get("content") if isinstance(tok, dict) else tok


def read_hf_metadata(path: Path) -> tuple[ModelConfig, ModelTokenizer]:
    cfg = _read_json(path / "config.json")
    if not cfg:
        raise ModelLoadError(f"{path} has no config.json")
    archs = cfg.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise ModelLoadError(
            f"{path}: unsupported architecture {archs or cfg.get('model_type')!r} "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    if arch in MULTIMODAL:
        cfg, arch = _text_config(cfg, path), MULTIMODAL[arch]
    if arch == "Gemma3ForCausalLM":
        cfg = {**GEMMA3_TEXT_DEFAULTS, **cfg}
    quant = cfg.get("quantization_config")
    if quant:  # (its tensors would be read as plain weights: packed ints, unscaled fp8)
        method = quant.get("quant_method", "?") if isinstance(quant, dict) else quant
        raise ModelLoadError(f"{path}: quantized checkpoints ({method!r}, config.json's "
                             f"quantization_config) are not supported; use the unquantized "
                             f"model or a GGUF file")
    tokenizer = _tokenizer(path, arch)
    try:
        return _model_config(cfg, arch, path, tokenizer), tokenizer
    except KeyError as e:  # a key every config of the architecture has
        raise ModelLoadError(f"{path / 'config.json'} has no {e.args[0]!r}, which "
                             f"{arch} needs") from None


def _model_config(cfg: dict, arch: str, path: Path, tokenizer: ModelTokenizer) -> ModelConfig:
    gen_cfg = _read_json(path / "generation_config.json")
    eos = gen_cfg.get("eos_token_id", cfg.get("eos_token_id"))
    eos_ids = list(eos if isinstance(eos, list) else [] if eos is None else [eos])
    # And the tokenizer's EOS, where a fine-tune changed it (to its <|im_end|>) and left
    # config.json's: vLLM stops there, and llama.cpp, whose converter writes it as the
    # file's EOS; the chat's answers ran on to max_tokens past their end of turn.
    tok_eos = tokenizer.token_id(tokenizer.eos_token) if tokenizer.eos_token else None
    if tok_eos is not None and tok_eos not in eos_ids:
        eos_ids.append(tok_eos)
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    common = dict(
        vocab_size=cfg["vocab_size"],
        hidden_size=hidden,
        num_layers=cfg["num_hidden_layers"],
        num_heads=heads,
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=tuple(eos_ids),
        max_context=cfg.get("max_position_embeddings", 2048),
    )
    if arch in GEMMA:
        config = _gemma_config(cfg, GEMMA[arch], path, common)
    elif arch in LLAMA_LIKE:
        head_dim = cfg.get("head_dim") or hidden // heads
        rope = cfg.get("rope_parameters") or {}
        # (Where the config names none: SmolLM3Config's default base, LlamaConfig's.)
        theta = _rope_theta(rope, cfg, "rope_theta",
                            2_000_000.0 if arch == "SmolLM3ForCausalLM" else 10000.0)
        scaling = cfg.get("rope_scaling") or rope
        # Phi-4-mini rotates 96 of its 128 head dimensions (as transformers rounds them).
        rotary = int(head_dim * rope.get("partial_rotary_factor",
                                         cfg.get("partial_rotary_factor", 1.0)))
        longrope = None
        if scaling.get("rope_type", scaling.get("type")) in LONGROPE_KINDS:
            # (Phi-3 writes the pretrained context beside rope_scaling; transformers prefers it.)
            original = cfg.get("original_max_position_embeddings",
                               scaling.get("original_max_position_embeddings",
                                           common["max_context"]))
            longrope = hf_longrope(scaling, rotary, common["max_context"], original,
                                   str(path))
        nope = _nope_layers(cfg, arch, path, common["num_layers"])
        config = ModelConfig(
            arch="llama",
            num_kv_heads=cfg.get("num_key_value_heads", heads),
            head_dim=head_dim,
            ffn_size=cfg["intermediate_size"],
            norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            rotary_dim=0 if rotary == head_dim else rotary,
            **(longrope.config_fields() if longrope else
               {"rope_divisors": hf_divisors(scaling, rotary, theta, str(path))}),
            tie_embeddings=cfg.get("tie_word_embeddings", False),
            layer_windows=_layer_windows(cfg, arch, path, common["num_layers"],
                                         common["max_context"], nope),
            nope_layers=nope,
            **common,
        )
    else:
        if cfg.get("activation_function", "relu") != "relu":
            raise ModelLoadError(f"{path}: OPT activation {cfg['activation_function']!r}")
        config = ModelConfig(
            arch="opt",
            num_kv_heads=heads,
            head_dim=hidden // heads,
            ffn_size=cfg["ffn_dim"],
            tie_embeddings=cfg.get("tie_word_embeddings", True),
            position_offset=2,  # OPT's learned position table starts at index 2
            norm_before=cfg.get("do_layer_norm_before", True),
            **common,
        )
    return config


def _tokenizer(path: Path, arch: str) -> ModelTokenizer:
    """tokenizer.json with tokenizer_config.json's special tokens and chat template."""
    if not (path / "tokenizer.json").exists():
        raise ModelLoadError(f"{path} has no tokenizer.json")
    tok_cfg = _read_json(path / "tokenizer_config.json")
    template = _chat_template(path, tok_cfg)
    try:
        hf_tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    except Exception as e:  # (the tokenizers library raises a bare Exception)
        raise ModelLoadError(f"cannot read {path / 'tokenizer.json'}: {e}") from e
    bos_token = _token_text(tok_cfg.get("bos_token"))
    add_bos = tok_cfg.get("add_bos_token")
    if add_bos is None:
        # No explicit setting (e.g. Llama 3): do what tokenizer.json's post-processor does.
        bos_id = hf_tok.token_to_id(bos_token) if bos_token else None
        add_bos = arch == "OPTForCausalLM" or (
            bos_id is not None and hf_tok.encode("a").ids[:1] == [bos_id]
        )
    try:
        return ModelTokenizer(
            tokenizer=hf_tok,
            chat_template=template,
            bos_token=bos_token,
            eos_token=_token_text(tok_cfg.get("eos_token")),
            add_bos=bool(add_bos),
        )
    except jinja2.TemplateError as e:
        raise ModelLoadError(f"{path}: the chat template is not valid Jinja: {e}") from e


def _chat_template(path: Path, tok_cfg: dict) -> str | None:
    # chat_template.jinja first, as transformers reads it: repositories that fix their
    # template there may keep the old one in tokenizer_config.json.
    jinja = path / "chat_template.jinja"
    template = jinja.read_text() if jinja.exists() else tok_cfg.get("chat_template")
    if template is None:  # (where multimodal processors wrote it before chat_template.jinja)
        template = _read_json(path / "chat_template.json").get("chat_template")
    if isinstance(template, list):
        # Named templates (Hermes, Command R: "default", "tool_use", "rag"); rows are
        # plain chats, so the default, as transformers takes it when no tools are given.
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        if not isinstance(named.get("default"), str):
            raise ModelLoadError(f"{path}: of the chat templates {sorted(map(str, named))}, "
                                 f"none is named 'default'")
        template = named["default"]
    return template


def _text_config(cfg: dict, path: Path) -> dict:
    """A multimodal model's text_config, with what its top level says for the whole model:
    the tokens that end generation (Gemma 3 4B's end of turn, 106, is named there only),
    and whether the LM head is the embedding matrix (transformers ties the whole model's by
    the top level's tie_word_embeddings, default true)."""
    text = cfg.get("text_config")
    if not isinstance(text, dict):
        raise ModelLoadError(f"{path}: config.json of {cfg['architectures']} has no "
                             f"text_config")
    eos = {"eos_token_id": cfg["eos_token_id"]} if cfg.get("eos_token_id") is not None else {}
    return {**text, **eos, "tie_word_embeddings": cfg.get("tie_word_embeddings", True)}


def windows_from_layer_types(layer_types: list[str], window: int | None, num_layers: int,
                             max_context: int, path: Path) -> tuple[int, ...]:
    """ModelConfig.layer_windows from a config's `layer_types` ("sliding_attention" or
    "full_attention", one a layer), the list transformers 5 keys each layer's mask by."""
    if len(layer_types) != num_layers:
        raise ModelLoadError(f"{path}: layer_types lists {len(layer_types)} layers for "
                             f"{num_layers}")
    other = sorted(set(layer_types) - {"sliding_attention", "full_attention"})
    if other:
        raise ModelLoadError(f"{path}: attention layer type {other[0]!r} is not supported")
    return sliding_windows([t == "sliding_attention" for t in layer_types], window,
                           max_context)


def _layer_windows(cfg: dict, arch: str, path: Path, num_layers: int, max_context: int,
                   nope: tuple[int, ...]) -> tuple[int, ...]:
    """Which layers slide, as transformers 5 decides it: every layer of a Mistral (7B v0.1)
    or a Phi-3 (Phi-3-mini-4k: 2,047 of 4,096) with a sliding_window; Qwen2/Qwen3 only with
    use_sliding_window, in the layers its layer_types names or, in configs written before
    that key, the layers from max_window_layers on; SmolLM3 likewise, by default in its NoPE
    layers. Llama's attention ignores a sliding_window key. (A missing key means what
    transformers' config classes default it to: 4,096, none for Phi-3 and SmolLM3.)"""
    window = cfg.get("sliding_window", None if arch in ("Phi3ForCausalLM", "SmolLM3ForCausalLM")
                     else 4096)
    if arch in ("MistralForCausalLM", "Phi3ForCausalLM"):
        return sliding_windows([True] * num_layers, window, max_context)
    if not cfg.get("use_sliding_window"):
        return ()
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        first = cfg.get("max_window_layers", 28)
        default = ["sliding_attention" if i >= first else "full_attention"
                   for i in range(num_layers)]
    elif arch == "SmolLM3ForCausalLM":
        default = ["sliding_attention" if i in nope and window is not None else
                   "full_attention" for i in range(num_layers)]
    else:
        return ()
    types = cfg.get("layer_types") or default
    return windows_from_layer_types(types, window, num_layers, max_context, path)


def _nope_layers(cfg: dict, arch: str, path: Path, num_layers: int) -> tuple[int, ...]:
    """SmolLM3's layers without RoPE, as transformers reads them: no_rope_layers, a flag a
    layer (1: rotates, 0: does not), or every no_rope_layer_interval-th layer (default 4)."""
    if arch != "SmolLM3ForCausalLM":
        return ()
    interval = cfg.get("no_rope_layer_interval", 4)
    flags = cfg.get("no_rope_layers") or [int((i + 1) % interval != 0)
                                          for i in range(num_layers)]
    if len(flags) < num_layers:
        raise ModelLoadError(f"{path}: no_rope_layers has {len(flags)} flags for "
                             f"{num_layers} layers")
    return tuple(i for i in range(num_layers) if not flags[i])


def _rope_theta(rope: dict, cfg: dict, legacy_key: str, default: float) -> float:
    """transformers >= 5 writes RoPE settings as rope_parameters = {rope_type, rope_theta,
    ...}; older configs have top-level keys (rope_theta, rope_scaling)."""
    return float(rope.get("rope_theta", cfg.get(legacy_key, default)))


def _gemma_config(cfg: dict, arch: str, path: Path, common: dict) -> ModelConfig:
    """Gemma 2 and Gemma 3 (text): see gemma.py for what their settings mean."""
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise ModelLoadError(f"{path}: Gemma activation {act!r} is not supported "
                             f"(supported: gelu_pytorch_tanh)")
    if cfg.get("use_bidirectional_attention"):
        raise ModelLoadError(f"{path}: bidirectional attention (an embedding model) is not "
                             f"supported")
    layers, heads = cfg["num_hidden_layers"], cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    # Which layers slide: layer_types where the config lists them (transformers >= 4.53
    # writes them); otherwise the last of every `pattern` layers is global.
    pattern = 2 if arch == "gemma2" else cfg.get("sliding_window_pattern", 6)
    types = cfg.get("layer_types") or [
        "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
    windows = windows_from_layer_types(types, cfg.get("sliding_window", 4096), layers,
                                       common["max_context"], path)
    # Gemma 3: rope_parameters per layer type (transformers >= 5), or rope_theta and
    # rope_scaling for the global layers and rope_local_base_freq for the sliding ones.
    rope = cfg.get("rope_parameters") or {}
    if arch == "gemma3":
        global_rope = rope.get("full_attention") or cfg.get("rope_scaling") or {}
        local_rope = rope.get("sliding_attention") or {}
        theta = _rope_theta(global_rope, cfg, "rope_theta", 1_000_000.0)
        local_theta = _rope_theta(local_rope, cfg, "rope_local_base_freq", 10_000.0)
        if hf_divisors(local_rope, head_dim, local_theta, str(path)):
            raise ModelLoadError(f"{path}: RoPE scaling on Gemma's sliding-window layers is "
                                 f"not supported")
        local_layers = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    else:
        global_rope = cfg.get("rope_scaling") or rope
        theta, local_theta = _rope_theta(rope, cfg, "rope_theta", 10_000.0), 0.0
        local_layers = ()
    # Gemma 3's attention ignores attn_logit_softcapping (transformers and llama.cpp alike).
    attn_softcap = (cfg.get("attn_logit_softcapping") or 0.0) if arch == "gemma2" else 0.0
    return ModelConfig(
        arch=arch,
        num_kv_heads=cfg.get("num_key_value_heads", heads),
        head_dim=head_dim,
        ffn_size=cfg["intermediate_size"],
        norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=theta,
        rope_divisors=hf_divisors(global_rope, head_dim, theta, str(path)),
        tie_embeddings=cfg.get("tie_word_embeddings", True),
        attn_scale=float(cfg.get("query_pre_attn_scalar", head_dim)) ** -0.5,
        logit_softcap=float(cfg.get("final_logit_softcapping") or 0.0),
        layer_windows=windows,
        attn_softcap=float(attn_softcap),
        rope_local_layers=local_layers,
        rope_local_theta=local_theta,
        **common,
    )


# Where multimodal checkpoints keep their text decoder: as stored (transformers 4 wrote
# these, and 5 writes them back on saving), and as transformers 5 names the modules.
_TEXT_PREFIXES = {"language_model.model.": "model.", "language_model.lm_head.": "lm_head.",
                  "model.language_model.": "model."}
# What else they hold (Gemma 3's SigLIP encoder and its projection into the text model).
_OTHER_TOWERS = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                 "model.multi_modal_projector.")


def _decoder_name(stored: str) -> str | None:
    """The name a stored tensor has in the text decoder (HF Llama's layout: model.layers...,
    lm_head), or None for another tower's tensor, which is not read."""
    if stored.startswith(_OTHER_TOWERS):
        return None
    for prefix, name in _TEXT_PREFIXES.items():
        if stored.startswith(prefix):
            return name + stored.removeprefix(prefix)
    # Some OPT checkpoints drop the "model." prefix.
    return stored if stored.startswith(("model.", "lm_head")) else f"model.{stored}"


def weight_files(path: Path) -> list[Path]:
    """The safetensors files that hold the model: those its index names (sharded
    checkpoints), or model.safetensors, or else every *.safetensors file. Mistral's
    directories also hold consolidated.safetensors, the same weights in another layout, which
    the index leaves out: read too, it would double the load's memory and time."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelLoadError(f"{index} has no weight_map")
        files = [path / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.exists()]
        if missing:
            raise ModelLoadError(f"{path} lacks {', '.join(missing)}, which {index.name} "
                                 f"names (an interrupted download?)")
        return files
    if (path / "model.safetensors").exists():
        return [path / "model.safetensors"]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path} has no *.safetensors files")
    return files


# What a checkpoint's weights may be stored as (safetensors' names); the model casts them to
# its dtype. Anything else is quantized data (int8, packed int32, unscaled fp8) that a cast
# would corrupt.
_WEIGHT_DTYPES = ("F32", "F16", "BF16", "F64")


def hf_tensor_shapes(path: Path) -> dict[str, list[int]]:
    """The decoder's tensors' shapes, from the safetensors headers alone (no tensor read);
    a tensor of a quantized type is refused here, before a load reads gigabytes."""
    shapes: dict[str, list[int]] = {}
    for f in weight_files(path):
        try:
            with safe_open(str(f), framework="pt") as tensors:
                headers = {name: tensors.get_slice(key) for key in tensors.keys()
                           if (name := _decoder_name(key)) is not None}
                dtypes = {name: h.get_dtype() for name, h in headers.items()}
                shapes.update({name: h.get_shape() for name, h in headers.items()})
        except Exception as e:
            raise ModelLoadError(f"cannot read {f}: {e}") from e
        bad = next((name for name, t in dtypes.items() if t not in _WEIGHT_DTYPES), None)
        if bad is not None:
            raise ModelLoadError(f"{f}: tensor {bad!r} is {dtypes[bad]}, a quantized type "
                                 f"(supported: F32, F16, BF16)")
    return shapes


def read_hf_weights(path: Path) -> dict[str, torch.Tensor]:
    """The decoder's tensors as stored (hf_tensor_shapes has checked their types)."""
    weights: dict[str, torch.Tensor] = {}
    for f in weight_files(path):
        try:
            # Tensor by tensor, as stored: another tower's are never read, and the model
            # casts each one once to its dtype on its device (an fp32 copy of a 7B model on
            # the host would take 27 GB and seconds).
            with safe_open(str(f), framework="pt") as tensors:
                for key in tensors.keys():
                    name = _decoder_name(key)
                    if name is not None:
                        weights[name] = tensors.get_tensor(key)
        except Exception as e:
            raise ModelLoadError(f"cannot read {f}: {e}") from e
    return weights
