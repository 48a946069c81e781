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

try:
    from ortools.sat.python import cp_model
except ImportError as e:  # an optional dependency: only the bound needs it
    raise ImportError("the optimal-schedule bound needs OR-Tools: pip install 'llmdb[bound]'"
                      ) from e

from ..costmodel import CostModel
from .schedules import (
    Batch,
    InvalidSchedule,
    Replay,
    Step,
    policy_steps,
    replay,
    serial_steps,
)

# ---- the model ----------------------------------------------------------------------------

# The 1.1 factor of the batched-attention terms, as a tenth on top (integer coefficients).
_BATCHED_EXTRA = 0.1


@dataclass(frozen=True)
class _Problem:
    """What is solved: the requests (I, O), the cost model and the budgets."""

    requests: Sequence[tuple[int, int]]
    cost_model: CostModel
    C: int
    P: int
    M: int
    forbid_evictions: bool
    hybrid: bool

    @property
    def top(self) -> list[int]:
        """The most each request ever caches."""
        return [min(self.M, inp + out - 1) for inp, out in self.requests]

    @property
    def size(self) -> dict[tuple[int, int], int]:
        """A request's t-th token (t = 1 .. O) needs its whole sequence, I + t - 1 tokens,
        cached."""
        return {(i, t): inp + t - 1 for i, (inp, out) in enumerate(self.requests)
                for t in range(1, out + 1)}


@dataclass
class _State:
    """Each request's state after batch j = 0 .. J (j = 0: the initial state, constants).
    The generated count is order-encoded, z[i][t][j] = [gen[i,j] >= t + 1], so that "token t
    in batch j" is the linear z[i][t][j] - z[i][t][j-1], which the cuts use."""

    z: list[list[list]]
    m: list[list]  # m[i][j]: tokens in its cache
    sqm: list[list]  # sqm[i][j] = m[i][j]^2 (0 once finished)

    def gen(self, i: int, j: int):  # noqa: ANN201 - a linear expression
        return sum(zt[j] for zt in self.z[i])


@dataclass
class _Cell:
    """Request i's variables in batch j."""

    c: cp_model.IntVar  # tokens processed
    e: cp_model.IntVar  # evicted before the batch
    act: cp_model.IntVar  # runs in the batch (c >= 1)
    dec: cp_model.IntVar  # runs as a decode
    pre: cp_model.IntVar  # runs as a prefill (refills included)
    u: cp_model.IntVar  # cache held while the batch runs
    squ: cp_model.IntVar  # u^2
    w: cp_model.IntVar  # cache the eviction drops: e * m[i,j-1]
    r: cp_model.IntVar  # cache released after its last token
    gen: cp_model.IntVar  # generates a token
    last: cp_model.IntVar  # one token is left to compute
    dk: cp_model.IntVar  # decode K/V read: m[i,j-1] if a decode
    pm: cp_model.IntVar  # prefill prefix read: m[i,j-1] if a prefill
    pa: cp_model.IntVar  # prefill attention, sum(c^2 + 2cm) = u^2 - m^2, if a prefill
    hold: cp_model.IntVar  # [u >= I]


@dataclass
class _Model:
    md: cp_model.CpModel
    cells: list[list[_Cell]]  # [i][j - 1]: request i in batch j = 1 .. J
    scale: float  # objective units per second


def _horizon(p: _Problem, latency: float) -> int | None:
    """The most batches a schedule no slower than `latency` can have (None: no cost per
    batch to tell). Every batch costs at least `base` (the cheapest phase with no tokens);
    on top, every schedule computes each request's I + O - 1 tokens, each prompt's prefill
    attention I^2, and its first tokens in at least n / (prompts that fit in M) prefill
    batches."""
    cost_model, requests = p.cost_model, p.requests
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
    prefill_batches = math.ceil(len(requests) / _fits(sorted(i for i, _ in requests), p.M))
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


