"""A wrong argument type to an llm_* function fails with llmdb's message naming the function
and the parameter, as the duckdb.InvalidInputException it was (not behind DuckDB's
"Python exception occurred while executing the UDF" prefix), before any model call."""

from __future__ import annotations

import duckdb
import pytest

import llmdb
from llmdb.cli import main

WRONG = [
    ("SELECT llm_complete(42)", "llm_complete: prompt must be text, got INTEGER"),
    ("SELECT llm_complete('a', max_tokens := 'x')",
     "llm_complete: max_tokens must be an integer, got VARCHAR"),
    ("SELECT llm_filter(p) FROM (VALUES (1.5), (2.5)) v(p)",
     "llm_filter: prompt must be text, got DECIMAL(2,1)"),
]


@pytest.mark.parametrize("planner", [True, False])
@pytest.mark.parametrize("sql, message", WRONG)
def test_a_wrong_argument_type_names_the_function_and_parameter(sql, message, planner):
    with llmdb.connect(model="hash-standin", cache=False, planner=planner) as con:
        with pytest.raises(duckdb.InvalidInputException) as info:
            con.execute(sql).fetchall()
        assert str(info.value) == message
        assert con.stats()["total"]["calls"] == 0


def test_llmdb_sql_prints_the_message_plainly(capsys):
    sql, message = WRONG[0]
    assert main(["sql", "--model", "hash-standin", "--no-progress", sql]) == 2
    assert capsys.readouterr().err.strip() == f"llmdb: error: {message}"
