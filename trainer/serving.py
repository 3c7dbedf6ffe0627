"""Keeping the engine on the shared trainer's newest version: publish a saved version (an
adapter loaded beside the frozen base, trainer/policy_adapter.py, or full weights swapped in,
trainer/publish.py), mark it 'published', and check at start and when idle that the engine
still serves it (an engine restart loads the base model again and forgets adapters; a
publish may have failed; a rollback may have retired it).
"""

from __future__ import annotations

import logging
from pathlib import Path

import httpx
from sqlalchemy import select
from sqlalchemy.engine import Engine

from clawrl.base.engine_client import policy_adapter_name, sync_client
from clawrl.base.settings import EngineSettings
from trainer.adapters import AdapterPublishError
from trainer.config import TrainerSettings
from trainer.data import VERSIONS
from trainer.export import CheckpointError, version_dir
from trainer.metrics import TrainerMetrics
from trainer.policy_adapter import (
    adapter_loaded,
    adapter_mode,
    mark_published,
    publish_adapter_version,
)
from trainer.publish import PublishError, publish_version, serving_version

log = logging.getLogger("clawrl.trainer")


def publish(db: Engine, engine: EngineSettings, cfg: TrainerSettings, version: int,
            path: Path, metrics: TrainerMetrics) -> bool:
    """Publish a saved version and mark it 'published'; on failure keep serving the old one.
    An adapter version is loaded beside the base (trainer/policy_adapter.py), a full-weight
    one swapped in (trainer/publish.py)."""
    try:
        if adapter_mode(cfg):
            publish_adapter_version(db, engine, version, path, attempts=cfg.publish_attempts,
                                    backoff_s=cfg.publish_backoff_s)
        else:
            publish_version(engine, path, version, attempts=cfg.publish_attempts,
                            backoff_s=cfg.publish_backoff_s, timeout_s=cfg.publish_timeout_s)
            mark_published(db, version)
    except (PublishError, CheckpointError, AdapterPublishError, httpx.HTTPError) as exc:
        metrics.publish_failures.inc()
        log.error("v%d not published (the engine keeps serving the current version): %s",
                  version, exc, extra={"action": "publish_failed"})
        return False
    metrics.version.set(version)
    return True


class RolledBack(Exception):
    """The version this trainer continues from was retired by `clawrl versions rollback`."""


def ensure_serving(db: Engine, engine: EngineSettings, cfg: TrainerSettings, current: int,
                   weights_dir: Path, metrics: TrainerMetrics) -> None:
    """Make sure the engine serves our newest version (an engine restart loads the base model
    again and forgets adapters; a publish may have failed), and stop if a rollback retired
    that version."""
    if current == 0:
        return
    with db.connect() as conn:
        status = conn.execute(select(VERSIONS.c.status)
                              .where(VERSIONS.c.version == current)).scalar()
    if status == "retired":
        raise RolledBack(f"v{current} was retired by a rollback; restart the trainer to "
                         "continue from the rolled-back version")
    try:
        if adapter_mode(cfg):
            serving = str(current) if adapter_loaded(engine, current) else None
        else:
            with sync_client(engine, 10.0) as client:
                serving = serving_version(client)
    except httpx.HTTPError as exc:
        log.warning("engine unreachable: %s", exc, extra={"action": "engine_unreachable"})
        return
    if serving != str(current):
        log.warning("engine serves %r, not v%d: publishing again", serving, current,
                    extra={"action": "republish"})
        publish(db, engine, cfg, current, version_dir(weights_dir, current), metrics)
    elif status != "published":  # swapped, but killed before the DB said so
        mark_published(db, current, policy_adapter_name(current) if adapter_mode(cfg) else None)
        metrics.version.set(current)
