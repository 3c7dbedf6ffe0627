"""Prometheus metrics of one proxy app (`GET /metrics`).

Each app owns its registry (several apps can live in one process, e.g. in tests). Requests
are counted and timed by a pure ASGI middleware (no BaseHTTPMiddleware: it would buffer
streams); for a streamed reply the latency runs to the end of the stream.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from starlette.types import ASGIApp, Message, Receive, Scope, Send

# Label values are limited to known routes, so a scanner cannot blow up cardinality.
ROUTES = frozenset({"/v1/chat/completions", "/v1/responses", "/v1/models", "/v1/feedback", "/healthz",
                    "/readyz", "/metrics"})


class ProxyMetrics:
    def __init__(self, backlog: Callable[[], float], journal: Callable[[], float],
                 writer_up: Callable[[], float] = lambda: 1.0) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("clawrl_requests", "HTTP requests by route and status",
                                ["route", "status"], registry=self.registry)
        self.latency = Histogram(
            "clawrl_request_latency_seconds", "Request latency (to the end of a stream)",
            ["route"], registry=self.registry,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5,
                     10, 30, 60, 120, 300))
        self.tokens = Counter("clawrl_tokens", "Tokens served", ["kind"],
                              registry=self.registry)
        self.turns = Counter("clawrl_turns", "Turns handed to the log by status", ["status"],
                             registry=self.registry)
        Gauge("clawrl_turn_log_backlog", "Turns served but not yet stored or journaled",
              registry=self.registry).set_function(backlog)
        Gauge("clawrl_journal_turns", "Turns waiting in the local journal for Postgres",
              registry=self.registry).set_function(journal)
        Gauge("clawrl_turn_writer_up", "1 while the turn writer task runs",
              registry=self.registry).set_function(writer_up)
        self.dead_letters = Counter("clawrl_dead_letters", "Records the database refused, kept "
                                    "in the dead_letters table", registry=self.registry)
        self.writer_restarts = Counter("clawrl_turn_writer_restarts", "Turn writer restarts "
                                       "after it ended unexpectedly", registry=self.registry)
        self.turns_spilled = Counter("clawrl_turns_spilled", "Turns moved to the journal "
                                     "because the backlog was full", registry=self.registry)

    def count_tokens(self, prompt: int, completion: int) -> None:
        if prompt:
            self.tokens.labels("prompt").inc(prompt)
        if completion:
            self.tokens.labels("completion").inc(completion)


class MetricsMiddleware:
    def __init__(self, app: ASGIApp, metrics: ProxyMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        route = path if path in ROUTES else ("/admin" if path.startswith("/admin") else "other")
        status = 500
        started = time.perf_counter()

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            self.metrics.requests.labels(route, str(status)).inc()
            self.metrics.latency.labels(route).observe(time.perf_counter() - started)
