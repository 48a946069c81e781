"""llmdb: run language models over database rows from SQL and DataFrames.

    con = llmdb.connect()
    con.sql("SELECT llm_complete('Name a color') AS c").fetchall()
    llmdb.complete(df, "Summarize: {review}", output="summary")
"""

from .batch import LLMError
from .connect import Connection, connect, register
from .dataframe import classify, complete, default_session, filter
from .session import QueryCancelled


def stats() -> dict:
    """Counters of the DataFrame calls made without session options."""
    return default_session().stats()


__all__ = [
    "Connection",
    "LLMError",
    "QueryCancelled",
    "classify",
    "complete",
    "connect",
    "filter",
    "register",
    "stats",
]
