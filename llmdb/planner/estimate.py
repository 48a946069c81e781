"""From a dry run's counts to the numbers EXPLAIN LLM prints: cache hits, tokens, model time.

The dry run (Planner.dry_run) knows, per call site, the rows it would be evaluated on, the
distinct argument tuples it would compute, in which batches, and a uniform sample of those
tuples. Here the sample is rendered into the requests the SQL functions would send (the same
chat template, suffixes and cache keys as llmdb.functions), tokenized as the engine will,
and looked up in the result cache. The batches then become requests for the engine's
simulator (engine/sim.py: the engine's own scheduler, limits and prefix caching, the cost
model as its clock), with the sampled prompts' token ids, all arriving at once, one batch
after the other as the planner submits them; the simulator's pool starts with the prompt
blocks the engine's pool holds now, so a shared chat template or instruction counts once,
prompts an earlier query computed count as cached, and a suffix after a cached prefix pays
its attention over it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from llmdb.backends import Backend, Prompt
from llmdb.engine.cache.block_pool import block_hash
from llmdb.engine.costmodel import CostModel, load_cost_model
from llmdb.engine.params import SamplingParams
from llmdb.functions import _key, classify_row_call, filter_row_call
from llmdb.session import Session

from .callsites import Site
from .learned import Learned, stable_hash
from .memo import SiteCounts, learn_key, thaw


@dataclass
class Request:
    """One model request of a row, as the engine sees it."""

    ids: list[int] | None  # prompt token ids (None: a backend without a local tokenizer)
    tokens: int  # prompt tokens (a scored continuation included)
    output: int  # tokens generated (prefill-only requests: 1, as the engine counts steps)
    cacheable: int = 0  # tokens a prefix hit may cover (the engine computes the rest)

    def __post_init__(self) -> None:
        self.cacheable = self.cacheable or self.tokens - 1


@dataclass
class Row:
    requests: list[Request]
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


_override: CostModel | None = None  # set by use_cost_model
_default: CostModel | None = None  # the default engine's, loaded once


def cost_model(backend: Backend | None = None) -> CostModel:
    """The cost model estimates are timed with: one set by use_cost_model (tests,
    bench/explain.py), else the backend's engine's own (calibrated for its model, dtype and
    device, or its labelled estimate), else that of the default engine on this CPU."""
    global _default
    if _override is not None:
        return _override
    engine_model = getattr(getattr(backend, "engine", None), "cost_model", None)
    if isinstance(engine_model, CostModel):
        return engine_model
    if _default is None:
        _default = load_cost_model()
    return _default


def use_cost_model(model: CostModel | None) -> None:
    """Estimate with `model`, e.g. a calibration file, whatever the engine; None: the
    engine's own again (and the default reloaded)."""
    global _override, _default
    _override, _default = model, None


def calibrated(model: CostModel) -> bool:
    return any(v > 0 for v in model.coefficients.values()) or model.floor_s > 0


def _encode(backend: Backend, prompt: Prompt) -> tuple[list[int] | None, int]:
    engine = getattr(backend, "engine", None)
    if engine is not None:
        ids = engine.encode_prompt(prompt)
        return ids, len(ids)
    return None, backend.count_tokens(prompt)


