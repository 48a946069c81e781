"""llmdb: run language models over database rows from SQL and DataFrames.

    con = llmdb.connect()
    con.sql("SELECT llm_complete('Name a color') AS c").fetchall()
    llmdb.complete(df, "Summarize: {review}", output="summary")
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# Loaded on first use (PEP 562): `import llmdb` and the engine's and kernels' modules
# (llmdb.engine.*, llmdb.kernels.*) then cost nothing here; duckdb, pandas, pyarrow and
# torch load when a connection, DataFrame call or engine first needs them.
_EXPORTS = {
    "LLMError": ".batch",
    "Connection": ".connection",
    "connect": ".connection",
    "register": ".connection",
    "classify": ".dataframe",
    "complete": ".dataframe",
    "filter": ".dataframe",
    "QueryCancelled": ".session",
}

if TYPE_CHECKING:
    from .batch import LLMError
    from .connection import Connection, connect, register
    from .dataframe import classify, complete, filter
    from .session import QueryCancelled


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'llmdb' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    globals()[name] = value
    return value


def stats() -> dict:
    """Counters of the DataFrame calls made without session=."""
    from .dataframe import default_session

    return default_session().stats()


def errors() -> list[dict]:
    """The rows that failed under on_error='null' in the DataFrame calls made without
    session= (with session options or not), oldest first: query_id (the call), function,
    prompt (its start) and error. SQL's llm_errors(); a Session passed as session= keeps
    its own in .errors, and llmdb.ray's workers theirs (error_column= puts each row's error
    beside the row)."""
    import dataclasses

    from .dataframe import default_session

    return [dataclasses.asdict(e) for e in default_session().errors]


__all__ = [
    "Connection",
    "LLMError",
    "QueryCancelled",
    "classify",
    "complete",
    "connect",
    "errors",
    "filter",
    "register",
    "stats",
]
