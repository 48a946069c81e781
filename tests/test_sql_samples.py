"""samples.<table>: attached when a query names it, however the name is written, with the
rows of its package (the first --sample-rows of them)."""

from __future__ import annotations

import pytest

import llmdb
from llmdb.samples import SAMPLES


@pytest.mark.parametrize("name", ["samples.movies", 'samples."movies"', '"samples".movies',
                                  '"samples"."movies"', "SAMPLES . Movies"])
def test_a_sample_table_named_in_any_spelling_is_attached(name):
    """A quoted catalog ("samples".movies, as tools that quote every identifier write it)
    was not seen, and DuckDB said that the schema samples does not exist."""
    want = SAMPLES["movies"]().slice(0, 3).column("title").to_pylist()
    with llmdb.connect(model="hash-standin", cache=False, sample_rows=3) as con:
        assert [r[0] for r in con.execute(f"SELECT title FROM {name}").fetchall()] == want
