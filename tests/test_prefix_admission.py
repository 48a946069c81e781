"""Requests that share a prompt prefix compute it once, even when submitted together."""

from __future__ import annotations

from llmdb.engine.params import SamplingParams

from .helpers import assert_same_tokens, chat

RULES = " ".join(f"Rule {i}: messages about topic {i} go to team {i % 5}." for i in range(30))


def test_shared_prefix_is_computed_once_and_tokens_do_not_change(engine):
    prompts = [engine.encode_prompt(chat(f"{RULES}\n\nMessage number {i}: my login fails."))
               for i in range(12)]
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    results = engine.generate(prompts, params)  # all submitted at once
    bs = engine.pool.block_size
    shared = min(len(p) for p in prompts) // bs * bs  # about the rules' full blocks
    cached = [r.usage.cached_tokens for r in results]
    # One request computes the shared blocks; every other one finds them in the cache.
    assert sorted(cached)[0] < shared - bs and all(c >= shared - 2 * bs for c in cached[1:])
    computed = sum(r.usage.prompt_tokens - r.usage.cached_tokens for r in results)
    assert computed < sum(map(len, prompts)) / 4
    for p, r in zip(prompts[:3], results[:3], strict=True):
        alone = engine.generate([p], params)[0]
        assert_same_tokens(engine, p, alone.token_ids, r.token_ids)