def row_requests(site: Site, key: tuple, backend: Backend, lengths: list[int]) -> Row | None:
    """Mirrors llmdb.functions: the requests and result-cache key of one row."""
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
        # The learned output-length histogram, else max_tokens (no early end of turn).
        out = min(lengths[stable_hash(key) % len(lengths)], params.max_tokens) if lengths \
            else params.max_tokens
        ids, n = _encode(backend, rendered)
        return Row([Request(ids, n, max(1, out))],
                   _key(backend, "complete", [rendered, params.__dict__]))
    if site.function in ("llm_filter", "llm_filter_score"):
        if a["prompt"] is None:
            return None
        call, _ = filter_row_call(backend, a["prompt"], a["system"], "BE")
        return Row([Request(*_encode(backend, r.prompt), 1) for r in call.requests], call.key)
    if a["text"] is None or not a["labels"]:
        return None
    try:
        call, _ = classify_row_call(backend, a["text"], a["labels"], a["instruction"],
                                    a["system"], "BE")
    except ValueError:  # ill-formed labels: the row fails when it runs, with its cause
        return None
    requests = []
    engine = getattr(backend, "engine", None)
    for r in call.requests:  # each label is scored after its prompt: its tokens, end of turn
        ids, n = _encode(backend, r.prompt)
        if engine is None or ids is None:
            requests.append(Request(None, n + backend.count_tokens(r.continuation) + 1, 1))
        else:
            cont = [*engine.tokenizer.encode_plain(r.continuation),
                    getattr(backend, "_end_of_turn", 0)]
            requests.append(Request(ids + cont, n + len(cont), 1, cacheable=n - 1))
    return Row(requests, call.key)


