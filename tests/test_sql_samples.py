"""samples.<table>: attached when a query names it, however the name is written, with the
rows of its package (the first --sample-rows of them)."""

from __future__ import annotations

import duckdb
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


@pytest.mark.parametrize("method", ["execute", "sql"])
@pytest.mark.parametrize("query", ["SELECT * FROM samples.nosuch",
                                   "SELECT llm_complete(title) FROM samples.Nosuch",
                                   "SELECT * FROM samples.movies m, samples.nosuch n"])
def test_an_unknown_sample_table_is_named_with_the_sample_tables(query, method):
    """It said that the schema samples did not exist (or suggested one loaded table)."""
    with llmdb.connect(model="hash-standin", cache=False, sample_rows=3) as con:
        with pytest.raises(duckdb.CatalogException) as info:
            getattr(con, method)(query)
        name = "Nosuch" if "Nosuch" in query else "nosuch"
        assert str(info.value) == (
            f"Catalog Error: samples.{name} is not a sample table; the sample tables are "
            + ", ".join(f"samples.{t}" for t in sorted(SAMPLES)))


def test_a_schema_of_the_users_named_samples_keeps_duckdbs_error():
    with llmdb.connect(model="hash-standin", cache=False) as con:
        con.execute("CREATE SCHEMA samples")
        con.execute("CREATE TABLE samples.mine AS SELECT 1 AS a")
        with pytest.raises(duckdb.CatalogException, match="nosuch does not exist"):
            con.execute("SELECT * FROM samples.nosuch")
        assert con.execute("SELECT a FROM samples.mine").fetchall() == [(1,)]
