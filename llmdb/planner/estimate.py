"""From a dry run's counts to the numbers EXPLAIN LLM prints: cache hits, tokens, model time.

The dry run (Planner.dry_run) knows, per call site, the rows it would be evaluated on, the
distinct argument tuples it would compute, in which batches, and a uniform sample of those
tuples. Here the sample is rendered into the requests the SQL functions would send (the same
chat template, suffixes and cache keys as llmdb.functions), tokenized by the backend, and
looked up in the result cache; the batches then become requests for the engine's simulator
(engine/sim.py: the engine's scheduler and limits, the cost model as the clock), all
arriving at once, one batch after another as the planner submits them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from llmdb.backends import Backend
from llmdb.engine.costmodel import CostModel, load_cost_model
from llmdb.engine.sampling import SamplingParams
from llmdb.functions import CLASSIFY_INSTRUCTION, FILTER_SUFFIX, _key
from llmdb.session import Session

from .callsites import Site
from .learned import Learned
from .memo import SiteCounts, learn_key, thaw


@dataclass
class Requests:
    """The requests of one row, as the engine sees them."""

    prompts: list[int]  # prompt tokens per request (a classify: one per label)
    output: int  # tokens generated per request (prefill-only requests: 1, as in the engine)
    cache_key: str | None


@dataclass
class SiteEstimate:
    rows: int = 0
    distinct: int = 0
    cache_hits: int = 0
    calls: int = 0  # model requests
    prompt_tokens: int = 0
    output_tokens: int = 0
    model_s: float | None = None
    batches: list[int] = field(default_factory=list)


@lru_cache(maxsize=1)
def cost_model() -> CostModel:
    return load_cost_model()


def calibrated(model: CostModel) -> bool:
    return any(v > 0 for v in model.coefficients.values()) or model.floor_s > 0


def _model_name(session: Session, site: Site, args: list[Any]) -> str | None:
    return args[site.signature.index("model")] or session.options.model


def row_requests(site: Site, key: tuple, backend: Backend, max_output: int | None
                 ) -> Requests | None:
    """Mirrors llmdb.functions: the rendered prompts and cache key of one row."""
    a = dict(zip((p.name for p in site.signature.params), thaw(site.signature, key),
                 strict=True))
    if site.function == "llm_complete":
        if a["prompt"] is None:
            return None
        params = SamplingParams(
            max_tokens=256 if a["max_tokens"] is None else int(a["max_tokens"]),
            temperature=0.0 if a["temperature"] is None else float(a["temperature"]),
            top_p=1.0 if a["top_p"] is None else float(a["top_p"]),
            seed=None if a["seed"] is None else int(a["seed"]),
            stop=[s for s in (a["stop"] or []) if s])
        rendered = backend.render_chat(a["prompt"], a["system"])
        out = params.max_tokens if max_output is None else min(max_output, params.max_tokens)
        return Requests([backend.count_tokens(rendered)], max(1, out),
                        _key(backend, "complete", [rendered, params.__dict__]))
    if site.function in ("llm_filter", "llm_filter_score"):
        if a["prompt"] is None:
            return None
        rendered = backend.render_chat(a["prompt"] + FILTER_SUFFIX, a["system"])
        return Requests([backend.count_tokens(rendered)], 1,
                        _key(backend, "filter", [rendered, ("yes", "no")]))
    if a["text"] is None or not a["labels"]:
        return None
    choices = list(a["labels"])
    head = a["instruction"] or CLASSIFY_INSTRUCTION.format(labels=", ".join(choices))
    rendered = backend.render_chat(f"{head}\n\nText: {a['text']}", a["system"])
    n = backend.count_tokens(rendered)
    # Each label is scored after the prompt: its tokens plus the end of turn.
    return Requests([n + backend.count_tokens(c) + 1 for c in choices], 1,
                    _key(backend, "classify", [rendered, choices]))


def estimate_site(session: Session, site: Site, counts: SiteCounts, learned: Learned
                  ) -> SiteEstimate:
    est = SiteEstimate(rows=counts.rows, distinct=counts.distinct, batches=list(counts.batches))
    sample = [k for k in counts.sampled if k[0] is not None]
    if not sample or not counts.computed:
        est.model_s = 0.0
        return est
    backend = session.backend(_model_name(session, site, thaw(site.signature, sample[0])))
    generated = learned.generated_per_call(learn_key(session, site))
    max_output = None if generated is None else math.ceil(generated)
    rows = [r for r in (row_requests(site, k, backend, max_output) for k in sample) if r]
    if not rows:
        return est
    cache = session.cache()
    keys = [r.cache_key for r in rows if r.cache_key is not None]
    hits = cache.get_many(keys) if cache is not None and keys else {}
    hit_rate = sum(r.cache_key in hits for r in rows) / len(rows)
    # Rows with a NULL prompt make no call: scale by the sample's non-NULL share.
    live = counts.computed * len(sample) / max(1, len(counts.sampled))
    est.cache_hits = round(live * hit_rate)
    per_row = sum(len(r.prompts) for r in rows) / len(rows)
    est.calls = round((live - est.cache_hits) * per_row)
    prompt_lens = [n for r in rows for n in r.prompts]
    est.prompt_tokens = round(est.calls * sum(prompt_lens) / len(prompt_lens))
    outputs = [r.output for r in rows for _ in r.prompts]
    mean_out = sum(outputs) / len(outputs)
    # Prefill-only requests generate nothing the stats count.
    est.output_tokens = round(est.calls * mean_out) if site.function == "llm_complete" else 0
    share = (live - est.cache_hits) / counts.computed
    est.model_s = model_time(backend, counts.batches, share, per_row, prompt_lens, outputs)
    return est


def model_time(backend: Backend, batches: list[int], share: float, per_row: float,
               prompt_lens: list[int], outputs: list[int]) -> float | None:
    """Simulated seconds for the batches (of rows), each submitted when the previous one is
    done; `share` of the rows miss the result cache, each sending `per_row` requests whose
    lengths cycle through the sampled ones."""
    engine = getattr(backend, "engine", None)
    cm = cost_model()
    if engine is None or not calibrated(cm):
        return None
    from llmdb.engine.sim import SimConfig, simulate
    from llmdb.engine.workloads import RequestSpec

    sched = engine.scheduler
    cfg = SimConfig(num_blocks=engine.pool.num_blocks, block_size=engine.pool.block_size,
                    max_num_batched_tokens=sched.max_num_batched_tokens,
                    max_prefill_tokens=sched.max_prefill_tokens,
                    max_num_seqs=sched.max_num_seqs)
    total, j = 0.0, 0
    for b in batches:
        specs = []
        for _ in range(round(b * share * per_row)):
            k = j % len(prompt_lens)
            specs.append(RequestSpec(0.0, prompt_lens[k], outputs[k], "BE", f"e{j}"))
            j += 1
        if specs:
            total += simulate(specs, sched.policy.name, cm, cfg).end_time
    return total
