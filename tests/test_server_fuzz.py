"""`llmdb serve` fuzzed against its own OpenAPI description (schemathesis): every operation
gets generated requests, valid and not; none may answer 5xx, the server must still be up
afterwards, and no request may be left running or block left held.

Kept short (a dozen examples per operation, at most 2 generated tokens a request): it runs
in the suite.
"""

from __future__ import annotations

import multiprocessing
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

schemathesis = pytest.importorskip("schemathesis", reason="schemathesis is not installed")
pytest.importorskip("uvicorn", reason="uvicorn is not installed")

from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402

from llmdb.engine.engine import LLMEngine  # noqa: E402
from llmdb.server.app import Limits, create_app  # noqa: E402
from llmdb.server.run import uvicorn_server  # noqa: E402

from .openai_stub import free_port  # noqa: E402

pytestmark = pytest.mark.slow

ROOT = str(Path(__file__).resolve().parent.parent)
KEY = "fuzz-key"
MODEL = "smollm2-135m"
# Small limits keep every generated request cheap; what they refuse is answered 4xx.
LIMITS = Limits(max_body_bytes=16 << 10, max_prompt_tokens=64, max_tokens=2,
                default_max_tokens=2, max_concurrent=8)


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLMEngine(MODEL, dtype="float32")


@pytest.fixture(scope="module")
def server_url(engine):
    port = free_port()
    server = uvicorn_server(create_app(engine, MODEL, KEY, LIMITS), "127.0.0.1", port,
                            log_level="warning")
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(30)


def fuzz_server(url: str) -> None:
    """Every operation of the server's OpenAPI description, a dozen generated requests each;
    raises at the first 5xx."""
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions",
                                              "/tokenize", "/v1/models", "/health"}
    for op in operations:
        # Hypothesis, as schemathesis' own parametrize would drive it; its pytest plugin
        # does not load fixture-made schemas under this pytest.
        @given(case=op.as_strategy())
        @settings(max_examples=12, deadline=None, phases=[Phase.explicit, Phase.generate],
                  suppress_health_check=list(HealthCheck), database=None)
        def fuzz(case):
            case.call_and_validate(headers={"Authorization": f"Bearer {KEY}"},
                                   checks=[not_a_server_error], timeout=60)

        fuzz()


def test_no_operation_answers_5xx(server_url):
    # In a fresh process: the C++ kernels are built with -ffast-math, and loading them
    # (GCC 12 links crtfastmath.o into shared libraries) turns on flush-to-zero in the
    # loading thread, where Hypothesis then refuses to generate floats.
    child = multiprocessing.get_context("spawn").Process(target=fuzz_server,
                                                         args=(server_url,))
    # The child imports this module by name, so it needs the repository root first on its
    # path (spawn hands it this process's), which conftest.py took off ours.
    sys.path.insert(0, ROOT)
    try:
        child.start()
    finally:
        sys.path.remove(ROOT)
    child.join(300)
    assert child.exitcode == 0, "the fuzz found a 5xx or failed (its traceback is above)"


def test_still_up_and_nothing_leaked(server_url, engine):
    """Runs after the fuzz (file order)."""
    assert httpx.get(f"{server_url}/health").json() == {"status": "ok"}
    deadline = time.monotonic() + 30
    while engine.has_unfinished or engine.pool.num_free != engine.pool.num_blocks:
        assert time.monotonic() < deadline, "requests still run or blocks are still held"
        time.sleep(0.05)