def _leading_blocks(ids: list[int], block_size: int, limit: int) -> list[tuple[int, tuple]]:
    """(chained hash, tokens) of the full blocks of ids within the first `limit` tokens."""
    out, parent = [], None
    for b in range(min(len(ids), limit) // block_size):
        tokens = tuple(ids[b * block_size:(b + 1) * block_size])
        parent = block_hash(parent, tokens)
        out.append((parent, tokens))
    return out


def pool_prefixes(requests: list[Request], block_size: int, pool: Any | None) -> list[int]:
    """Prompt tokens of each request whose blocks the engine's pool holds now (left by earlier
    queries): the leading full blocks it finds there, hashes chained as the pool chains them."""
    out = []
    for r in requests:
        hits = 0
        if r.ids is not None and pool is not None:
            for h, tokens in _leading_blocks(r.ids, block_size, r.cacheable):
                if pool.lookup(h, tokens) is None:
                    break
                hits += 1
        out.append(hits * block_size)
    return out


def shared_prefixes(requests: list[Request], block_size: int, held: list[int]) -> list[int]:
    """Prompt tokens of each request that other rows can share: the leading full blocks held
    in the pool or also leading another sampled request (a template, a system prompt)."""
    blocks = [_leading_blocks(r.ids or [], block_size, r.cacheable) for r in requests]
    seen: dict[int, int] = {}
    for bl in blocks:
        for h, _ in bl:
            seen[h] = seen.get(h, 0) + 1
    out = []
    for bl, pooled in zip(blocks, held, strict=True):
        k = 0
        while k < len(bl) and ((k + 1) * block_size <= pooled or seen[bl[k][0]] > 1):
            k += 1
        out.append(k * block_size)
    return out


def _model_name(session: Session, site: Site, args: list[Any]) -> str | None:
    return args[site.signature.index("model")] or session.options.model


def estimate_site(session: Session, site: Site, counts: SiteCounts, learned: Learned, *,
                  observed: bool = False) -> SiteEstimate:
    """The estimate for a dry run's counts; with observed=True, the cost model's time for
    what a real run did (its cache hits, unscaled), to learn the time scale from."""
    est = SiteEstimate(rows=counts.rows, distinct=counts.distinct, batches=list(counts.batches))
    sample = [k for k in counts.sampled if k[0] is not None]
    if not sample or not counts.computed:
        est.model_s = 0.0
        return est
    backend = session.backend(_model_name(session, site, thaw(site.signature, sample[0])))
    lengths = learned.output_lengths(learn_key(session, site))
    rows = [r for r in (row_requests(site, k, backend, lengths) for k in sample) if r]
    if not rows:
        return est
    cache = None if observed else session.cache()
    keys = [r.cache_key for r in rows if r.cache_key is not None]
    hits = cache.get_many(keys) if cache is not None and keys else {}
    hit_rate = sum(r.cache_key in hits for r in rows) / len(rows)
    if observed:
        hit_rate = min(1.0, counts.cache_hits / counts.computed)
    # Rows with a NULL argument make no call: scale by the sample's non-NULL share.
    live = counts.computed * len(sample) / max(1, len(counts.sampled))
    est.cache_hits = round(live * hit_rate)
    requests = [q for r in rows for q in r.requests]
    per_row = len(requests) / len(rows)
    est.calls = round((live - est.cache_hits) * per_row)
    est.prompt_tokens = round(est.calls * sum(q.tokens for q in requests) / len(requests))
    if site.function == "llm_complete":  # prefill-only requests generate nothing counted
        est.output_tokens = round(est.calls * sum(q.output for q in requests) / len(requests))
    share = (live - est.cache_hits) / counts.computed
    # What a real run found in the prefix cache is known; replaying the pool after it would
    # find its own blocks.
    cached = [round(counts.cached_tokens / counts.calls)] * len(requests) \
        if observed and counts.calls else None
    est.model_s = model_time(backend, counts.batches, share, per_row, requests, cached)
    if est.model_s is not None and not observed:
        est.model_s *= learned.time_scale(backend.name)[0]
    return est


def model_time(backend: Backend, batches: list[int], share: float, per_row: float,
               requests: list[Request], cached: list[int] | None = None) -> float | None:
    """Simulated seconds for the batches (of rows), each submitted when the previous one is
    done; `share` of the rows miss the result cache, each sending `per_row` requests like
    the sampled ones (cycled through in order).

    The simulator gets the sampled prompts' own token ids and the engine's prefix caching, so
    a shared template is computed once and a suffix after a cached prefix pays attention over
    it, as in the engine. Its pool starts with the prefixes the engine's pool holds now, or,
    for a run already made, with each request's first `cached` tokens (what it found). A
    sampled request used again stands for another row: it keeps only its shareable prefix."""
    engine = getattr(backend, "engine", None)
    cm = cost_model(backend)
    if engine is None or not calibrated(cm):
        return None
    from llmdb.engine.research.sim import SimConfig, simulate
    from llmdb.engine.research.workloads import RequestSpec

    sched = engine.scheduler
    block = engine.pool.block_size
    caching = engine.pool.enable_prefix_caching and all(r.ids is not None for r in requests)
    held = cached if cached is not None else pool_prefixes(requests, block, engine.pool)
    if not caching:
        held = [0] * len(requests)
    shared = shared_prefixes(requests, block, held) if caching else held
    # Prefixes in the pool when a batch starts (an ordered set): what the engine holds now,
    # then what earlier batches computed that later rows share.
    seeds = dict.fromkeys(tuple(r.ids[:h]) for r, h in zip(requests, held, strict=True) if h) \
        if caching else {}
    total, j = 0.0, 0
    for b in batches:
        specs, used = [], set()
        for _ in range(round(b * share * per_row)):
            k, cycle = j % len(requests), j // len(requests)
            r = requests[k]
            ids = None
            if caching:
                ids = list(r.ids)
                if cycle:  # another row: distinct tokens after its shareable prefix
                    ids[shared[k]:] = [-(cycle * 1_000_000 + t) for t in ids[shared[k]:]]
                used.add(k)
            specs.append(RequestSpec(0.0, r.tokens, r.output, "BE", f"e{j}",
                                     prompt_ids=None if ids is None else tuple(ids)))
            j += 1
        if not specs:
            continue
        cfg = SimConfig(num_blocks=engine.pool.num_blocks, block_size=block,
                        max_num_batched_tokens=sched.max_num_batched_tokens,
                        max_prefill_tokens=sched.max_prefill_tokens,
                        max_num_seqs=sched.max_num_seqs, prefix_caching=caching,
                        cached_prefixes=list(seeds))
        total += simulate(specs, sched.policy.name, cm, cfg).end_time
        seeds.update(dict.fromkeys(tuple(requests[k].ids[:shared[k]]) for k in sorted(used)
                                   if shared[k]))
    return total
