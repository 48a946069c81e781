"""The GPU benchmark tooling, checked on a CPU with tiny shapes.

bench/random_model.py must write directories that our loader and transformers both open with
every tensor accounted for, and on which our engine's logits equal transformers'; the bare
decoder (bench/bare_decoder.py), the ceiling the engine is compared with on GPUs, must
produce transformers' greedy tokens. On the GPU machine there is no time to find out.
"""

from __future__ import annotations

import json
import random
import shutil
import sys
from pathlib import Path

import pytest
import torch
import transformers

from llmdb.engine.engine import LLMEngine
from llmdb.engine.models import load_model

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import bare_decoder  # noqa: E402
import random_model  # noqa: E402
import throughput  # noqa: E402
from bare_decoder import BareDecoder, run_bare  # noqa: E402
from random_model import SHAPES, write_random_model  # noqa: E402

TINY = ["tiny-llama", "tiny-opt"]
# (The bare decoder has no Q/K/V biases, Q/K norms or fused weights.)
LOADED = [*TINY, "tiny-qwen2-mha", "tiny-qwen3-mha", "tiny-phi3", "tiny-gemma2", "tiny-gemma3"]
LOGIT_ATOL = 1e-4  # fp32 on both sides: the implementations agree to ~1e-6 here


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("random_models")
    return {name: write_random_model(name, root / name, seed=3, dtype=torch.float32,
                                     device="cpu") for name in LOADED}


@pytest.fixture(scope="module")
def hf_models(model_dirs):
    return {name: transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32).eval() for name, path in model_dirs.items()}


def _ids(n: int, vocab: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(n)]


@torch.inference_mode()
def _hf_logits(model, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([ids])).logits[0].float()


@torch.inference_mode()
def _hf_greedy(model, prompts: list[list[int]], new: int) -> list[list[int]]:
    """One batch of equal-length prompts; min_new_tokens keeps EOS from ending rows early."""
    out = model.generate(torch.tensor(prompts), do_sample=False, max_new_tokens=new,
                         min_new_tokens=new, pad_token_id=0)
    return out[:, len(prompts[0]):].tolist()


# ---- random_model ----------------------------------------------------------------------------


def test_real_shapes_have_the_published_sizes():
    millions = {name: random_model.num_params(SHAPES[name]) / 1e6 for name in SHAPES}
    assert round(millions["smollm2-135m"]) == 135
    assert round(millions["llama3.2-1b"]) == 1236
    assert round(millions["llama2-7b"]) == 6738
    assert round(millions["opt-125m"]) == 125
    assert round(millions["opt-1.3b"]) == 1316
    assert round(millions["opt-13b"]) == 12853
    assert round(millions["qwen2.5-0.5b"]) == 494
    assert round(millions["qwen3-0.6b"]) == 596
    assert round(millions["phi3-mini"]) == 3821
    assert random_model.num_params(SHAPES["gemma3-1b"]) == 999_885_952  # as published
    assert random_model.num_params(SHAPES["gemma2-2b"]) == 2_614_341_888


@pytest.mark.parametrize("name", LOADED)
def test_both_loaders_open_it(name, model_dirs):
    path, shape = model_dirs[name], SHAPES[name]
    _, info = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched tensors
    loaded = load_model(path)
    c = loaded.config
    arch = shape.arch if shape.arch in ("opt", "gemma2", "gemma3") else "llama"
    assert (c.arch, c.vocab_size, c.hidden_size, c.num_layers) == (
        arch, shape.vocab, shape.hidden, shape.layers)
    assert (c.num_heads, c.num_kv_heads, c.ffn_size) == (shape.heads, shape.kv_heads, shape.ffn)
    assert c.eos_token_ids == (shape.eos,)
    tok = loaded.tokenizer
    assert tok.vocab_size == shape.vocab
    assert tok.decode(list(range(shape.vocab)), skip_special=False).split() == [
        shape.specials.get(i, f"w{i}") for i in range(shape.vocab)]
    assert tok.token_id(tok.eos_token) == shape.eos


