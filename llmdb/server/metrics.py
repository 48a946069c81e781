"""/metrics in Prometheus' text format, read from the engine at scrape time.

prometheus_client renders it; a custom collector reads the engine's state when scraped
rather than being pushed updates from the step loop, so serving costs nothing between scrapes.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from llmdb.engine.engine import LLMEngine


class _EngineCollector:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.last = (time.monotonic(), 0)  # for tokens/s between scrapes

    def collect(self):
        e = self.engine
        s, pool = e.scheduler, e.pool
        generated = e.tokens_generated
        now = time.monotonic()
        t0, g0 = self.last
        self.last = (now, generated)
        yield GaugeMetricFamily("llmdb_requests_running", "Requests in the running batch",
                                value=len(s.running))
        yield GaugeMetricFamily("llmdb_requests_waiting", "Requests waiting to be scheduled",
                                value=len(s.waiting))
        yield GaugeMetricFamily("llmdb_blocks_in_use", "Cache blocks held by requests",
                                value=pool.num_blocks - pool.num_free)
        yield GaugeMetricFamily("llmdb_blocks_total", "Cache blocks in the pool",
                                value=pool.num_blocks)
        yield CounterMetricFamily("llmdb_generated_tokens", "Tokens generated since start",
                                  value=generated)
        yield GaugeMetricFamily("llmdb_generation_tokens_per_second",
                                "Tokens generated per second since the previous scrape",
                                value=(generated - g0) / (now - t0) if now > t0 else 0.0)


class EngineMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, engine: LLMEngine):
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine))

    def render(self) -> bytes:
        return generate_latest(self.registry)
