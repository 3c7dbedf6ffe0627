"""Prometheus metrics of the trainer: a textfile rewritten every step (for node_exporter's
textfile collector, and readable by hand) and, when a port is configured, a /metrics endpoint.
"""

from __future__ import annotations

from pathlib import Path

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    start_http_server,
    write_to_textfile,
)

from trainer.backends.base import StepStats


class TrainerMetrics:
    def __init__(self, textfile: Path, port: int | None = None) -> None:
        self.textfile = textfile
        r = self.registry = CollectorRegistry()
        self.steps = Counter("clawrl_trainer_steps", "training steps by status", ["status"],
                             registry=r)
        self.samples = Counter("clawrl_trainer_samples_trained", "samples trained", registry=r)
        self.tokens = Counter("clawrl_trainer_tokens_trained", "response tokens trained",
                              registry=r)
        self.skipped = Counter("clawrl_trainer_samples_skipped", "samples skipped by reason",
                               ["reason"], registry=r)
        self.publish_failures = Counter("clawrl_trainer_publish_failures",
                                        "failed publish attempts (after retries)", registry=r)
        self.step = Gauge("clawrl_trainer_step", "last training step", registry=r)
        self.version = Gauge("clawrl_trainer_version_published",
                             "weight version the engine confirmed", registry=r)
        self.loss = Gauge("clawrl_trainer_loss", "loss of the last ok step", registry=r)
        self.reward = Gauge("clawrl_trainer_reward_mean", "mean reward of the last batch",
                            registry=r)
        self.staleness = Gauge("clawrl_trainer_staleness_mean",
                               "mean versions between sampling and training", registry=r)
        self.tokens_per_s = Gauge("clawrl_trainer_tokens_per_second",
                                  "train step throughput", registry=r)
        self.publish_seconds = Gauge("clawrl_trainer_publish_seconds",
                                     "export + publish latency of the last version", registry=r)
        if port is not None:
            start_http_server(port, registry=r)

    def record_step(self, step: int, stats: StepStats, reward_mean: float | None,
                    staleness: float, skipped: dict[str, int]) -> None:
        self.steps.labels(stats.status).inc()
        self.step.set(step)
        for reason, n in skipped.items():
            self.skipped.labels(reason).inc(n)
        self.staleness.set(staleness)
        if reward_mean is not None:
            self.reward.set(reward_mean)
        if stats.status == "ok":
            self.samples.inc(stats.num_samples)
            self.tokens.inc(stats.num_tokens)
            self.tokens_per_s.set(stats.tokens_per_s)
            if stats.loss is not None:
                self.loss.set(stats.loss)

    def write(self) -> None:
        self.textfile.parent.mkdir(parents=True, exist_ok=True)
        write_to_textfile(str(self.textfile), self.registry)