def _build(p: _Problem, J: int) -> _Model:
    """The constraint model of p over J batches, minimizing the sum of the batch times."""
    md = cp_model.CpModel()
    scale = _scale(p.cost_model)
    top, size = p.top, p.size
    st = _state(md, p, J)
    cells: list[list[_Cell]] = [[] for _ in p.requests]
    nonempty, objective = [], []
    for j in range(1, J + 1):
        for i, row in enumerate(cells):
            cell = _new_cell(md, p.C, top[i], i, j)
            _evict_and_finish(md, p, st, cell, i, j)
            _tokens_and_phase(md, p, st, cell, i, j)
            _cost_terms(md, st, cell, i, j)
            _request_cuts(md, p, st, cell, row[-1] if row else None, i, j)
            row.append(cell)
        batch = [row[-1] for row in cells]
        ne = _batch_limits(md, p, st, size, batch, j)
        nonempty.append(ne)
        objective.append(_batch_time(md, p, st, batch, ne, j, scale))
    _request_totals(md, p, cells)
    _symmetry(md, p, st, nonempty, J)
    md.minimize(sum(objective))
    return _Model(md, cells, scale)


def _state(md: cp_model.CpModel, p: _Problem, J: int) -> _State:
    """The state variables, with termination (all O tokens generated by batch J) and
    sequences that never shrink."""
    top = p.top
    zero = md.new_constant(0)
    z = [[[zero] + [md.new_bool_var(f"z{i},{t},{j}") for j in range(1, J + 1)]
          for t in range(1, out + 1)] for i, (_, out) in enumerate(p.requests)]
    m = [[zero] + [md.new_int_var(0, top[i], f"m{i},{j}") for j in range(1, J + 1)]
         for i in range(len(p.requests))]
    sqm = [[zero] + [md.new_int_var(0, top[i] ** 2, f"sqm{i},{j}") for j in range(1, J + 1)]
           for i in range(len(p.requests))]
    for zi in z:
        for t, zt in enumerate(zi):
            md.add(zt[J] == 1)  # termination: all O tokens generated
            for j in range(1, J + 1):
                md.add_implication(zt[j - 1], zt[j])  # S never shrinks
                if t:
                    md.add_implication(zt[j], zi[t - 1][j])
    return _State(z, m, sqm)


def _new_cell(md: cp_model.CpModel, C: int, top: int, i: int, j: int) -> _Cell:
    def bool_var(name: str) -> cp_model.IntVar:
        return md.new_bool_var(f"{name}{i},{j}")

    def int_var(name: str, hi: int) -> cp_model.IntVar:
        return md.new_int_var(0, hi, f"{name}{i},{j}")

    return _Cell(c=int_var("c", min(C, top)), e=bool_var("e"), act=bool_var("act"),
                 dec=bool_var("dec"), pre=bool_var("pre"), u=int_var("u", top),
                 squ=int_var("squ", top ** 2), w=int_var("w", top), r=int_var("r", top),
                 gen=bool_var("g"), last=bool_var("last"), dk=int_var("dk", top),
                 pm=int_var("pm", top), pa=int_var("pa", top ** 2), hold=bool_var("hold"))


def _evict_and_finish(md: cp_model.CpModel, p: _Problem, st: _State, x: _Cell, i: int,
                      j: int) -> None:
    """Eviction drops only cache that is there, and an evicted request computes nothing;
    w = e * m[i,j-1] keeps u = m - w + c linear. A finished request runs no more, and
    finishing frees its cache (not an eviction): r is what its last token releases."""
    m0, done0, done = st.m[i][j - 1], st.z[i][-1][j - 1], st.z[i][-1][j]
    if p.forbid_evictions:
        md.add(x.e == 0)
    md.add(m0 >= 1).only_enforce_if(x.e)
    md.add(x.c == 0).only_enforce_if(x.e)
    md.add(x.w == m0).only_enforce_if(x.e)
    md.add(x.w == 0).only_enforce_if(~x.e)
    md.add(x.u == m0 - x.w + x.c)
    md.add(x.c == 0).only_enforce_if(done0)
    md.add(x.r == x.u).only_enforce_if(done, ~done0)
    md.add(x.r == 0).only_enforce_if(~done)
    md.add(x.r == 0).only_enforce_if(done0)
    md.add(st.m[i][j] == x.u - x.r)
    md.add_multiplication_equality(x.squ, [x.u, x.u])
    md.add(st.sqm[i][j] == 0).only_enforce_if(done)
    md.add(st.sqm[i][j] == x.squ).only_enforce_if(~done)


