"""Apt-Serve's per-iteration selection: a greedy 2-approximation of its hybrid-cache knapsack.

The problem (Apt-Serve Sec. 5, Definition 1, with h in place of the paper's m/2): each candidate
request i has a pending time p_i >= 0, a KV-cache size m_i > 0 and a hidden-cache size h_i > 0.
It takes at most one of
    KV      value p_i                  weight m_i
    hidden  value g_i = p_i - N rho m_i  weight h_i   (only when h_i < m_i)
where N = |W| + |R| and rho is the re-projection cost per unit of memory; the chosen weights
must fit the memory budget, and the total value is maximized. The caller has already applied
the SLO-aware fallback to p (it only changes the numbers, not the problem).

The algorithm (the appendix's Algorithm 1, with the repair recorded in DESIGN.md):

1. Drop every option that cannot fit the budget on its own. No feasible solution uses one, and
   keeping one is what breaks the printed algorithm: its fallback compares against the first
   step that did not fit, which may not fit even alone.
2. Turn each request's remaining options into "steps", increments of memory sorted by value per
   unit of memory (theta):
   - KV and hidden both left: the hidden option is offered only if theta_h = g/h >= p/m, i.e.
     the point (h, g) lies on or above the line from the origin to (m, p). Then the request
     gives a hidden step (theta_h, weight h) and an upgrade step hidden -> KV
     (theta_up = N rho m / (m - h), weight m - h), and theta_up <= p/m <= theta_h holds, so
     the steps are concave and the greedy's order matches the LP relaxation's. Otherwise the
     hidden point is LP-dominated (mixing "nothing" and KV beats it) and the request gives a
     single KV step (p/m, weight m).
   - Only KV (h >= m: no hidden option, as for SmolLM2): a single KV step (p/m, weight m).
   - Only hidden left (m exceeds the budget, h fits): a single hidden step (g/h, weight h) if
     g >= 0. The hull test is skipped here on purpose: KV is not an option any more, and
     without this step a request whose KV cache is larger than the budget could never be
     served in hidden form, which would break the guarantee (OPT = g, greedy = 0).
   Negative hidden values: if g < 0 the hidden option is never offered. With both options
   left, theta_h = g/h < 0 <= p/m fails the hull test (the paper's refined theta does the same:
   2p/m - 2N rho < p/m); with KV dropped, g < 0 is worse than not scheduling at all. So every
   step has theta >= 0 and the greedy never takes a value-losing option.
3. One pass in decreasing theta: take a step if it fits the memory left, else skip it and keep
   going (the printed algorithm stops at the first misfit; continuing never lowers the value
   and packs the batch fuller). An upgrade is taken only if that request's hidden step was.
   Zero-gain steps (p = 0, or an upgrade when N rho = 0) are taken when they fit, so requests
   whose pending time is exactly zero still make progress when memory allows.
4. Compare with the best single option that fits alone (for each request, KV if it fits, else
   its offered hidden option) and return whichever has the larger value; the greedy on ties.

Why this is a 2-approximation: let the break step be the first step skipped in the pass, and
V_pre the value taken before it. The fractional greedy (the same order, the break step taken
in part) solves the LP relaxation of the instance after step 1, and its value is below
V_pre + dv_break; off-hull hidden options do not raise the LP optimum, and the dropped options
are in no feasible solution, so OPT <= LP < V_pre + dv_break. The break step's gain is at most
one single option's value: p or g for a first step, p - g <= p for an upgrade (whose KV option
fits alone, or it would have been dropped). So max(greedy, best single) >= OPT / 2.

Ties: steps are ordered by theta (larger first); on equal theta, first steps (KV or hidden) go
before upgrades -- admitting another request beats upgrading one at the same gain per unit of
memory, and it puts a request's hidden step before its own upgrade -- and then by key (smaller
first). theta_up is also clamped to theta_h, so that float rounding cannot put an upgrade ahead
of its hidden step when the two are mathematically equal (the hidden point on the line). The
best single option is the largest value, then the smallest key, and the greedy result wins a
tie with it. With unique keys the result does not depend on the order of `cands`.

rejected_for_memory is True iff the greedy could not take all of its steps: some request's KV
option exceeds the budget alone (dropped in step 1), or the pass skipped a step, of any gain,
zero included, because it did not fit the memory left. (An upgrade not tried because its own
hidden step was skipped is covered by that skip; hidden options that are never offered -- h >= m,
off the hull, negative -- never count.) Taking every step leaves every request in KV, so this is
the same as sum_i m_i > budget (exactly, for the integer block or token counts the scheduler
passes). When it is False the result is every request in KV, of value sum_i p_i, which bounds
every solution (g_i <= p_i): the greedy is optimal.

Memory is compared exactly (used + w <= budget), and the totals are recomputed from the chosen
options (p and m for KV, g and h for hidden), not summed from the increments.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate, compress, repeat
from math import isnan
from operator import attrgetter, eq, gt, lt, truediv

KV = "kv"
HIDDEN = "hidden"

# Per-request states during the pass.
_NONE = 0
_IN_HIDDEN = 1
_IN_KV = 2


@dataclass(frozen=True, slots=True)
class Candidate:
    key: int  # the caller's id, unique per call; also the tie-breaker
    pending: float  # p, >= 0
    kv_mem: float  # m, > 0
    hidden_mem: float  # h, > 0; h >= m means no hidden option


_by_key = attrgetter("key")


@dataclass
class Selection:
    choice: dict[int, str]  # key -> "kv" | "hidden"; a key that is absent is not selected
    value: float  # total value of the chosen options
    memory: float  # total memory of the chosen options
    rejected_for_memory: bool  # see the module docstring for the exact meaning


def select(cands: Sequence[Candidate], budget: float, n_queue: int, rho: float) -> Selection:
    """The repaired greedy for one iteration over candidate objects; see select_columns."""
    cs = sorted(cands, key=_by_key)
    return select_columns([c.key for c in cs], [c.pending for c in cs],
                          [c.kv_mem for c in cs], [c.hidden_mem for c in cs], budget, n_queue,
                          rho)


def select_columns(keys: Sequence[int], P: Sequence[float], M: Sequence[float],
                   H: Sequence[float], budget: float, n_queue: int, rho: float) -> Selection:
    """The repaired greedy for one iteration: one sort plus linear passes, O(n log n).

    Candidate i is (keys[i], P[i], M[i], H[i]), with the keys strictly increasing (the
    tie-breaker order). Written over columns (plain lists, map and compress, which loop in C)
    with no object per candidate or step, because the scheduler calls it every iteration
    with up to ~1,600 candidates: loops in Python run only over the steps of the pass and
    over the requests that need more than a KV step (a hidden option, or a KV option that
    does not fit alone).
    """
    if n_queue < 0 or not rho >= 0:
        raise ValueError(f"need n_queue >= 0 and rho >= 0, got {n_queue}, {rho}")
    nr = n_queue * rho
    n = len(keys)
    if not (isinstance(keys, range) and keys.step > 0) and not all(map(lt, keys, keys[1:])):
        raise ValueError("candidate keys must be unique (and, here, increasing)")
    if n and not (min(P) >= 0 and min(M) > 0 and min(H) > 0):
        raise ValueError("need pending >= 0, kv_mem > 0 and hidden_mem > 0")
    theta = list(map(truediv, P, M))
    # min() can step over a NaN, a sum cannot: a NaN (or inf/inf) in p or m shows here; a NaN
    # hidden_mem compares false everywhere and just means no hidden option.
    if isnan(sum(theta)):
        raise ValueError("pending and kv_mem must not be NaN")
    memory = sum(M, 0.0)
    if memory <= budget:
        # Every KV option fits at once: the pass below would take every step and end with
        # every request in KV, the optimum (g <= p bounds every hidden choice). No sort.
        return Selection(dict.fromkeys(keys, KV), sum(P, 0.0), memory, False)
    # Steps 0..n-1: request i's first step (KV, or hidden); steps n..: upgrades hidden -> KV,
    # of request up_req[j - n]. A first step with theta -1 does not exist (dropped); every
    # real step has theta >= 0.
    weight = list(M)
    first = [_IN_KV] * n  # the state a request's first step puts it in
    up_req: list[int] = []
    up_theta: list[float] = []
    up_weight: list[float] = []
    any_dropped = n > 0 and max(M) > budget
    # A plain loop over the requests that have a hidden option measured faster than
    # whole-column map() arithmetic here.
    for i in compress(range(n), map(lt, H, M)):
        m = M[i]
        if m > budget:
            continue  # handled below, with the dropped KV options
        p = P[i]
        h = H[i]
        th = (p - nr * m) / h
        if th >= theta[i]:  # theta_h >= p/m: the hidden point is on the hull, offer it
            theta[i] = th
            weight[i] = h
            first[i] = _IN_HIDDEN
            up = nr * m / (m - h)
            up_req.append(i)
            # Clamped so rounding cannot put an upgrade before its own hidden step when the
            # two are mathematically equal.
            up_theta.append(up if up < th else th)
            up_weight.append(m - h)
    rejected = False
    n_dropped = 0
    if any_dropped:
        rejected = True  # KV options that cannot fit alone are dropped (step 1)
        for i in compress(range(n), map(gt, M, repeat(budget))):
            theta[i] = -1.0
            n_dropped += 1
            h = H[i]
            if h < M[i] and h <= budget:
                g = P[i] - nr * M[i]
                if g >= 0:  # a negative hidden value is worse than not scheduling
                    theta[i] = g / h
                    weight[i] = h
                    first[i] = _IN_HIDDEN
                    n_dropped -= 1

    # Stable, so equal thetas keep the order built above: first steps before upgrades, each
    # group by key. Preferring to admit a request over upgrading one at the same gain per
    # unit of memory also keeps a request's hidden step ahead of its upgrade.
    theta += up_theta
    weight += up_weight
    order = list(range(len(theta)))
    order.sort(key=theta.__getitem__, reverse=True)
    if n_dropped:
        del order[-n_dropped:]  # theta -1: exactly the tail
    state = [_NONE] * n
    # The longest run of steps that fit one after the other is taken whole: found with one
    # running sum in C (the same additions the loop would make), so the Python loop below
    # only runs from the first step that does not fit.
    cum = list(accumulate([weight[j] for j in order], initial=0.0))
    k = bisect_right(cum, budget) - 1
    for j in order[:k]:
        if j < n:
            state[j] = first[j]
        else:
            state[up_req[j - n]] = _IN_KV
    used = cum[k]
    for j in order[k:]:
        if j < n:
            i = j
            nxt = first[j]
        else:
            i = up_req[j - n]
            if state[i] != _IN_HIDDEN:
                continue  # its hidden step was skipped for memory (already flagged)
            nxt = _IN_KV
        w = weight[j]
        if used + w <= budget:
            used += w
            state[i] = nxt
        else:
            rejected = True

    # Totals from the chosen options themselves, not from summed increments, so a request
    # upgraded to KV counts exactly p and m.
    is_kv = list(map(eq, state, repeat(_IN_KV)))
    value = sum(compress(P, state), 0.0)  # p of every chosen request; hidden ones corrected below
    memory = sum(compress(M, is_kv), 0.0)
    choice = dict.fromkeys(compress(keys, is_kv), KV)
    if _IN_HIDDEN in state:
        is_hidden = list(map(eq, state, repeat(_IN_HIDDEN)))
        value -= nr * sum(compress(M, is_hidden))
        memory += sum(compress(H, is_hidden))
        choice.update(dict.fromkeys(compress(keys, is_hidden), HIDDEN))

    # Without a rejection the greedy is optimal, so the single option can only win otherwise.
    if rejected and n:
        # Each request's best option that fits alone: p if its KV fits, else its offered
        # hidden option. index() finds the first of equal values: the smallest key.
        if not any_dropped:
            single = P
        else:
            single = [p if m <= budget else -1.0 for p, m in zip(P, M, strict=True)]
            for i in compress(range(n), map(gt, M, repeat(budget))):
                if first[i] == _IN_HIDDEN:
                    single[i] = P[i] - nr * M[i]
        best = max(single)
        if best > value:
            i = single.index(best)
            if M[i] <= budget:
                return Selection({keys[i]: KV}, float(P[i]), float(M[i]), rejected)
            return Selection({keys[i]: HIDDEN}, float(best), float(H[i]), rejected)
    return Selection(choice, value, memory, rejected)


def brute_force(cands: Sequence[Candidate], budget: float, n_queue: int, rho: float) -> Selection:
    """The exact optimum by enumeration (3^n; for tests on small n).

    Every option of the problem is enumerated, hidden ones whenever h < m, off the hull or
    negative included. Ties in value go to the first assignment found, enumerating requests in
    input order and for each "nothing", then KV, then hidden. rejected_for_memory is select's
    test, sum_i m_i > budget: not every request can have its KV cache.
    """
    nr = n_queue * rho
    opts: list[list[tuple[str | None, float, float]]] = []
    for c in cands:
        o: list[tuple[str | None, float, float]] = [(None, 0.0, 0.0), (KV, c.pending, c.kv_mem)]
        if c.hidden_mem < c.kv_mem:
            o.append((HIDDEN, c.pending - nr * c.kv_mem, c.hidden_mem))
        opts.append(o)
    n = len(cands)
    best: list = [-1.0, 0.0, []]  # value, memory, chosen option names
    picked: list[str | None] = [None] * n

    def go(j: int, val: float, mem: float) -> None:
        if j == n:
            if val > best[0]:
                best[0], best[1], best[2] = val, mem, list(picked)
            return
        for name, v, w in opts[j]:
            if name is None or mem + w <= budget:
                picked[j] = name
                go(j + 1, val + v, mem + w)
        picked[j] = None

    go(0, 0.0, 0.0)
    choice = {c.key: name for c, name in zip(cands, best[2], strict=True) if name is not None}
    return Selection(choice, best[0], best[1], sum(c.kv_mem for c in cands) > budget)
