"""transformers as the reference of a model test (tests/test_gemma3_multimodal.py,
tests/test_smollm3.py): the models reloaded from the directories under test, and greedy
generation compared with theirs."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
import transformers

from llmdb.engine.engine import LLMEngine
from llmdb.engine.params import SamplingParams

from .test_hf_models import _assert_same_greedy


def reference_models(dirs: dict[str, Path], cls=transformers.AutoModelForCausalLM
                     ) -> Callable[[str], torch.nn.Module]:
    """name -> the transformers model of dirs[name] (eager attention, fp32, generating to
    the full length), loaded once."""
    cache: dict[str, torch.nn.Module] = {}

    def get(name: str) -> torch.nn.Module:
        if name not in cache:
            m = cls.from_pretrained(dirs[name], dtype=torch.float32,
                                    attn_implementation="eager").eval()
            m.generation_config.eos_token_id = None
            cache[name] = m
        return cache[name]

    return get


@torch.inference_mode()
def assert_greedy_is_transformers(ref_model, engine: LLMEngine, prompts: list[list[int]],
                                  pad: int, max_tokens: int = 10) -> None:
    """The engine's greedy tokens for the prompts, all in one batch, are transformers'
    (or differ first at a near-tie of its logits); the model is not degenerate."""
    results = engine.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    distinct = set()
    for prompt, res in zip(prompts, results, strict=True):
        out = ref_model.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_tokens, do_sample=False, pad_token_id=pad)
        ref = out[0, len(prompt):].tolist()
        distinct.update(ref)
        _assert_same_greedy(ref_model, prompt, ref, res.token_ids)
    assert len(distinct) > 3, "degenerate model: greedy output is nearly constant"