def _tokens_and_phase(md: cp_model.CpModel, p: _Problem, st: _State, x: _Cell, i: int,
                      j: int) -> None:
    """Tokens to process, and a token generated exactly when all are processed. Phase: a
    decode computes the one token it generated last (the engine's is_decode); everything
    else that runs, refills included, is a prefill."""
    left = p.requests[i][0] + st.gen(i, j - 1) - st.m[i][j - 1]  # S - m: still to compute
    md.add(st.gen(i, j) - st.gen(i, j - 1) == x.gen)
    md.add(x.c <= left)
    md.add(x.c == left).only_enforce_if(x.gen)
    md.add(x.c <= left - 1).only_enforce_if(~x.gen)
    md.add(x.c >= 1).only_enforce_if(x.act)
    md.add(x.c == 0).only_enforce_if(~x.act)
    has_out = st.z[i][0][j - 1]
    md.add(left == 1).only_enforce_if(x.last)
    md.add(left != 1).only_enforce_if(~x.last)
    md.add_bool_and([x.act, has_out, x.last]).only_enforce_if(x.dec)
    md.add_bool_or([~x.act, ~has_out, ~x.last, x.dec])
    md.add(x.act == x.dec + x.pre)


def _cost_terms(md: cp_model.CpModel, st: _State, x: _Cell, i: int, j: int) -> None:
    """Decode K/V read, prefill prefix read, and sum(c^2 + 2cm) = u^2 - m^2."""
    m0 = st.m[i][j - 1]
    md.add(x.dk == m0).only_enforce_if(x.dec)
    md.add(x.dk == 0).only_enforce_if(~x.dec)
    md.add(x.pm == m0).only_enforce_if(x.pre)
    md.add(x.pm == 0).only_enforce_if(~x.pre)
    md.add(x.pa == x.squ - st.sqm[i][j - 1]).only_enforce_if(x.pre)
    md.add(x.pa == 0).only_enforce_if(~x.pre)


def _request_cuts(md: cp_model.CpModel, p: _Problem, st: _State, x: _Cell,
                  prev: _Cell | None, i: int, j: int) -> None:
    """Redundant, for the solver's bound: generating token t needs u = I + t - 1; a first
    token comes from a prefill; a decode generates. hold = [u >= I]: it holds at least its
    prompt's worth in this batch, as it does whenever it generates; it keeps holding until
    evicted or finished; an eviction while holding drops at least I. With the cliques of
    _token_cuts this makes the relaxation pay a whole eviction for letting another decode."""
    inp, out = p.requests[i]
    z = st.z[i]
    tok = [z[t][j] - z[t][j - 1] for t in range(out)]
    md.add(x.u >= sum((inp + t) * g for t, g in enumerate(tok)))
    md.add(x.gen <= x.act)
    md.add(x.dec <= x.gen)
    md.add(tok[0] <= x.pre)
    md.add(x.u >= inp).only_enforce_if(x.hold)
    md.add(x.u <= inp - 1).only_enforce_if(~x.hold)
    md.add(x.u >= inp * x.hold)
    md.add(x.hold >= x.gen)
    if prev is not None:
        fin = z[-1][j - 1] - z[-1][j - 2]
        md.add(x.hold >= prev.hold - fin - x.e)
        md.add(x.w >= inp * (x.e + prev.hold - fin - 1))


