"""GGR field/row reordering: longer shared prefixes, same rows answered."""

from __future__ import annotations

import random

import pyarrow as pa

import llmdb
from llmdb.reorder import ggr, render, shared_prefix_chars


def _table(n: int = 60) -> list[dict[str, str]]:
    rng = random.Random(0)
    return [{"id": f"ticket-{i:04d}",
             "product": rng.choice(["Enterprise Database Server 12", "Mobile App"]),
             "region": rng.choice(["Europe (Frankfurt data centre)", "Asia (Tokyo)", "US"])}
            for i in range(n)]


def test_ggr_puts_shared_values_first_and_beats_the_given_order():
    rows = _table()
    fields = ["id", "product", "region"]
    plan = ggr(rows, fields)
    assert sorted(i for i, _ in plan) == list(range(len(rows)))  # every row once
    assert all(sorted(order) == sorted(fields) for _, order in plan)
    assert all(order[-1] == "id" for _, order in plan)  # the unique field goes last
    fixed = [render("Route the ticket.", r, fields) for r in rows]
    chosen = [render("Route the ticket.", rows[i], order) for i, order in plan]
    assert shared_prefix_chars(chosen) > shared_prefix_chars(fixed) + 20 * len(rows)


def test_dataframe_complete_with_reordered_fields_answers_every_row(tmp_path):
    rows = _table(12)
    rows[3]["region"] = None
    table = pa.Table.from_pylist(rows)
    out = llmdb.complete(table, "Route the ticket.", output="team",
                         fields=["id", "product", "region"], reorder_fields=True,
                         model="hash-standin", cache=False, max_tokens=2)
    teams = out.column("team").to_pylist()
    assert teams[3] is None and all(t for i, t in enumerate(teams) if i != 3)
    # Each row's answer is the stand-in's answer to that row's own reordered prompt.
    plan = dict(ggr([{k: str(v) for k, v in r.items()} for i, r in enumerate(rows) if i != 3],
                    ["id", "product", "region"]))
    usable = [i for i in range(12) if i != 3]
    for k, order in plan.items():
        prompt = render("Route the ticket.", {f: str(rows[usable[k]][f]) for f in order}, order)
        single = llmdb.complete(pa.table({"p": [prompt]}), "{p}", output="team",
                                model="hash-standin", cache=False, max_tokens=2)
        assert single.column("team")[0].as_py() == teams[usable[k]]
