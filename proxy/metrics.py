"""Prometheus metrics of one proxy app (`GET /metrics`).

Each app owns its registry (several apps can live in one process, e.g. in tests). Requests
are counted and timed by a pure ASGI middleware (no BaseHTTPMiddleware: it would buffer
streams); for a streamed reply the latency runs to the end of the stream.

Each user's share of what the shared model was trained on (`TrainedShares`) is read from the
database every `TRAINED_SHARES_REFRESH_S` by the app's lifespan, never per scrape.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine
from starlette.types import ASGIApp, Message, Receive, Scope, Send

# Label values are limited to known routes, so a scanner cannot blow up cardinality.
ROUTES = frozenset({"/v1/chat/completions", "/v1/responses", "/v1/completions", "/v1/models",
                    "/v1/feedback", "/healthz",
                    "/readyz", "/metrics"})


# The shared model's newest versions the shares are taken over, and how often they are read.
TRAINED_SHARES_VERSIONS = 20
TRAINED_SHARES_REFRESH_S = 60.0

# Samples per user in the shared model's newest :versions training steps (personal steps
# have `training_steps.user_id` set). Walks the step primary key back and reads each step's
# samples by ix_samples_trained_step: a bounded read whatever the history.
_SHARES_SQL = text("""
WITH recent AS (
    SELECT step FROM training_steps WHERE user_id IS NULL ORDER BY step DESC LIMIT :versions
)
SELECT s.user_id, count(*) AS n FROM recent r JOIN samples s ON s.trained_step = r.step
GROUP BY s.user_id
""")


class TrainedShares(Collector):
    """`clawrl_trained_share{user_id}` and `clawrl_trained_samples_recent{user_id}`: each
    user's samples in the shared model's newest `versions` versions and their share of them.

    Labelled by user id, not name: `/metrics` is open to whoever reaches the port, and names
    are the operator's to read (the `training_shares` view). A snapshot read by `refresh`,
    replaced whole, so a scrape never sees half of one and a user who left the window drops
    out of the metric."""

    def __init__(self, versions: int = TRAINED_SHARES_VERSIONS) -> None:
        self.versions = versions
        self.counts: dict[int, int] = {}

    async def refresh(self, db: AsyncEngine) -> None:
        async with db.connect() as conn:
            rows = (await conn.execute(_SHARES_SQL, {"versions": self.versions})).all()
        self.counts = {int(r.user_id): int(r.n) for r in rows}

    def collect(self) -> Iterator[Metric]:
        counts = self.counts
        total = sum(counts.values())
        share = GaugeMetricFamily(
            "clawrl_trained_share", f"Share of the samples trained into the shared model in "
            f"its newest {self.versions} versions, per user", labels=["user_id"])
        samples = GaugeMetricFamily(
            "clawrl_trained_samples_recent", f"Samples trained into the shared model in its "
            f"newest {self.versions} versions, per user", labels=["user_id"])
        for user_id, n in sorted(counts.items()):
            share.add_metric([str(user_id)], n / total)
            samples.add_metric([str(user_id)], n)
        yield share
        yield samples


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
        self.trained_shares = TrainedShares()
        self.registry.register(self.trained_shares)

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
