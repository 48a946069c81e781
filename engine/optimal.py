"""Optimal schedules for small offline workloads: InferMax's Sec. 5 constraint problem on CP-SAT.

All requests are present at t = 0 with known input I and output O. A schedule is a sequence
of batches; before each batch some requests may be evicted (their cache dropped, to be
recomputed later), then each request processes c tokens. The objective is InferMax's: the
total latency, i.e. the sum of the batch times under the linear cost model (costmodel.py),
with the coefficients scaled to integers. Variables, per request i and batch j (InferMax's
names; j = 0 is the initial state):

  S[i,j] = I_i + gen[i,j]  tokens of the sequence after batch j (prompt + generated)
  m[i,j]                   tokens in its cache after batch j
  c[i,j]                   tokens processed in batch j;  g[i,j] it generates a token there
  e[i,j]                   evicted before batch j

InferMax's constraints: sum_j g = O (termination); S grows by g (non-decreasing length);
m = 0 if evicted, else m + c (memory); c = 0 if evicted, else c <= S - m (tokens to process);
g = 1 iff c = S - m (generation); sum_i c <= C and sum_i m <= M per batch. Added here, the
ones it omits "for brevity" and what a faithful bound needs:
  - phase: dec[i,j] iff the request has generated a token and has exactly one token left
    (the engine's is_decode); pre[i,j] = active and not dec. A refill is a prefill.
  - P: the prefill tokens of a batch, sum_i c - sum_i dec, are at most P.
  - memory is counted while the batch runs: u = m[j-1] + c (the engine allocates before it
    computes), and a request that has generated its O-th token frees its cache (m = 0), so
    finishing is not an eviction.
  - an eviction needs cache to drop: e[i,j] => m[i,j-1] >= 1 (so only unfinished requests
    holding cache are evicted, and every counted eviction is real).
  - optionally no hybrid batches (hybrid=False), or no evictions (forbid_evictions=True).
  - symmetry breaking: identical requests finish in index order; empty batches come last.

Batch time: the cost model's features as integer expressions. The quadratic prefill term
sum(c^2 + 2cm) telescopes per chunk to u^2 - m^2, encoded with AddMultiplicationEquality
(u * u, for which CP-SAT has square cuts) and the m^2 of the previous state; InferMax's
(1 + 0.1[B > 1]) factors are indicator variables times the summed term; a floor is
max(floor, linear) per non-empty batch. Coefficients are rounded down, so the solver's bound
is a lower bound on the real cost of any schedule. KV cache only (no hidden cache, no swaps).

The rest only tightens the linear relaxation, which is what proves a bound: gen is
order-encoded (z[i,t,j] = [gen[i,j] >= t]), so "token t in batch j" is linear; token t needs
I + t - 1 cached, a knapsack over M with clique cuts (tokens that cannot share M); hold[i,j]
= [u >= I] persists until an eviction or the end and excludes others' tokens that cannot
share M with it; the dropped cache w = e * m is recomputed (sum_j c = I + O - 1 + sum_j w);
every eviction is followed by a prefill. Without the last three the relaxation evicts a
fraction of a request almost for free: InferMax's I = 8 instance (bench/optimal.py) was
not proved in a minute; with them it is, in about 35 s.

Horizon: with no max_batches, the most batches a schedule as fast as the starting one can
have (_horizon), so the bound holds for any schedule, not only for J batches. The search
starts from the fastest of a policy's schedule in the simulator (hint_policy), a given
schedule (hint_steps), and serving the requests one at a time; every variable is hinted.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from ortools.sat.python import cp_model

from .cache.block_pool import BlockPool
from .costmodel import Chunk, CostModel
from .params import SamplingParams
from .sched.policies import Policy, make_policy
from .sched.request import Request
from .sched.scheduler import Scheduler, SchedulerOutput
from .sim import SimConfig, simulate
from .workloads import RequestSpec

# ---- schedules and their replay -----------------------------------------------------------


@dataclass(frozen=True)
class Step:
    """One batch as decided: who is evicted before it, and tokens processed per request."""

    evict: tuple[int, ...]
    tokens: dict[int, int]  # request index -> c (>= 1)


@dataclass(frozen=True)
class Work:
    request: int
    computed: int  # cached tokens before the batch (m)
    tokens: int  # c
    decode: bool


@dataclass
class Batch:
    evicted: list[int]
    work: list[Work]
    time_s: float


@dataclass
class Replay:
    batches: list[Batch]
    latency: float  # seconds: the sum of the batch times
    evictions: int
    token_times: list[list[float]]  # per request, the time of each generated token


class InvalidSchedule(ValueError):
    pass


def replay(requests: Sequence[tuple[int, int]], steps: Sequence[Step], cost_model: CostModel,
           C: int, P: int, M: int, hybrid: bool = True) -> Replay:
    """Run a schedule as the engine would, checking every constraint (InvalidSchedule).

    The requests advance through the scheduler's own bookkeeping (run, preempt,
    update_from_output, finish) over a pool of M one-token blocks; only the choice of
    batches comes from the schedule instead of a policy."""
    reqs = [Request(f"r{i}", list(range(i * 100_000, i * 100_000 + inp)),
                    SamplingParams(max_tokens=out, ignore_eos=True))
            for i, (inp, out) in enumerate(requests)]
    index = {r.request_id: i for i, r in enumerate(reqs)}
    sched = Scheduler(BlockPool(max(M, 1), 1, enable_prefix_caching=False), C, len(reqs),
                      "fcfs", P)  # the policy is never asked: the schedule decides
    for r in reqs:
        sched.add(r)
    times: list[list[float]] = [[] for _ in reqs]
    now, evictions, batches = 0.0, 0, []
    for j, step in enumerate(steps):
        for i in step.evict:
            if reqs[i].is_finished or reqs[i].num_computed == 0:
                raise InvalidSchedule(f"batch {j}: request {i} has no cache to evict")
            sched.preempt(SchedulerOutput(), reqs[i])
            evictions += 1
        work = []
        for i, c in sorted(step.tokens.items()):
            r = reqs[i]
            if r.is_finished or i in step.evict or not 1 <= c <= r.num_tokens - r.num_computed:
                raise InvalidSchedule(f"batch {j}: request {i} cannot process {c} tokens")
            work.append(Work(i, r.num_computed, c, r.is_decode))
        if sum(w.tokens for w in work) > C:
            raise InvalidSchedule(f"batch {j}: more than C = {C} tokens")
        if sum(w.tokens for w in work if not w.decode) > P:
            raise InvalidSchedule(f"batch {j}: more than P = {P} prefill tokens")
        live = sum(r.num_computed for r in reqs if not r.is_finished)
        if live + sum(w.tokens for w in work) > M:
            raise InvalidSchedule(f"batch {j}: more than M = {M} cached tokens")
        if not hybrid and len({w.decode for w in work}) > 1:
            raise InvalidSchedule(f"batch {j}: prefills and decodes mixed")
        out = SchedulerOutput()
        for w in work:
            sched.run(out, reqs[w.request], w.tokens)
        t = cost_model.step_time([Chunk(w.computed, w.tokens, w.decode) for w in work])
        now += t
        for r in sched.update_from_output(out.scheduled, None, now):
            times[index[r.request_id]].append(now)
            if len(r.output_ids) >= r.params.max_tokens:
                sched.finish(r)
        batches.append(Batch(list(step.evict), work, t))
    unfinished = [i for i, r in enumerate(reqs) if not r.is_finished]
    if unfinished:
        raise InvalidSchedule(f"requests {unfinished} do not finish")
    return Replay(batches, now, evictions, times)


# ---- starting points ----------------------------------------------------------------------


def _specs(requests: Sequence[tuple[int, int]]) -> list[RequestSpec]:
    return [RequestSpec(0.0, inp, out, "RT", f"r{i}") for i, (inp, out) in enumerate(requests)]


def sim_config(C: int, P: int, M: int) -> SimConfig:
    """The simulator with M counted in tokens (one-token blocks), as the constraints count it."""
    return SimConfig(num_blocks=M, block_size=1, max_num_batched_tokens=C, max_prefill_tokens=P)


def policy_steps(requests: Sequence[tuple[int, int]], policy: str, cost_model: CostModel,
                 C: int, P: int, M: int) -> list[Step]:
    """The simulator's batches under `policy`, recorded by a subclass of it that logs what
    each call to schedule() returned (the scheduler accepts a policy object)."""
    log: list[tuple[list[str], list[tuple[str, int]]]] = []

    class Recording(type(make_policy(policy))):  # type: ignore[misc]
        def schedule(self, s, now):
            out = super().schedule(s, now)
            log.append(([r.request_id for r in out.preempted],
                        [(r.request_id, k) for r, k in out.scheduled]))
            return out

    recorder: Policy = Recording()
    simulate(_specs(requests), recorder, cost_model, sim_config(C, P, M))  # type: ignore[arg-type]
    steps, pending = [], []
    for evicted, scheduled in log:
        pending += [int(r[1:]) for r in evicted]
        if scheduled:  # a call that scheduled nothing is not a batch; its evictions carry on
            steps.append(Step(tuple(pending), {int(r[1:]): k for r, k in scheduled}))
            pending = []
    return steps


def serial_steps(requests: Sequence[tuple[int, int]], C: int, P: int) -> list[Step]:
    """One request at a time: its prompt in chunks of min(C, P), then its decodes. Never
    evicts; feasible whenever every request fits in M alone."""
    steps = []
    for i, (inp, out) in enumerate(requests):
        chunk = min(C, P)
        steps += [Step((), {i: min(chunk, inp - k)}) for k in range(0, inp, chunk)]
        steps += [Step((), {i: 1}) for _ in range(out - 1)]
    return steps


def _by_finish(requests: Sequence[tuple[int, int]], steps: list[Step],
               rep: Replay) -> list[Step]:
    """Relabel identical requests so that they finish in index order (the symmetry the
    model breaks), keeping the schedule itself."""
    groups: dict[tuple[int, int], list[int]] = {}
    for i, r in enumerate(requests):
        groups.setdefault(r, []).append(i)
    perm = {}
    for members in groups.values():
        for new, old in zip(members, sorted(members, key=lambda i: rep.token_times[i][-1]),
                            strict=True):
            perm[old] = new
    return [Step(tuple(perm[i] for i in s.evict), {perm[i]: c for i, c in s.tokens.items()})
            for s in steps]


# ---- the model ----------------------------------------------------------------------------

# The 1.1 factor of the batched-attention terms, as a tenth on top (integer coefficients).
_BATCHED_EXTRA = 0.1


@dataclass
class _Vars:
    model: cp_model.CpModel
    c: list[list[cp_model.IntVar]]  # [i][j], j = 0 .. J-1 for batches 1 .. J
    e: list[list[cp_model.IntVar]]
    scale: float  # objective units per second


def _horizon(requests: Sequence[tuple[int, int]], cost_model: CostModel, M: int,
             latency: float) -> int | None:
    """The most batches a schedule no slower than `latency` can have (None: no cost per
    batch to tell). Every batch costs at least `base` (the cheapest phase with no tokens);
    on top, every schedule computes each request's I + O - 1 tokens, each prompt's prefill
    attention I^2, and its first tokens in at least n / (prompts that fit in M) prefill
    batches."""
    coef = cost_model.coefficients
    base_d = coef["const"] + coef["decode_on"] + coef["n_decode"]
    base_p = coef["const"] + coef["prefill_on"] + coef["n_prefill"]
    if cost_model.floor_s > 0:  # max(floor, linear) does not split; the floor alone
        base_d, base_p = max(base_d, cost_model.floor_s), max(base_p, cost_model.floor_s)
        work = 0.0
    else:
        work = (coef["tokens"] * sum(inp + out - 1 for inp, out in requests)
                + coef["prefill_attn"] * sum(inp * inp for inp, _ in requests))
    base = min(base_d, base_p)
    if base <= 0:
        return None
    prefill_batches = math.ceil(len(requests) / _fits(sorted(i for i, _ in requests), M))
    work += prefill_batches * (base_p - base)
    return math.floor((latency - work) / base * (1 + 1e-9))


def _scale(cost_model: CostModel) -> float:
    """Objective units per second: the smallest used coefficient becomes >= 1000 units, so
    rounding down changes no term by more than 0.1%."""
    used = [v for v in cost_model.coefficients.values() if v > 0]
    if cost_model.floor_s > 0:
        used.append(cost_model.floor_s)
    if not used:
        raise ValueError(f"cost model {cost_model.name!r} has no positive coefficient")
    return 10.0 ** math.ceil(math.log10(1000.0 / min(used)))


def _build(requests: Sequence[tuple[int, int]], cost_model: CostModel, C: int, P: int, M: int,
           J: int, forbid_evictions: bool, hybrid: bool) -> _Vars:
    md = cp_model.CpModel()
    n = len(requests)
    scale = _scale(cost_model)
    k = {f: math.floor(v * scale) for f, v in cost_model.coefficients.items()}
    k10 = {f: math.floor(v * _BATCHED_EXTRA * scale) for f, v in cost_model.coefficients.items()}
    top = [min(M, inp + out - 1) for inp, out in requests]  # the most a request ever caches
    # A request's k-th token (k = 1 .. O) needs its whole sequence, I + k - 1 tokens, cached.
    size = {(i, t): inp + t - 1 for i, (inp, out) in enumerate(requests) for t in range(1, out + 1)}

    # State after batch j (j = 0: the initial state, constants). The generated count is
    # order-encoded, z[i][t][j] = [gen[i,j] >= t], so that "token t in batch j" is the
    # linear z[i][t][j] - z[i][t][j-1], which the cuts below use.
    zero = md.new_constant(0)
    z = [[[zero] + [md.new_bool_var(f"z{i},{t},{j}") for j in range(1, J + 1)]
          for t in range(1, out + 1)] for i, (_, out) in enumerate(requests)]
    m = [[zero] + [md.new_int_var(0, top[i], f"m{i},{j}") for j in range(1, J + 1)]
         for i in range(n)]
    sqm = [[zero] + [md.new_int_var(0, top[i] ** 2, f"sqm{i},{j}") for j in range(1, J + 1)]
           for i in range(n)]
    for zi in z:
        for t, zt in enumerate(zi):
            md.add(zt[J] == 1)  # termination: all O tokens generated
            for j in range(1, J + 1):
                md.add_implication(zt[j - 1], zt[j])  # S never shrinks
                if t:
                    md.add_implication(zt[j], zi[t - 1][j])

    def gen(i: int, j: int):  # noqa: ANN202 - a linear expression
        return sum(zt[j] for zt in z[i])

    cs, es, nonempty, objective = [[] for _ in range(n)], [[] for _ in range(n)], [], []
    ws, rs, pres_i, pas_i, holds = ([[] for _ in range(n)] for _ in range(5))
    for j in range(1, J + 1):
        acts, decs, pres, toks, us, dks, pms, pas = [], [], [], [], [], [], [], []
        for i, (inp, out) in enumerate(requests):
            c = md.new_int_var(0, min(C, top[i]), f"c{i},{j}")
            e = md.new_bool_var(f"e{i},{j}")
            act = md.new_bool_var(f"act{i},{j}")
            dec = md.new_bool_var(f"dec{i},{j}")
            pre = md.new_bool_var(f"pre{i},{j}")
            u = md.new_int_var(0, top[i], f"u{i},{j}")  # cache held while batch j runs
            squ = md.new_int_var(0, top[i] ** 2, f"squ{i},{j}")
            cs[i].append(c)
            es[i].append(e)
            m0, done0, done = m[i][j - 1], z[i][-1][j - 1], z[i][-1][j]
            g = gen(i, j) - gen(i, j - 1)  # 0 or 1: the token generated in batch j
            left = inp + gen(i, j - 1) - m0  # S[i,j-1] - m[i,j-1], tokens still to compute

            # Eviction: only of cache that is there; an evicted request computes nothing.
            # w = e * m[i,j-1], the cache it drops, keeps u linear in m, w and c.
            if forbid_evictions:
                md.add(e == 0)
            w = md.new_int_var(0, top[i], f"w{i},{j}")
            md.add(m0 >= 1).only_enforce_if(e)
            md.add(c == 0).only_enforce_if(e)
            md.add(w == m0).only_enforce_if(e)
            md.add(w == 0).only_enforce_if(~e)
            md.add(u == m0 - w + c)
            # A finished request runs no more; finishing frees its cache (not an eviction):
            # r = the cache released after its last token.
            r = md.new_int_var(0, top[i], f"r{i},{j}")
            md.add(c == 0).only_enforce_if(done0)
            md.add(r == u).only_enforce_if(done, ~done0)
            md.add(r == 0).only_enforce_if(~done)
            md.add(r == 0).only_enforce_if(done0)
            md.add(m[i][j] == u - r)
            md.add_multiplication_equality(squ, [u, u])
            md.add(sqm[i][j] == 0).only_enforce_if(done)
            md.add(sqm[i][j] == squ).only_enforce_if(~done)
            # Tokens to process; a token is generated exactly when all are processed.
            gen_now = md.new_bool_var(f"g{i},{j}")
            md.add(g == gen_now)
            md.add(c <= left)
            md.add(c == left).only_enforce_if(gen_now)
            md.add(c <= left - 1).only_enforce_if(~gen_now)
            md.add(c >= 1).only_enforce_if(act)
            md.add(c == 0).only_enforce_if(~act)
            # Phase: a decode computes the one token it generated last (the engine's
            # is_decode); everything else that runs, refills included, is a prefill.
            has_out = z[i][0][j - 1]
            last = md.new_bool_var(f"last{i},{j}")
            md.add(left == 1).only_enforce_if(last)
            md.add(left != 1).only_enforce_if(~last)
            md.add_bool_and([act, has_out, last]).only_enforce_if(dec)
            md.add_bool_or([~act, ~has_out, ~last, dec])
            md.add(act == dec + pre)
            # Cost terms: decode K/V read, prefill prefix read, sum(c^2 + 2cm) = u^2 - m^2.
            dk = md.new_int_var(0, top[i], f"dk{i},{j}")
            md.add(dk == m0).only_enforce_if(dec)
            md.add(dk == 0).only_enforce_if(~dec)
            pm = md.new_int_var(0, top[i], f"pm{i},{j}")
            md.add(pm == m0).only_enforce_if(pre)
            md.add(pm == 0).only_enforce_if(~pre)
            pa = md.new_int_var(0, top[i] ** 2, f"pa{i},{j}")
            md.add(pa == squ - sqm[i][j - 1]).only_enforce_if(pre)
            md.add(pa == 0).only_enforce_if(~pre)
            # Redundant, for the solver's bound: generating token t needs u = I + t - 1; a
            # first token comes from a prefill; a decode generates.
            tok = [z[i][t][j] - z[i][t][j - 1] for t in range(out)]
            md.add(u >= sum(size[i, t + 1] * x for t, x in enumerate(tok)))
            md.add(gen_now <= act)
            md.add(dec <= gen_now)
            md.add(tok[0] <= pre)
            # hold = [u >= I]: it holds at least its prompt's worth in this batch, as it
            # does whenever it generates; it keeps holding until evicted or finished; an
            # eviction while holding drops at least I. With the cliques of _token_cuts
            # this makes the relaxation pay a whole eviction for letting another decode.
            hold = md.new_bool_var(f"hold{i},{j}")
            md.add(u >= inp).only_enforce_if(hold)
            md.add(u <= inp - 1).only_enforce_if(~hold)
            md.add(u >= inp * hold)
            md.add(hold >= gen_now)
            if j > 1:
                prev, fin = holds[i][-1], z[i][-1][j - 1] - z[i][-1][j - 2]
                md.add(hold >= prev - fin - e)
                md.add(w >= inp * (e + prev - fin - 1))
            holds[i].append(hold)
            ws[i].append(w)
            rs[i].append(r)
            pres_i[i].append(pre)
            pas_i[i].append(pa)
            acts.append(act)
            decs.append(dec)
            pres.append(pre)
            toks.append(c)
            us.append(u)
            dks.append(dk)
            pms.append(pm)
            pas.append(pa)

        # Batch constraints: C, M (while the batch runs), and P over the prefill tokens.
        md.add(sum(toks) <= C)
        md.add(sum(us) <= M)
        md.add(sum(toks) - sum(decs) <= P)
        ne = md.new_bool_var(f"nonempty{j}")
        md.add_max_equality(ne, acts)
        nonempty.append(ne)
        _token_cuts(md, requests, size, M, z, j, ne, [h[-1] for h in holds])

        nd, any_d, many_d = _indicators(md, decs, f"dec{j}")
        np_, any_p, many_p = _indicators(md, pres, f"pre{j}")
        firsts = [z[i][0][j] - z[i][0][j - 1] for i in range(n)]
        md.add(sum(firsts) <= _fits(sorted(inp for inp, _ in requests), M) * any_p)
        if not hybrid:
            md.add(any_d + any_p <= 1)
        # The summed terms that get InferMax's 10% extra when a phase has several requests.
        dk_sum = md.new_int_var(0, M, f"dksum{j}")
        md.add(dk_sum == sum(dks))
        dk_extra = md.new_int_var(0, M, f"dkextra{j}")
        md.add(dk_extra == dk_sum).only_enforce_if(many_d)
        md.add(dk_extra == 0).only_enforce_if(~many_d)
        pa_top = sum(x * x for x in top)
        pa_sum = md.new_int_var(0, pa_top, f"pasum{j}")
        md.add(pa_sum == sum(pas))
        pa_extra = md.new_int_var(0, pa_top, f"paextra{j}")
        md.add(pa_extra == pa_sum).only_enforce_if(many_p)
        md.add(pa_extra == 0).only_enforce_if(~many_p)

        linear = (k["const"] * ne + k["tokens"] * sum(toks)
                  + k["decode_kv"] * dk_sum + k10["decode_kv"] * dk_extra
                  + k["decode_on"] * any_d + k10["decode_on"] * many_d + k["n_decode"] * nd
                  + k["prefill_attn"] * pa_sum + k10["prefill_attn"] * pa_extra
                  + k["prefill_on"] * any_p + k10["prefill_on"] * many_p
                  + k["n_prefill"] * np_ + k["prefill_m"] * sum(pms))
        if cost_model.floor_s > 0:  # max(floor, linear) for a non-empty batch
            t = md.new_int_var(0, 2**62, f"t{j}")
            md.add(t >= linear)
            md.add(t >= math.floor(cost_model.floor_s * scale) * ne)
            objective.append(t)
        else:
            objective.append(linear)

    # Redundant, for the bound: a request computes its I + O - 1 tokens plus all it dropped;
    # it releases I + O - 1 when it finishes; every eviction is followed by a refill, which
    # is a prefill; its first prefill alone costs sum(c^2 + 2cm) = I^2.
    for i, (inp, out) in enumerate(requests):
        md.add(sum(cs[i]) == inp + out - 1 + sum(ws[i]))
        md.add(sum(rs[i]) == inp + out - 1)
        md.add(sum(pres_i[i]) >= 1 + sum(es[i]))
        md.add(sum(pas_i[i]) >= inp * inp)
    # Symmetry: empty batches last; identical requests finish in index order.
    for a, b in itertools.pairwise(nonempty):
        md.add_implication(b, a)
    for i in range(n - 1):
        if requests[i] == requests[i + 1]:
            for j in range(1, J + 1):
                md.add_implication(z[i + 1][-1][j], z[i][-1][j])
    md.minimize(sum(objective))
    return _Vars(md, cs, es, scale)


def _fits(sizes: Sequence[int], budget: int) -> int:
    """How many of `sizes` (ascending) fit in `budget` together."""
    total = count = 0
    for s in sizes:
        total += s
        if total > budget:
            break
        count += 1
    return count


def _indicators(md: cp_model.CpModel, xs: list, name: str) -> tuple:
    """The count of xs, and exact indicators for "at least one" and "more than one" (with
    pairwise cuts, tighter than the count alone in the linear relaxation)."""
    count = sum(xs)
    any_, many = md.new_bool_var(f"any{name}"), md.new_bool_var(f"many{name}")
    md.add(count >= 1).only_enforce_if(any_)
    md.add(count == 0).only_enforce_if(~any_)
    md.add(count >= 2).only_enforce_if(many)
    md.add(count <= 1).only_enforce_if(~many)
    for a, x in enumerate(xs):
        md.add(any_ >= x)
        for y in xs[a + 1:]:
            md.add(many >= x + y - 1)
    return count, any_, many


def _token_cuts(md: cp_model.CpModel, requests: Sequence[tuple[int, int]],
                size: dict[tuple[int, int], int], M: int, z: list, j: int,
                ne: cp_model.IntVar, hold: list[cp_model.IntVar]) -> None:
    """Memory as a knapsack over the tokens generated in batch j (token (i, t) needs
    size[i, t] cached), and its cliques: tokens bigger than M/2 exclude each other, and a
    smaller one excludes those it cannot share M with; a batch holds at most one of each
    clique, and only if it is non-empty. A request b holding its prompt (hold[b]) excludes
    the tokens of others that cannot share M with I_b."""
    tok = {(i, t): z[i][t - 1][j] - z[i][t - 1][j - 1] for (i, t) in size}
    md.add(sum(size[a] * x for a, x in tok.items()) <= M)
    big = [a for a in size if 2 * size[a] > M]
    if big:
        md.add(sum(tok[a] for a in big) <= ne)
    for a in size:
        if 2 * size[a] <= M:
            clique = [b for b in big if size[a] + size[b] > M and b[0] != a[0]]
            if clique:
                md.add(tok[a] + sum(tok[b] for b in clique) <= ne)
    for b, (inp_b, _) in enumerate(requests):
        crowded = [a for a in size if a[0] != b and size[a] + inp_b > M]
        if crowded:
            md.add(sum(tok[a] for a in crowded if a in big) + hold[b] <= 1)
            for a in crowded:
                if a not in big:
                    md.add(tok[a] + hold[b] <= 1)


def _fix(v: _Vars, steps: Sequence[Step]) -> None:
    """Pin the decisions (c, e) to a schedule; padded with empty batches."""
    for i, (row_c, row_e) in enumerate(zip(v.c, v.e, strict=True)):
        for j, (c, e) in enumerate(zip(row_c, row_e, strict=True)):
            step = steps[j] if j < len(steps) else Step((), {})
            v.model.add(c == step.tokens.get(i, 0))
            v.model.add(e == int(i in step.evict))


def _steps_from(v: _Vars, solver: cp_model.CpSolver) -> list[Step]:
    J = len(v.c[0])
    steps = []
    for j in range(J):
        tokens = {i: solver.value(row[j]) for i, row in enumerate(v.c) if solver.value(row[j])}
        evict = tuple(i for i, row in enumerate(v.e) if solver.value(row[j]))
        if tokens:
            steps.append(Step(evict, tokens))
    return steps


def _full_hint(requests: Sequence[tuple[int, int]], cost_model: CostModel, C: int, P: int,
               M: int, J: int, forbid_evictions: bool, hybrid: bool,
               steps: Sequence[Step]) -> list[int] | None:
    """Every variable's value for a schedule: the same model with the decisions pinned,
    solved (propagation alone settles it). None if the model rejects the schedule."""
    v = _build(requests, cost_model, C, P, M, J, forbid_evictions, hybrid)
    _fix(v, steps)
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = 30.0
    solver.parameters.num_workers = 1
    if solver.solve(v.model) not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None
    return list(solver.response_proto.solution)


# ---- solving ------------------------------------------------------------------------------


@dataclass
class OptimalResult:
    latency: float  # seconds: the best schedule found, replayed under the cost model
    bound: float  # seconds: the solver's lower bound on the optimal latency
    status: str  # OPTIMAL (proved), FEASIBLE (time limit hit), INFEASIBLE, UNKNOWN
    evictions: int
    schedule: list[Batch]
    steps: list[Step] = field(default_factory=list)  # the same schedule as decisions
    token_times: list[list[float]] = field(default_factory=list)
    hint: str = ""  # where the starting schedule came from
    hint_latency: float = math.inf
    max_batches: int = 0
    solve_s: float = 0.0

    @property
    def gap_pct(self) -> float:
        """How far the schedule found may be from the optimum, in percent of the bound."""
        return 100.0 * (self.latency - self.bound) / self.bound if self.bound > 0 else math.inf


def _starting_point(requests: Sequence[tuple[int, int]], cost_model: CostModel, C: int,
                    P: int, M: int, forbid_evictions: bool, hybrid: bool,
                    hint_policy: str | None, hint_steps: Sequence[Step] | None,
                    ) -> tuple[str, list[Step], Replay | None]:
    """The fastest valid one of: the policy's schedule, the given one, one at a time."""
    options = []
    if hint_policy:
        options.append((hint_policy, policy_steps(requests, hint_policy, cost_model, C, P, M)))
    if hint_steps:
        options.append(("given", list(hint_steps)))
    options.append(("serial", serial_steps(requests, C, P)))
    best: tuple[str, list[Step], Replay | None] = ("none", [], None)
    for name, steps in options:
        try:
            rep = replay(requests, steps, cost_model, C, P, M, hybrid)
        except InvalidSchedule:
            continue
        if forbid_evictions and rep.evictions:
            continue
        if best[2] is None or rep.latency < best[2].latency:
            best = (name, _by_finish(requests, steps, rep), rep)
    return best


