"""Teacher-forced logits agree with llama.cpp on the same GGUF file."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from llmdb.engine.engine import LLMEngine
from llmdb.engine.params import SamplingParams
from llmdb.engine.registry import resolve_model

from .helpers import CHAT_QUESTIONS, chat

llama_cpp = pytest.importorskip("llama_cpp")

CONTINUATION = 32


@pytest.fixture(scope="module")
def llama():
    # verbose=True: verbose=False crashes llama-cpp-python on this machine.
    return llama_cpp.Llama(
        model_path=str(resolve_model("smollm2-135m")), n_ctx=512, n_batch=512,
        logits_all=True, verbose=True, n_threads=2,
    )


def _llama_logits(llama, ids: list[int]) -> torch.Tensor:
    llama.reset()
    llama.eval(ids)
    return torch.from_numpy(np.array(llama.scores[: len(ids)], dtype=np.float32))


def _compare(engine: LLMEngine, llama) -> tuple[float, float]:
    agree, total, cosines = 0, 0, []
    prompts = [engine.encode_prompt(chat(q)) for q in CHAT_QUESTIONS]
    for q, prompt in zip(CHAT_QUESTIONS, prompts, strict=True):
        assert prompt == llama.tokenize(
            engine.tokenizer.apply_chat_template(chat(q)).encode(), add_bos=False, special=True
        ), "tokenization differs from llama.cpp"
    # The continuations are only text to teacher-force both on: generated in one batch
    # (32 steps), not one question at a time (12 x 32 steps, 9x the time).
    results = engine.generate(prompts, SamplingParams(max_tokens=CONTINUATION, ignore_eos=True))
    for prompt, result in zip(prompts, results, strict=True):
        ids = prompt + result.token_ids
        ours = engine.logits(ids)[len(prompt) - 1 :]
        theirs = _llama_logits(llama, ids)[len(prompt) - 1 :]
        agree += int((ours.argmax(-1) == theirs.argmax(-1)).sum())
        total += ours.shape[0]
        cosines.append(torch.nn.functional.cosine_similarity(ours, theirs, dim=-1))
    return agree / total, float(torch.cat(cosines).mean())


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_teacher_forced_logits_match_llama_cpp(request, llama, dtype):
    engine = (request.getfixturevalue("engine_fp32") if dtype == "fp32"
              else LLMEngine("smollm2-135m", dtype="bf16", kv_cache_bytes=256 << 20))
    top1, cosine = _compare(engine, llama)
    print(f"llama.cpp parity {dtype}: top-1 agreement {top1:.4f}, mean cosine {cosine:.5f}")
    assert top1 >= 0.95
    assert cosine >= 0.998