@pytest.mark.parametrize("name", LOADED)
def test_engine_logits_match_transformers(name, model_dirs, hf_models):
    engine = LLMEngine(str(model_dirs[name]), dtype="fp32")
    for n, seed in ((1, 0), (19, 1), (70, 2)):
        ids = _ids(n, SHAPES[name].vocab, seed)
        ref = _hf_logits(hf_models[name], ids)
        assert float(ref.std()) > 0.05, "logits too flat for the comparison to mean anything"
        torch.testing.assert_close(engine.logits(ids), ref, atol=LOGIT_ATOL, rtol=0)


def test_sharded_directory_loads(tmp_path, model_dirs):
    """Above max_shard_bytes the weights go to several files and an index, as HF writes."""
    path = write_random_model("tiny-llama", tmp_path / "sharded", seed=3, dtype=torch.float32,
                              device="cpu", max_shard_bytes=200_000)
    shards = sorted(p.name for p in path.glob("*.safetensors"))
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(shards)
    whole = load_model(model_dirs["tiny-llama"]).weights
    split = load_model(path).weights
    assert whole.keys() == split.keys()
    assert all(torch.equal(whole[k], split[k]) for k in whole)  # seeded by name, not order
    _, info = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, output_loading_info=True)
    assert not any(info.values()), info


def test_existing_directory_is_reused(tmp_path):
    path = write_random_model("tiny-opt", tmp_path / "m", seed=1, device="cpu")
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    write_random_model("tiny-opt", tmp_path / "m", seed=1, device="cpu")
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp
    write_random_model("tiny-opt", tmp_path / "m", seed=2, device="cpu")
    assert (path / "model.safetensors").stat().st_mtime_ns != stamp
    assert json.loads((path / random_model.MARKER).read_text())["seed"] == 2


# ---- bare decoder ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", TINY)
def test_bare_decoder_logits_match_transformers(name, model_dirs, hf_models):
    """The prefill path's logits at every position (tokens alone could agree by luck)."""
    ids = _ids(33, SHAPES[name].vocab, seed=5)
    dec = BareDecoder(model_dirs[name], 1, 64, 1, torch.device("cpu"), torch.float32)
    with torch.inference_mode():
        t = torch.tensor([ids])
        hidden = dec.model.forward(t, dec.arange[: len(ids)][None], dec._prefill_attend(0, 33))
        ours = dec.model.logits(hidden[0])
    torch.testing.assert_close(ours, _hf_logits(hf_models[name], ids), atol=LOGIT_ATOL, rtol=0)


