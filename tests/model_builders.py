"""Tiny random models on disk, as transformers and llama.cpp's converter write them, and the
engine's comparison with transformers on them: what the model-loader tests share
(test_hf_models, test_gemma through gemma_models, test_phi3, test_gguf_loader,
test_gemma_gguf, test_gguf_spm). Each keeps its own variants, vocabulary and file layout."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import gguf
import pytest
import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers

from llmdb.engine.engine import LLMEngine
from llmdb.engine.outputs import RequestResult
from llmdb.engine.params import SamplingParams

# The words of the word-level vocabularies: every test text is spelled in them.
WORDS = (
    "the a an of to in is it and or not on at by for with from as be this that what which who "
    "how why when where sql table row column query select count sum avg join group order limit "
    "database index tree page cache model token user system assistant hello world good morning "
    "paris france capital blue sky prime number list python reverse haiku review battery day "
    "one two three four five six seven eight nine ten . , ? ! : ' \n"
).split(" ")
LOGIT_RTOL = 1e-4  # max |ours - transformers| relative to the reference's max |logit|
NEAR_TIE = 1e-4  # a top-2 logit margin below which float noise may pick either token


# ---- weights, tokenizers, directories --------------------------------------------------------


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights far from the defaults (norms of 1, biases of 0) so that a swapped or dropped
    tensor shows, and logits spread enough that greedy decoding is not all ties."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if "norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.3 * noise)
            elif name.endswith("bias"):
                p.copy_(0.1 * noise)
            elif "embed" in name:
                p.copy_(0.5 * noise)
            else:
                p.copy_(noise / p.shape[-1] ** 0.5)


def word_level_tokenizer(vocab: dict[str, int], specials: list[str], unk: str) -> Tokenizer:
    """One token a whitespace-separated word of `vocab`, `specials` matched whole."""
    tok = Tokenizer(models.WordLevel(vocab, unk_token=unk))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(specials)
    return tok


def copy_dir(src: Path, dst: Path, skip: str | None = None) -> Path:
    """A copy of the model directory `src`, less the file named `skip`."""
    dst.mkdir()
    for f in src.iterdir():
        if f.name != skip:
            (dst / f.name).write_bytes(f.read_bytes())
    return dst


def edit_config(src: Path, dst: Path, edit: Callable[[dict], object]) -> Path:
    """A copy of the model directory `src` whose config.json `edit` changed in place."""
    d = copy_dir(src, dst)
    cfg = json.loads((d / "config.json").read_text())
    edit(cfg)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


TINY_SPECIALS = ["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
TINY_CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def save_tiny_llama(path: Path) -> Path:
    """A tiny untied Llama (2 layers, GQA) with seeded random weights, a word-level
    tokenizer and a ChatML template, saved at `path` as transformers saves it: a plain HF
    directory for the tests of loading and registering models."""
    vocab = {t: i for i, t in enumerate(TINY_SPECIALS + sorted(set(WORDS) - {""}))}
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=len(vocab), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=128, max_position_embeddings=128,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = transformers.LlamaForCausalLM(cfg)
    randomize(model, 0)
    model.save_pretrained(path, safe_serialization=True)
    word_level_tokenizer(vocab, TINY_SPECIALS, unk="<pad>").save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": TINY_CHATML,
        "bos_token": "<s>", "eos_token": "<|im_end|>", "pad_token": "<pad>"}))
    return path


# ---- transformers as the reference ---------------------------------------------------------


def reference_models(dirs: dict[str, Path], cls=transformers.AutoModelForCausalLM
                     ) -> Callable[[str], torch.nn.Module]:
    """name -> transformers' model (of class cls) reloaded from dirs[name] (eager attention,
    fp32), loaded once; with no EOS, its generate() runs the full length (as ignore_eos
    does)."""
    cache: dict[str, torch.nn.Module] = {}

    def get(name: str) -> torch.nn.Module:
        if name not in cache:
            m = cls.from_pretrained(dirs[name], dtype=torch.float32,
                                    attn_implementation="eager").eval()
            m.generation_config.eos_token_id = None
            cache[name] = m
        return cache[name]

    return get


def cached_engines(dirs: dict[str, Path], kv_cache_bytes: int) -> Callable[..., LLMEngine]:
    """(name, attention, **LLMEngine options) -> an fp32, two-thread engine on dirs[name],
    made once for each set of arguments."""
    cache: dict[tuple, LLMEngine] = {}

    def get(name: str, attention: str = "cpu", **options) -> LLMEngine:
        key = (name, attention, *sorted(options.items()))
        if key not in cache:
            cache[key] = LLMEngine(model=str(dirs[name]), dtype="fp32",
                                   kv_cache_bytes=kv_cache_bytes, attention=attention,
                                   threads=2, **options)
        return cache[key]

    return get


@torch.inference_mode()
def ref_logits(model, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([ids])).logits[0].float()


def assert_close(ours: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    assert ours.shape == ref.shape, f"{what}: shape {tuple(ours.shape)} vs {tuple(ref.shape)}"
    scale = max(1.0, float(ref.abs().max()))
    diff = float((ours - ref).abs().max())
    assert diff <= LOGIT_RTOL * scale, f"{what}: max |diff| {diff:.3g} at logit scale {scale:.3g}"


def assert_logits_match(engine: LLMEngine, ref_model, sequences: list[list[int]],
                        what: str) -> None:
    """The engine's teacher-forced logits on each sequence are transformers' (whose logits
    must vary, or the comparison would prove little)."""
    for ids in sequences:
        ref = ref_logits(ref_model, ids)
        assert float(ref.std()) > 0.5, "degenerate model: logits hardly vary"
        assert_close(engine.logits(ids), ref, f"{what} len {len(ids)}")


def _assert_same_greedy(ref_model, prompt: list[int], ref: list[int], got: list[int]) -> None:
    """Identical, or at the first difference a near-tie in the reference's logits."""
    assert len(got) == len(ref), f"got {len(got)} tokens, reference {len(ref)}"
    i = next((k for k, (a, b) in enumerate(zip(ref, got, strict=True)) if a != b), None)
    if i is None:
        return
    top2 = ref_logits(ref_model, prompt + ref[:i])[-1].topk(2).values
    margin = float(top2[0] - top2[1])
    assert margin < NEAR_TIE, (
        f"greedy tokens differ at step {i}: reference {ref[i:]} ours {got[i:]}, "
        f"reference top-2 margin {margin:.3g} is not a near-tie"
    )


