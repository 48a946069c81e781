"""Every sql_examples/*.sql file runs through `llmdb sql` on the first rows of its tables and
keeps what its comments promise; the examples' README documents each of them."""

from __future__ import annotations

import re
from pathlib import Path

import duckdb
import pytest

from llmdb import cli
from llmdb.cli import main

EXAMPLES = sorted((Path(__file__).parent.parent / "sql_examples").glob("*.sql"))
SAMPLE_ROWS = 6
KINDS = {"painting", "print", "photograph", "sculpture", "video", "drawing", "other"}


def _answers(table: dict, column: str) -> list:
    assert table[column] and all(v is not None for v in table[column]), column
    return table[column]


# Per example, a check of the tables it prints (as {column: values}), in order.
PROMISES = {
    # Code for each task: a non-empty answer per row.
    "humaneval_complete": lambda t: all(a.strip() for a in _answers(t[0], "answer")),
    # llm_classify returns one of the labels, never anything else.
    "reviews_classify": lambda t: set(_answers(t[0], "sentiment")) <= {"positive", "negative"},
    # llm_filter_score is a probability; llm_filter passes some of the tweets, at most all.
    "tweets_filter": lambda t: all(0 <= p <= 1 for p in _answers(t[0], "p_yes"))
    and t[1]["about_the_media"][0] <= t[1]["tweets"][0],
    # Every kind is one of the labels; the join spreads each over its artworks.
    "artworks_join": lambda t: set(_answers(t[0], "kind")) <= KINDS
    and all(n >= 1 for n in t[0]["artworks"]),
    # A tagline for each movie, read back from the Parquet file.
    "movies_etl": lambda t: len(_answers(t[0], "tagline")) == SAMPLE_ROWS,
}


def test_the_readme_documents_exactly_the_examples():
    readme = (Path(__file__).parent.parent / "sql_examples" / "README.md").read_text()
    documented = set(re.findall(r"^\| `(\w+)\.sql` \|", readme, re.M))
    assert documented == {p.stem for p in EXAMPLES} == set(PROMISES)
    assert len(EXAMPLES) >= 5


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_example_runs_and_keeps_its_promise(path, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # COPY ... TO writes relative to the working directory
    monkeypatch.setenv("LLMDB_CACHE_DIR", str(tmp_path / "cache"))
    printed = []
    show = cli._print_table

    def record(table, *how):
        printed.append(table.to_pydict())
        show(table, *how)

    monkeypatch.setattr(cli, "_print_table", record)
    rc = main(["sql", "-f", str(path), "--sample-rows", str(SAMPLE_ROWS), "--no-progress",
               "--format", "box"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "│" in out  # a result table was printed
    assert "-- llm:" in err and " 0 errors" in err  # the model answered rows, none failed
    assert printed and all(next(iter(t.values())) for t in printed), "a result had no rows"
    assert PROMISES[path.stem](printed)


def test_etl_example_writes_parquet(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("LLMDB_CACHE_DIR", str(tmp_path / "cache"))
    path = next(p for p in EXAMPLES if p.stem == "movies_etl")
    assert main(["sql", "-f", str(path), "--sample-rows", str(SAMPLE_ROWS), "--no-progress"]) == 0
    rows = duckdb.sql("SELECT title, tagline FROM 'movie_taglines.parquet'").fetchall()
    assert len(rows) == SAMPLE_ROWS and all(t for _, t in rows)
    # A rerun is answered from the result cache.
    capsys.readouterr()
    assert main(["sql", "-f", str(path), "--sample-rows", str(SAMPLE_ROWS), "--no-progress"]) == 0
    assert f"0 model calls, {SAMPLE_ROWS} cache hits" in capsys.readouterr().err