def solve(requests: Sequence[tuple[int, int]], cost_model: CostModel, C: int = 4096,
          P: int = 512, M: int = 4096, max_batches: int | None = None,
          time_limit_s: float = 60.0, forbid_evictions: bool = False,
          hint_policy: str | None = "sarathi", hint_steps: Sequence[Step] | None = None,
          hybrid: bool = True, workers: int = 1, seed: int = 0, log: bool = False,
          params: dict[str, object] | None = None) -> OptimalResult:
    """The minimum total latency of serving `requests` (I, O), all present at t = 0, under
    the token budget C, the prefill budget P and M tokens of cache.

    max_batches None: the horizon that makes the bound hold for any schedule (see above).
    The search starts from the fastest valid one of hint_policy's schedule in the simulator,
    hint_steps, and serving one request at a time. One worker with the full linear
    relaxation (linearization_level 2) proved the most on this 2-core machine; `params`
    overrides any CP-SAT parameter.
    """
    if any(inp < 1 or out < 1 for inp, out in requests):
        raise ValueError("every request needs I >= 1 and O >= 1")
    if any(inp + out - 1 > M for inp, out in requests):
        raise ValueError(f"a request needs more than M = {M} cached tokens on its own")
    started = time.perf_counter()
    hint, steps, rep = _starting_point(requests, cost_model, C, P, M, forbid_evictions,
                                       hybrid, hint_policy, hint_steps)
    if max_batches is None:
        J = _horizon(requests, cost_model, M, rep.latency) if rep is not None else None
        if J is None:
            raise ValueError("no starting schedule, or no cost per batch to bound the "
                             "horizon with: pass max_batches")
        J = max(J, len(steps))
    else:
        J = max_batches
    v = _build(requests, cost_model, C, P, M, J, forbid_evictions, hybrid)
    values = None
    if rep is not None and len(steps) <= J:
        values = _full_hint(requests, cost_model, C, P, M, J, forbid_evictions, hybrid, steps)
    if values is not None:
        for idx, val in enumerate(values):
            v.model.add_hint(v.model.get_int_var_from_proto_index(idx), val)
    else:
        hint = f"{hint} (rejected by the model; no hint)" if rep is not None else "none"

    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = time_limit_s
    solver.parameters.num_workers = workers
    solver.parameters.linearization_level = 2
    solver.parameters.random_seed = seed
    solver.parameters.log_search_progress = log
    for key, value in (params or {}).items():
        setattr(solver.parameters, key, value)
    status = solver.solve(v.model)
    name = solver.status_name(status)
    hint_latency = rep.latency if rep is not None else math.inf
    if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        found = _steps_from(v, solver)
    elif rep is not None and status == cp_model.UNKNOWN:
        found = steps  # stopped before it registered the hint: the hint is still a schedule
    else:
        return OptimalResult(math.inf, math.inf if status == cp_model.INFEASIBLE else 0.0,
                             name, 0, [], hint=hint, hint_latency=hint_latency,
                             max_batches=J, solve_s=time.perf_counter() - started)
    best = replay(requests, found, cost_model, C, P, M, hybrid)
    bound = min(max(0.0, solver.best_objective_bound / v.scale), best.latency)
    return OptimalResult(best.latency, bound, name, best.evictions, best.batches, found,
                         best.token_times, hint, hint_latency, J,
                         time.perf_counter() - started)