def test_bare_decoder_scales_rope_as_the_config_says(model_dirs, tmp_path):
    """Llama 3's RoPE scaling (Llama-3.2-1B's config has it): the bare decoder rotates by the
    scaled frequencies, as transformers does. The small original context makes the scaling
    reach the frequencies that matter over 33 positions."""
    scaled = tmp_path / "tiny-llama3-rope"
    shutil.copytree(model_dirs["tiny-llama"], scaled)
    config = json.loads((scaled / "config.json").read_text())
    config["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
    (scaled / "config.json").write_text(json.dumps(config))
    ids = _ids(33, SHAPES["tiny-llama"].vocab, seed=5)

    def bare_logits(path: Path) -> torch.Tensor:
        dec = BareDecoder(path, 1, 64, 1, torch.device("cpu"), torch.float32)
        with torch.inference_mode():
            hidden = dec.model.forward(torch.tensor([ids]), dec.arange[: len(ids)][None],
                                       dec._prefill_attend(0, 33))
            return dec.model.logits(hidden[0])

    ours = bare_logits(scaled)
    hf = transformers.AutoModelForCausalLM.from_pretrained(scaled, dtype=torch.float32).eval()
    torch.testing.assert_close(ours, _hf_logits(hf, ids), atol=LOGIT_ATOL, rtol=0)
    assert (ours - bare_logits(model_dirs["tiny-llama"])).abs().max() > 10 * LOGIT_ATOL


@pytest.mark.parametrize("name", TINY)
def test_bare_decoder_greedy_equals_transformers(name, model_dirs, hf_models):
    vocab = SHAPES[name].vocab
    prompts = [_ids(12, vocab, seed) for seed in range(3)]
    res = run_bare(model_dirs[name], prompts, 10, device="cpu")
    assert res["tokens"] == _hf_greedy(hf_models[name], prompts, 10)
    assert res["generated_tokens"] == 30 and res["decode_steps"] == 9
    # Static batches of two rows give the same tokens.
    assert run_bare(model_dirs[name], prompts, 10, 2, device="cpu")["tokens"] == res["tokens"]


def test_bare_decoder_ragged_rows_across_windows(model_dirs, hf_models):
    """Rows of different lengths and outputs in one batch, one of them decoding past the
    first attention window: each row's tokens are what transformers gives it alone."""
    name = "tiny-llama"
    vocab = SHAPES[name].vocab
    lens, outs = [3, 250, 40], [7, 12, 1]
    prompts = [_ids(n, vocab, seed=10 + n) for n in lens]
    assert lens[1] + outs[1] > bare_decoder.WINDOW
    res = run_bare(model_dirs[name], prompts, outs, device="cpu")
    for p, m, got in zip(prompts, outs, res["tokens"], strict=True):
        assert got == _hf_greedy(hf_models[name], [p], m)[0]
    assert res["generated_tokens"] == sum(outs)


# ---- throughput workloads --------------------------------------------------------------------


def test_nanovllm_workload_is_nano_vllms():
    rows = throughput.nanovllm_workload()
    assert len(rows) == 256
    assert sum(r["max_tokens"] for r in rows) == 133_966  # nano-vllm's published total
    assert all(100 <= len(r["token_ids"]) <= 1024 for r in rows)
    assert max(t for r in rows for t in r["token_ids"]) <= 10_000


def test_the_llmdb_worker_gets_the_engine_flags():
    """--mixed-graphs and --batch-invariant reach the engine's subprocess (--mixed-graphs
    once did not: the bulk A/B compared graphs on with on)."""
    def worker_args(*flags: str):
        args = throughput.parse_args(["--device", "cuda", "--shape", "smollm2-135m", *flags])
        cmd = throughput._worker_cmd("llmdb-dir", args, Path("rows.json"), Path("model"))
        return throughput.parse_args(cmd[2:])  # (after python and the script)

    got = worker_args("--mixed-graphs", "off", "--batch-invariant")
    assert (got.worker, got.mixed_graphs, got.batch_invariant) == ("llmdb-dir", "off", True)
    got = worker_args()
    assert (got.mixed_graphs, got.batch_invariant) == ("on", False)


def test_the_bundled_run_refuses_batch_invariant(monkeypatch):
    """Its engine would not be given the flag: it says so rather than run without it."""
    monkeypatch.setattr(throughput, "run_bundled", lambda args: pytest.fail("it ran"))
    with pytest.raises(SystemExit, match="--batch-invariant needs --shape or --model-dir"):
        throughput.main(["--batch-invariant"])


def test_standard_prompts_file_matches_the_bundled_tokenizer():
    stored = json.loads(throughput.STANDARD_PROMPTS.read_text())["rows"]
    prompts, _ = throughput.bundled_prompts(400)
    assert stored == [p["token_ids"] for p in prompts]
    rows = throughput.standard_workload(400, 64, vocab=320)
    assert all(max(r["token_ids"]) < 320 and r["max_tokens"] == 64 for r in rows)


@pytest.mark.parametrize("name", ["gemma3-1b", "gemma2-2b"])
def test_published_gemma_configs_read_as_transformers_reads_them(name, tmp_path):
    """Google's config.json keys (no layer_types; Gemma 3's sliding_window_pattern and
    rope_local_base_freq; Gemma 2's caps): windows, local RoPE, scales as transformers has
    them. No weights needed to read a config."""
    from llmdb.engine.models.hf_dir import read_hf_metadata

    from .gemma_models import _assert_config_is

    random_model.write_metadata(SHAPES[name], tmp_path, torch.bfloat16)
    config, _ = read_hf_metadata(tmp_path)
    _assert_config_is(config, transformers.AutoConfig.from_pretrained(tmp_path))
    assert max(config.layer_windows) == SHAPES[name].extra["sliding_window"]
    assert not config.hidden_cache_support()[0]