def _batch_limits(md: cp_model.CpModel, p: _Problem, st: _State,
                  size: dict[tuple[int, int], int], batch: list[_Cell], j: int
                  ) -> cp_model.IntVar:
    """C, M (while the batch runs) and P over the prefill tokens; returns [batch j is not
    empty]."""
    md.add(sum(x.c for x in batch) <= p.C)
    md.add(sum(x.u for x in batch) <= p.M)
    md.add(sum(x.c for x in batch) - sum(x.dec for x in batch) <= p.P)
    ne = md.new_bool_var(f"nonempty{j}")
    md.add_max_equality(ne, [x.act for x in batch])
    _token_cuts(md, p.requests, size, p.M, st.z, j, ne, [x.hold for x in batch])
    return ne


def _batch_time(md: cp_model.CpModel, p: _Problem, st: _State, batch: list[_Cell],
                ne: cp_model.IntVar, j: int, scale: float):  # noqa: ANN202 - linear
    """Batch j's time in objective units: the cost model's features as integer expressions,
    InferMax's 10% extra on the phases with several requests, max(floor, linear) when the
    model has a floor. Also: a batch's first tokens are prefills of prompts that fit in M
    together, and no hybrid batches unless allowed."""
    cm = p.cost_model
    k = {f: math.floor(v * scale) for f, v in cm.coefficients.items()}
    k10 = {f: math.floor(v * _BATCHED_EXTRA * scale) for f, v in cm.coefficients.items()}
    nd, any_d, many_d = _indicators(md, [x.dec for x in batch], f"dec{j}")
    np_, any_p, many_p = _indicators(md, [x.pre for x in batch], f"pre{j}")
    firsts = [zi[0][j] - zi[0][j - 1] for zi in st.z]
    md.add(sum(firsts) <= _fits(sorted(inp for inp, _ in p.requests), p.M) * any_p)
    if not p.hybrid:
        md.add(any_d + any_p <= 1)
    dk_sum = _sum_and_extra(md, [x.dk for x in batch], p.M, many_d, f"dk{{}}{j}")
    pa_sum = _sum_and_extra(md, [x.pa for x in batch], sum(t * t for t in p.top), many_p,
                            f"pa{{}}{j}")
    linear = (k["const"] * ne + k["tokens"] * sum(x.c for x in batch)
              + k["decode_kv"] * dk_sum[0] + k10["decode_kv"] * dk_sum[1]
              + k["decode_on"] * any_d + k10["decode_on"] * many_d + k["n_decode"] * nd
              + k["prefill_attn"] * pa_sum[0] + k10["prefill_attn"] * pa_sum[1]
              + k["prefill_on"] * any_p + k10["prefill_on"] * many_p
              + k["n_prefill"] * np_ + k["prefill_m"] * sum(x.pm for x in batch))
    if cm.floor_s <= 0:
        return linear
    t = md.new_int_var(0, 2**62, f"t{j}")  # max(floor, linear) for a non-empty batch
    md.add(t >= linear)
    md.add(t >= math.floor(cm.floor_s * scale) * ne)
    return t


def _sum_and_extra(md: cp_model.CpModel, xs: list, hi: int, many: cp_model.IntVar,
                   name: str) -> tuple[cp_model.IntVar, cp_model.IntVar]:
    """(sum of xs, the same sum if `many` else 0): a summed term and the part that gets
    InferMax's 10% extra when a phase has several requests."""
    total = md.new_int_var(0, hi, name.format("sum"))
    md.add(total == sum(xs))
    extra = md.new_int_var(0, hi, name.format("extra"))
    md.add(extra == total).only_enforce_if(many)
    md.add(extra == 0).only_enforce_if(~many)
    return total, extra


