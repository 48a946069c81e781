"""add_request(resume_from=...): a generation cut short goes on from the tokens it had, and
its result is the uninterrupted run's (fp32: batching and chunking do not change tokens)."""

from __future__ import annotations

import pytest

from llmdb.engine.params import SamplingParams


def chat(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


PROMPTS = [chat(f"Write a short story about a {x}.") for x in ("cat", "river", "clock", "tree")]


def _resumed(engine, prompt, params, tokens):
    rid = engine.add_request(prompt, params, resume_from=tokens)
    return engine.wait(rid)


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=24, ignore_eos=True),
    SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.9, top_p=0.9, seed=7),
], ids=["greedy", "seeded"])
def test_a_resumed_generation_is_the_uninterrupted_one(engine, params):
    whole = engine.generate(PROMPTS, params)
    for cut in (1, 9, 23):
        ids = [engine.add_request(p, params, resume_from=r.token_ids[:cut])
               for p, r in zip(PROMPTS, whole, strict=True)]
        for rid, r in zip(ids, whole, strict=True):
            got = engine.wait(rid)
            assert got.token_ids == r.token_ids and got.text == r.text, (cut, rid)
            assert got.usage.generated_tokens == 24 - cut
            assert got.usage.resumed_tokens == cut
            # (the prefix cache holds the resumed tokens too: only prompt tokens count)
            assert got.usage.cached_tokens <= got.usage.prompt_tokens


def test_resumed_beside_fresh_requests_in_one_batch(engine):
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    whole = engine.generate(PROMPTS, params)
    ids = [engine.add_request(p, params, resume_from=r.token_ids[:5 * (i % 2)])
           for i, (p, r) in enumerate(zip(PROMPTS, whole, strict=True))]
    assert [engine.wait(rid).token_ids for rid in ids] == [r.token_ids for r in whole]


def test_output_so_far_resumes_a_request_that_was_aborted(engine):
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    [whole] = engine.generate(PROMPTS[:1], params)
    rid = engine.add_request(PROMPTS[0], params)
    while engine.num_generated(rid) < 7:
        engine.step()
    so_far = engine.output_so_far(rid)
    assert so_far == whole.token_ids[:len(so_far)] and len(so_far) >= 7
    engine.abort(rid)
    assert engine.wait(rid).finish_reason == "abort"
    assert engine.output_so_far(rid) == []  # collected
    assert _resumed(engine, PROMPTS[0], params, so_far).token_ids == whole.token_ids


def test_a_stop_string_across_the_resume_point_still_stops(engine):
    free = SamplingParams(max_tokens=30, ignore_eos=True)
    [whole] = engine.generate(PROMPTS[2:3], free)
    tok = engine.tokenizer
    # A stop string that spans tokens 5 and 6 (the end of one, the start of the other).
    left, right = tok.decode(whole.token_ids[:6]), tok.decode(whole.token_ids[:7])
    assert len(right) > len(left) > 2
    stop = left[-2:] + right[len(left):len(left) + 1]
    expected = whole.text[:whole.text.index(stop)]
    params = SamplingParams(max_tokens=30, ignore_eos=True, stop=[stop])
    [plain] = engine.generate(PROMPTS[2:3], params)
    assert plain.text == expected
    got = _resumed(engine, PROMPTS[2], params, whole.token_ids[:6])
    assert (got.text, got.finish_reason) == (expected, "stop")


def test_resume_from_refused_naming_the_cause(engine):
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    [whole] = engine.generate(PROMPTS[:1], params)
    with pytest.raises(ValueError, match="nothing is left to generate"):
        engine.add_request(PROMPTS[0], params, resume_from=whole.token_ids)
    with pytest.raises(ValueError, match="logprobs"):
        engine.add_request(PROMPTS[0], SamplingParams(max_tokens=8, logprobs=2),
                           resume_from=whole.token_ids[:2])
    eos = engine.config.eos_token_ids[0]
    with pytest.raises(ValueError, match="stop token"):
        engine.add_request(PROMPTS[0], SamplingParams(max_tokens=8), resume_from=[eos])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request(PROMPTS[0], params, resume_from=[engine.config.vocab_size])
    with pytest.raises(TypeError, match="not text"):
        engine.add_request(PROMPTS[0], params, resume_from="hello")
    text = engine.tokenizer.decode(whole.token_ids[:3])
    with pytest.raises(ValueError, match="stop string"):
        engine.add_request(PROMPTS[0], SamplingParams(max_tokens=8, stop=[text[-2:]]),
                           resume_from=whole.token_ids[:3])
    assert not engine.has_unfinished
