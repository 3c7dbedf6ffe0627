"""The shared model as a LoRA adapter: publish a version by loading its adapter into the
engine, not by swapping the whole model.

With `lora.enabled` on the torch backend (a real pretrained model's recipe turns it on,
clawrl/engine/pretrained.py), the shared trainer trains an adapter on the frozen base and
each version folder `weights/v{N:06d}/` holds that adapter (PEFT `adapter_config.json` +
`adapter_model.safetensors`, a few MB) and its trainer_state, not a merged model. Publishing:

    1. load     `/load_lora_adapter {"lora_name": "policy-v{N}", "lora_path"}` (SGLang's
                route); the engine goes on serving every request meanwhile: nothing pauses,
                nothing is written but the adapter
    2. name     `policy_versions` row N: 'published', `adapter = 'policy-vN'`; the proxy
                serves everyone without an adapter of their own the newest published
                version's adapter (proxy/auth.py), within its key cache's time to live
    3. unload   older shared-model adapters, all but the one served before: a proxy whose
                key cache still names that one (proxy/auth.py CACHE_TTL_S) keeps being served
                by it; one older than that, should a proxy still name it, is answered by the
                base model (proxy/chat.py's `adapter_missing` fallback, logged)

A new name per version: no request ever sees a half-swapped adapter. An engine restarted
forgets its adapters; the trainer's `ensure_serving` (at start and when idle) loads the
served one again. Full weights (`/update_weights_from_disk`, trainer/publish.py) stay for
LoRA off and for the megatron backend.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import cast

import httpx
from sqlalchemy import Table, func, select, update
from sqlalchemy.engine import Engine

from clawrl.base.db import PolicyVersion
from clawrl.base.engine_client import policy_adapter_name, policy_adapter_version
from clawrl.base.settings import EngineSettings
from trainer.adapters import AdapterPublishError, engine_adapters, load_adapter, unload_adapter
from trainer.config import TrainerSettings
from trainer.export import ADAPTER_CONFIG, verify_version

log = logging.getLogger("clawrl.trainer")
VERSIONS = cast(Table, PolicyVersion.__table__)


def adapter_mode(cfg: TrainerSettings) -> bool:
    """Whether the shared model's versions are adapters (else full weights)."""
    return cfg.lora.enabled and cfg.backend == "torch"


def is_adapter_version(path: Path) -> bool:
    """A version folder that holds a LoRA adapter rather than a whole model."""
    return (path / ADAPTER_CONFIG).is_file()


def served_adapter(db: Engine) -> str | None:
    """The adapter of the newest published version (what the proxy serves), or None."""
    with db.connect() as conn:
        row = conn.execute(select(VERSIONS.c.adapter).where(VERSIONS.c.status == "published")
                           .order_by(VERSIONS.c.version.desc()).limit(1)).first()
    return None if row is None else row.adapter


def ensure_loaded(engine: EngineSettings, name: str, path: Path) -> None:
    """Load `path` as `name` unless the engine has it already (a rollback to the previous
    version, a retry after the load went through but its answer was lost)."""
    try:
        load_adapter(engine, name, path)
    except AdapterPublishError as exc:
        if "already loaded" not in str(exc):
            raise


def publish_adapter_version(db: Engine, engine: EngineSettings, version: int, path: Path, *,
                            attempts: int = 3, backoff_s: float = 1.0) -> str:
    """Steps 1–3 of the module docstring. Returns the adapter's name. Raises CheckpointError
    (a bad folder: the engine is never asked), AdapterPublishError or httpx.HTTPError (every
    attempt failed: whoever was served keeps being served it)."""
    verify_version(path)
    name = policy_adapter_name(version)
    for attempt in range(1, attempts + 1):
        try:
            ensure_loaded(engine, name, path)
            break
        except (AdapterPublishError, httpx.HTTPError) as exc:
            if attempt == attempts:
                raise
            log.warning("loading %s, attempt %d/%d failed: %s", name, attempt, attempts, exc,
                        extra={"action": "publish_retry"})
            time.sleep(backoff_s * 2 ** (attempt - 1))
    before = served_adapter(db)
    mark_published(db, version, name)
    unload_stale(engine, keep={name} | ({before} if before else set()))
    return name


def mark_published(db: Engine, version: int, adapter: str | None = None) -> None:
    """Version N's row says 'published', naming its adapter (None: a full-weight version)."""
    with db.begin() as conn:
        conn.execute(update(VERSIONS).where(VERSIONS.c.version == version)
                     .values(status="published", published_at=func.now(), adapter=adapter))


def unload_stale(engine: EngineSettings, keep: set[str]) -> list[str]:
    """Unload every shared-model adapter the engine has but `keep`; personal adapters are
    not touched. Returns the names unloaded. A failure only costs memory: logged."""
    gone = []
    try:
        for name in sorted(engine_adapters(engine)):
            if policy_adapter_version(name) is not None and name not in keep:
                unload_adapter(engine, name)
                gone.append(name)
    except (AdapterPublishError, httpx.HTTPError) as exc:
        log.warning("could not unload old shared adapters: %s", exc,
                    extra={"action": "unload_failed"})
    return gone


def adapter_loaded(engine: EngineSettings, version: int) -> bool:
    """Whether the engine has version N's adapter (raises httpx.HTTPError: unreachable)."""
    return policy_adapter_name(version) in engine_adapters(engine)


def rollback_adapter(db: Engine, engine: EngineSettings, version: int, path: Path) -> str:
    """Serve adapter version N again: load it, mark it 'published', and retire every newer
    version (the proxy then picks N: the newest published); the adapter served until now
    stays loaded for the proxies that still name it, newer ones are unloaded. Raises as
    `publish_adapter_version`."""
    verify_version(path)
    name = policy_adapter_name(version)
    ensure_loaded(engine, name, path)
    before = served_adapter(db)
    with db.begin() as conn:
        conn.execute(update(VERSIONS).where(VERSIONS.c.version > version,
                                            VERSIONS.c.status.not_in(("retired", "rejected")))
                     .values(status="retired"))
    mark_published(db, version, name)
    unload_stale(engine, keep={name} | ({before} if before else set()))
    return name


def unload_all(engine: EngineSettings) -> list[str]:
    """Rollback to the base model: no shared-model adapter is served any more."""
    return unload_stale(engine, keep=set())