def _request_totals(md: cp_model.CpModel, p: _Problem, cells: list[list[_Cell]]) -> None:
    """Redundant, for the bound: a request computes its I + O - 1 tokens plus all it
    dropped; it releases I + O - 1 when it finishes; every eviction is followed by a
    refill, which is a prefill; its first prefill alone costs sum(c^2 + 2cm) = I^2."""
    for (inp, out), row in zip(p.requests, cells, strict=True):
        md.add(sum(x.c for x in row) == inp + out - 1 + sum(x.w for x in row))
        md.add(sum(x.r for x in row) == inp + out - 1)
        md.add(sum(x.pre for x in row) >= 1 + sum(x.e for x in row))
        md.add(sum(x.pa for x in row) >= inp * inp)


def _symmetry(md: cp_model.CpModel, p: _Problem, st: _State, nonempty: list, J: int) -> None:
    """Empty batches come last; identical requests finish in index order."""
    for a, b in itertools.pairwise(nonempty):
        md.add_implication(b, a)
    for i in range(len(p.requests) - 1):
        if p.requests[i] == p.requests[i + 1]:
            for j in range(1, J + 1):
                md.add_implication(st.z[i + 1][-1][j], st.z[i][-1][j])


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


def _fix(v: _Model, steps: Sequence[Step]) -> None:
    """Pin the decisions (c, e) to a schedule; padded with empty batches."""
    for i, row in enumerate(v.cells):
        for j, x in enumerate(row):
            step = steps[j] if j < len(steps) else Step((), {})
            v.md.add(x.c == step.tokens.get(i, 0))
            v.md.add(x.e == int(i in step.evict))


def _steps_from(v: _Model, solver: cp_model.CpSolver) -> list[Step]:
    steps = []
    for j in range(len(v.cells[0])):
        tokens = {i: solver.value(row[j].c) for i, row in enumerate(v.cells)
                  if solver.value(row[j].c)}
        evict = tuple(i for i, row in enumerate(v.cells) if solver.value(row[j].e))
        if tokens:
            steps.append(Step(evict, tokens))
    return steps


def _full_hint(p: _Problem, J: int, steps: Sequence[Step]) -> list[int] | None:
    """Every variable's value for a schedule: the same model with the decisions pinned,
    solved (propagation alone settles it). None if the model rejects the schedule."""
    v = _build(p, J)
    _fix(v, steps)
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = 30.0
    solver.parameters.num_workers = 1
    if solver.solve(v.md) not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
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


def _starting_point(p: _Problem, hint_policy: str | None, hint_steps: Sequence[Step] | None
                    ) -> tuple[str, list[Step], Replay | None]:
    """The fastest valid one of: the policy's schedule, the given one, one at a time."""
    options = []
    if hint_policy:
        options.append((hint_policy,
                        policy_steps(p.requests, hint_policy, p.cost_model, p.C, p.P, p.M)))
    if hint_steps:
        options.append(("given", list(hint_steps)))
    options.append(("serial", serial_steps(p.requests, p.C, p.P)))
    best: tuple[str, list[Step], Replay | None] = ("none", [], None)
    for name, steps in options:
        try:
            rep = replay(p.requests, steps, p.cost_model, p.C, p.P, p.M, p.hybrid)
        except InvalidSchedule:
            continue
        if p.forbid_evictions and rep.evictions:
            continue
        if best[2] is None or rep.latency < best[2].latency:
            best = (name, _by_finish(p.requests, steps, rep), rep)
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
    p = _Problem(requests, cost_model, C, P, M, forbid_evictions, hybrid)
    hint, steps, rep = _starting_point(p, hint_policy, hint_steps)
    if max_batches is None:
        J = _horizon(p, rep.latency) if rep is not None else None
        if J is None:
            raise ValueError("no starting schedule, or no cost per batch to bound the "
                             "horizon with: pass max_batches")
        J = max(J, len(steps))
    else:
        J = max_batches
    v = _build(p, J)
    values = _full_hint(p, J, steps) if rep is not None and len(steps) <= J else None
    if values is not None:
        for idx, val in enumerate(values):
            v.md.add_hint(v.md.get_int_var_from_proto_index(idx), val)
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
    status = solver.solve(v.md)
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
