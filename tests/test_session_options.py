"""A session's options and the engine's: every LLMEngine argument is an engine option, a name
that is neither fails naming both kinds, and a session without engine options never loads
torch (the hash stand-in needs none)."""

from __future__ import annotations

import inspect
import subprocess
import sys

import pytest

from llmdb.engine.engine import LLMEngine
from llmdb.session import Options


def test_every_engine_argument_is_an_engine_option():
    for name in list(inspect.signature(LLMEngine).parameters)[1:]:  # after the model
        opts = Options.from_kwargs(model="hash-standin", on_error="null", **{name: 7})
        assert (opts.engine, opts.on_error) == ({name: 7}, "null"), name


def test_an_unknown_option_names_the_engines():
    with pytest.raises(TypeError, match=r"unknown llmdb option\(s\): kv_cache_size; engine "
                                        r"options are device, .*rt_slo_ttft_s"):
        Options.from_kwargs(kv_cache_size=1 << 20)


@pytest.mark.parametrize("size", [0, -1, 1.5, "1GB", True])
def test_a_cache_size_that_keeps_nothing_is_refused(size):
    """The cache compares its size with the limit at every 256th answer it stores: 0 or
    less emptied it there, and a string failed the job there, hundreds of rows in."""
    with pytest.raises(ValueError, match=f"cache_max_bytes must be a whole number of bytes "
                                         f"above 0, got {size!r}"):
        Options.from_kwargs(model="hash-standin", cache_max_bytes=size)
    assert Options.from_kwargs(cache_max_bytes=1 << 20).cache_max_bytes == 1 << 20


def test_a_session_without_engine_options_loads_no_torch():
    code = ("import sys, llmdb\n"
            "con = llmdb.connect(model='hash-standin', cache=False, on_error='null')\n"
            "assert con.execute(\"SELECT llm_filter('a')\").fetchall()[0][0] is not None\n"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == ["False"]
