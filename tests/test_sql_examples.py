"""Every sql_examples/*.sql file runs through `llmdb sql` on the first rows of its tables."""

from __future__ import annotations

from pathlib import Path

import duckdb
import pytest

from llmdb.cli import main

EXAMPLES = sorted((Path(__file__).parent.parent / "sql_examples").glob("*.sql"))
SAMPLE_ROWS = 6


def test_there_are_at_least_five_examples():
    assert len(EXAMPLES) >= 5


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_example_runs(path, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # COPY ... TO writes relative to the working directory
    monkeypatch.setenv("LLMDB_CACHE_DIR", str(tmp_path / "cache"))
    rc = main(["sql", "-f", str(path), "--sample-rows", str(SAMPLE_ROWS), "--no-progress"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "│" in out  # a result table was printed
    assert "-- llm:" in err and " 0 errors" in err  # the model answered rows, none failed


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
