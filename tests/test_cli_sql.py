"""`llmdb sql` prints each statement's rows, or its status when its result is one."""

from __future__ import annotations

import csv
import io
import json
import sys

import duckdb
import pytest

import llmdb
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
    monkeypatch.setattr(cli, "_print_table", lambda table, *how: printed.append(
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


def test_a_failed_statement_still_reports_the_model_work_before_it(tmp_path, capsys):
    """The job stops at the failed statement, naming it; the rows printed before stay, and
    so does the line of model work (which was missing: the calls paid for went unreported)."""
    script = tmp_path / "job.sql"
    script.write_text("SELECT llm_complete('Name a colour.', max_tokens := 2) AS a;\n"
                      "SELECT nosuchcol FROM (SELECT 1);\nSELECT 'never' AS b;\n")
    assert main(["sql", "-f", str(script), "--no-progress", "--format", "csv"]) == 2
    out, err = capsys.readouterr()
    assert out.startswith("a\n") and "never" not in out
    assert "statement 2 of 3 (SELECT nosuchcol FROM (SELECT 1)) failed" in err
    assert "-- llm: 1 rows, 1 model calls" in err


def test_explain_llm_prints_the_report(capsys):
    query = "SELECT llm_complete(p) FROM (VALUES ('a'), ('b')) v(p)"
    assert main(["sql", f"EXPLAIN LLM {query};"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("EXPLAIN LLM") and "site 0: LLM_COMPLETE(p)" in out


def test_explain_llm_is_a_statement_of_a_job(tmp_path, capsys):
    """EXPLAIN LLM, which DuckDB cannot parse (nor split), may be any statement of a job,
    after comments too: a job file's header comment, or a table made first, made it
    DuckDB's syntax error. A `;` or EXPLAIN LLM inside a string splits nothing."""
    script = tmp_path / "job.sql"
    script.write_text("-- what will it cost?\nCREATE TABLE t AS SELECT 'é; EXPLAIN LLM b' AS p;"
                      "\n/* the report */ explain llm SELECT llm_complete(p) FROM t;\n"
                      "EXPLAIN LLM SELECT llm_complete(p || '!') FROM t -- its own\n;\n"
                      "SELECT p FROM t;")
    assert main(["sql", "-f", str(script), "--no-progress", "--format", "csv"]) == 0
    out, err = capsys.readouterr()
    first, second = out.split("EXPLAIN LLM  priority")[1:]  # the reports begin so
    assert "site 0: LLM_COMPLETE(p)" in first and "rows reaching it   est 1" in first
    assert "site 0: LLM_COMPLETE(p || '!')" in second
    assert second.endswith("p\né; EXPLAIN LLM b\n")  # the last statement's rows, after both
    assert "-- CREATE: 1 rows" in err and "-- llm:" not in err  # the reports call nothing


def test_a_job_file_is_utf8_with_or_without_a_byte_order_mark(tmp_path, capsys):
    """Windows editors save UTF-8 with a byte order mark, which hid an EXPLAIN LLM (DuckDB
    skips the mark, llmdb's EXPLAIN LLM did not); text that is not UTF-8 is an error naming
    the file. Statements after non-ASCII text are cut where they end."""
    script = tmp_path / "job.sql"
    script.write_bytes("\ufeffEXPLAIN LLM SELECT llm_complete('ü');\r\nSELECT 'é' AS b;\r\n"
                       .encode())
    assert main(["sql", "-f", str(script), "--format", "csv"]) == 0
    out = capsys.readouterr().out.replace("\r", "")
    assert out.startswith("EXPLAIN LLM  priority") and out.endswith("\nb\né\n")
    script.write_bytes("SELECT 'ü' AS a".encode("utf-16"))
    assert main(["sql", "-f", str(script)]) == 2
    assert f"cannot read {script}: not UTF-8 text" in capsys.readouterr().err


def test_explain_llm_after_a_comment_on_a_connection():
    with llmdb.connect(model="hash-standin", cache=False) as con:
        report = con.execute("-- cost?\n/* a */ EXPLAIN LLM SELECT llm_complete('a')").fetchall()
        assert report and con.stats()["total"]["calls"] == 0


def test_explain_takes_one_statement_duckdb_can_parse(capsys):
    """`llmdb explain` as EXPLAIN LLM in `llmdb sql`: a query that does not parse, or
    several, is an error, not a report (exit 0) that the query "runs as written"."""
    assert main(["explain", "SELEC llm_complete('a')"]) == 2
    assert "syntax error" in capsys.readouterr().err
    assert main(["explain", "SELECT llm_complete('a'); SELECT 2"]) == 2
    assert "EXPLAIN LLM explains one statement" in capsys.readouterr().err


# Rows of several types, more of them than --max-rows prints in the box, and wider than it.
ROWS_QUERY = ("SELECT i, CASE WHEN i % 7 = 0 THEN NULL ELSE 'text, \"quoted\" ' || i END AS s, "
              "repeat('x', 200) AS wide, [i, i + 1] AS l, i / 4 AS d FROM range(100) t(i)")


def _plain_duckdb(query: str) -> tuple[list[str], list[tuple]]:
    """The reference: the query's columns and rows on plain DuckDB, each value as its text."""
    rel = duckdb.sql(query)
    texts = duckdb.sql(f"SELECT CAST(COLUMNS(*) AS VARCHAR) FROM ({query})").fetchall()
    return rel.columns, texts


def test_rows_into_a_pipe_are_csv_every_row(capsys):
    """stdout is not a terminal (here: pytest's capture): a header, then every row in full."""
    assert main(["sql", "--model", "hash-standin", ROWS_QUERY]) == 0
    out = capsys.readouterr().out
    header, *rows = csv.reader(io.StringIO(out))
    columns, texts = _plain_duckdb(ROWS_QUERY)
    assert header == columns
    assert [tuple(None if v == "" else v for v in r) for r in rows] == texts


def test_rows_as_json_lines(capsys):
    assert main(["sql", "--model", "hash-standin", "--format", "json", ROWS_QUERY]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    columns, _ = _plain_duckdb(ROWS_QUERY)
    assert rows == [dict(zip(columns, r, strict=True)) for r in duckdb.sql(ROWS_QUERY).fetchall()]


def test_rows_on_a_terminal_are_the_box_table(capsys, monkeypatch):
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True, raising=False)
    assert main(["sql", "--model", "hash-standin", "--max-rows", "10", ROWS_QUERY]) == 0
    out = capsys.readouterr().out
    assert "│" in out and "100 rows" in out and "(10 shown)" in out
    assert main(["sql", "--model", "hash-standin", "--format", "csv", "SELECT 1 AS a"]) == 0
    assert capsys.readouterr().out == "a\n1\n"


def test_sql_help_names_the_formats(capsys):
    with pytest.raises(SystemExit):
        main(["sql", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--format {auto,box,csv,json}" in help_text
    assert "csv when stdout is a pipe or a file" in help_text
