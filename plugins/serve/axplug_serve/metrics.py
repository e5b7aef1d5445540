"""The server's Prometheus metrics (`GET /metrics`), in a registry of their own per app."""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST

__all__ = ["ServerMetrics", "CONTENT_TYPE_LATEST"]

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class ServerMetrics:
    """Counters, gauges and latency histograms of one server."""

    def __init__(self) -> None:
        disable_created_metrics()  # no `*_created` series doubling the output
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "axplug_serve_requests",
            "Requests that ended, by endpoint and finish reason (stop, length, cancelled, error)",
            ["endpoint", "finish_reason"],
            registry=r,
        )
        self.rejected = Counter(
            "axplug_serve_rejected_requests",
            "Requests refused before generation, by HTTP status (400, 404, 429, 503)",
            ["status"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "axplug_serve_prompt_tokens", "Prompt tokens of accepted requests", registry=r
        )
        self.generation_tokens = Counter(
            "axplug_serve_generation_tokens", "Tokens generated", registry=r
        )
        self.running = Gauge(
            "axplug_serve_requests_running", "Requests holding a KV-cache row", registry=r
        )
        self.waiting = Gauge(
            "axplug_serve_requests_waiting", "Requests queued for a KV-cache row", registry=r
        )
        self.pages_free = Gauge(
            "axplug_serve_kv_pages_free", "Free pages of a paged KV cache (-1: contiguous)",
            registry=r,
        )  # fmt: skip
        self.prefix_queries = Counter(
            "axplug_serve_prefix_cache_queries",
            "Prompt tokens of admitted requests (hit rate: hits / queries)",
            registry=r,
        )
        self.prefix_hits = Counter(
            "axplug_serve_prefix_cache_hits",
            "Prompt tokens read from the prefix cache instead of prefilled",
            registry=r,
        )
        self.pages_cached = Gauge(
            "axplug_serve_kv_pages_cached", "KV pages the prefix cache names", registry=r
        )
        self.evictions = Counter(
            "axplug_serve_kv_page_evictions",
            "Cached KV pages evicted (least recently used) for new ones",
            registry=r,
        )
        self.proposed = Counter(
            "axplug_serve_spec_proposed_tokens",
            "Tokens a speculative proposer guessed (--speculative)",
            registry=r,
        )
        self.accepted = Counter(
            "axplug_serve_spec_accepted_tokens",
            "Proposed tokens the model accepted (acceptance rate: accepted / proposed)",
            registry=r,
        )
        self.preemptions = Counter(
            "axplug_serve_preemptions", "Requests preempted for want of KV pages", registry=r
        )
        self.time_to_first_token = Histogram(
            "axplug_serve_time_to_first_token_seconds",
            "From request arrival to its first token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.inter_token_latency = Histogram(
            "axplug_serve_inter_token_latency_seconds",
            "Between consecutive tokens of a request",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.request_latency = Histogram(
            "axplug_serve_request_latency_seconds",
            "From request arrival to its last token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self._seen: dict[str, int] = {}

    def observe_engine(self, engine) -> None:
        """Engine gauges, after each step (called from the engine's thread)."""
        self.running.set(engine.num_active)
        self.waiting.set(engine.num_waiting)
        allocator = engine.allocator
        self.pages_free.set(allocator.num_free if allocator is not None else -1)
        self.pages_cached.set(allocator.num_cached if allocator is not None else 0)
        self._advance(self.preemptions, "preemptions", engine.preemptions)
        self._advance(self.prefix_queries, "queries", engine.prompt_tokens)
        self._advance(self.prefix_hits, "hits", engine.prefix_hit_tokens)
        self._advance(self.evictions, "evictions", allocator.evictions if allocator else 0)
        self._advance(self.proposed, "proposed", engine.proposed_tokens)
        self._advance(self.accepted, "accepted", engine.accepted_tokens)

    def _advance(self, counter: Counter, name: str, total: int) -> None:
        """`counter` brought up to the engine's running `total`."""
        if total > self._seen.get(name, 0):
            counter.inc(total - self._seen.get(name, 0))
            self._seen[name] = total

    def exposition(self) -> bytes:
        """Every metric in Prometheus' text format."""
        return generate_latest(self.registry)
