"""`llmdb sql` prints each statement's rows, or its status when its result is one."""

from __future__ import annotations

import pytest

from llmdb import cli
from llmdb.cli import main

pytestmark = pytest.mark.usefixtures("eng", "own_cache_dir")

SCRIPT = """
CREATE TABLE t AS SELECT 'Name a colour.' AS p;
INSERT INTO t VALUES ('Name a fruit.') RETURNING p;
PIVOT t ON p USING count(*);
UPDATE t SET p = p WHERE p LIKE '%fruit%';
SET threads = 2;
SELECT 42 AS Count;
SELECT p, llm_complete(p, max_tokens := 2) AS a FROM t ORDER BY p;
"""


def test_rows_are_printed_whatever_the_statement_type(tmp_path, monkeypatch, capsys):
    printed = []
    monkeypatch.setattr(cli, "_print_table", lambda table, max_rows: printed.append(
        table.to_pydict()))
    script = tmp_path / "script.sql"
    script.write_text(SCRIPT)
    assert main(["sql", "-f", str(script), "--no-progress"]) == 0
    err = capsys.readouterr().err
    returning, pivot, count, answers = printed
    assert returning == {"p": ["Name a fruit."]}  # INSERT ... RETURNING: its rows
    assert pivot == {"Name a colour.": [1], "Name a fruit.": [1]}  # PIVOT: a MULTI statement
    assert count == {"Count": [42]}  # a SELECT's rows, whatever its column is called
    assert answers["p"] == ["Name a colour.", "Name a fruit."] and all(answers["a"])
    assert "-- CREATE: 1 rows" in err and "-- UPDATE: 1 rows" in err and "-- SET\n" in err
    assert "-- llm: 2 rows" in err


def test_explain_llm_prints_the_report(capsys):
    query = "SELECT llm_complete(p) FROM (VALUES ('a'), ('b')) v(p)"
    assert main(["sql", f"EXPLAIN LLM {query};"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("EXPLAIN LLM") and "site 0: LLM_COMPLETE(p)" in out


def test_explain_llm_takes_one_statement(capsys):
    """Not the report of the first and silence about the rest."""
    assert main(["sql", "EXPLAIN LLM SELECT llm_complete('a'); CREATE TABLE made AS SELECT 1"]
                ) != 0
    assert "EXPLAIN LLM explains one statement" in capsys.readouterr().err


def test_explain_takes_one_statement_duckdb_can_parse(capsys):
    """`llmdb explain` as EXPLAIN LLM in `llmdb sql`: a query that does not parse, or
    several, is an error, not a report (exit 0) that the query "runs as written"."""
    assert main(["explain", "SELEC llm_complete('a')"]) == 2
    assert "syntax error" in capsys.readouterr().err
    assert main(["explain", "SELECT llm_complete('a'); SELECT 2"]) == 2
    assert "EXPLAIN LLM explains one statement" in capsys.readouterr().err