def assert_greedy_matches(engine: LLMEngine, ref_model, prompts: list[list[int]],
                          max_tokens: int,
                          pad_token_id: int) -> list[tuple[list[int], RequestResult]]:
    """All prompts in one engine call (decodes of different lengths batch together): each
    answer is transformers' greedy one, up to a near-tie. Returns (transformers' answer, the
    engine's result) a prompt."""
    results = engine.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    answers = []
    for prompt, res in zip(prompts, results, strict=True):
        with torch.inference_mode():
            out = ref_model.generate(
                torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=max_tokens, do_sample=False, pad_token_id=pad_token_id)
        ref = out[0, len(prompt):].tolist()
        _assert_same_greedy(ref_model, prompt, ref, res.token_ids)
        answers.append((ref, res))
    return answers


def assert_triton_path_matches(path: Path, ref_model, sequences: list[list[int]],
                               prompts: list[list[int]], max_tokens: int,
                               kv_cache_bytes: int, what: str) -> None:
    """The GPU kernels' forward, compiled on a GPU and run by Triton's interpreter on CPU
    tensors elsewhere (conftest), with prompts split over 24-token steps: transformers'
    logits on `sequences`, and the CPU path's greedy tokens on `prompts`."""
    pytest.importorskip("triton", reason="triton is not installed")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    engine = LLMEngine(model=str(path), device=device, attention="triton", dtype="fp32",
                       kv_cache_bytes=kv_cache_bytes, threads=2, max_num_batched_tokens=24)
    for ids in sequences:
        assert_close(engine.logits(ids), ref_logits(ref_model, ids), what)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    cpu = LLMEngine(model=str(path), dtype="fp32", kv_cache_bytes=kv_cache_bytes, threads=2)
    assert ([r.token_ids for r in engine.generate(prompts, params)]
            == [r.token_ids for r in cpu.generate(prompts, params)])
    assert engine.pool.num_free == engine.pool.num_blocks


# ---- GGUF files as llama.cpp's converter writes them -----------------------------------------

GGUF_TOP_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm",
                  "lm_head": "output"}


def gguf_tensor_name(hf_name: str, layer_names: dict[str, str]) -> str:
    """llama.cpp's name of a Hugging Face tensor; layer_names: the architecture's names of a
    layer's tensors (Hugging Face's, less "model.layers.N.")."""
    base, _, kind = hf_name.rpartition(".")  # kind: weight or bias
    if base.startswith("model.layers."):
        i, rest = base.removeprefix("model.layers.").split(".", 1)
        return f"blk.{i}.{layer_names[rest]}.{kind}"
    return f"{GGUF_TOP_NAMES[base]}.{kind}"


def add_gguf_shape(w: gguf.GGUFWriter, cfg: transformers.PretrainedConfig) -> None:
    """The hyperparameters every decoder's file states, from its transformers config."""
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)


def add_bpe_vocab(w: gguf.GGUFWriter, tokens: list[str], types: list[int], merges: list[str],
                  model: str = "gpt2", pre: str | None = "smollm") -> None:
    """tokenizer.ggml.* keys of a byte-level BPE (SmolLM's pre-tokenizer unless `pre` says
    otherwise; None: no such key)."""
    w.add_tokenizer_model(model)
    if pre is not None:
        w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)


def write_gguf_file(w: gguf.GGUFWriter) -> None:
    """Writes what was added to `w` (header, metadata, tensors) and closes the file."""
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
