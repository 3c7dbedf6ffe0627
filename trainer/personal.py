"""Personal mode: one LoRA adapter per user, trained on that user's samples only.

    CLAWRL_TRAINER__PERSONAL=true clawrl train        (or `clawrl train --personal`)

The base model stays as it is (the engine serves it to everyone without an adapter); each
user with trainable samples gets an adapter of their own, in turn:

    1. pick     the user whose adapter was trained longest ago (never: first) among those
                with a full batch ready, or a partial one older than `max_wait_s`: a busy
                user gets one step, then waits behind everyone else who has something ready
    2. load     that user's newest adapter (PEFT folder) and its optimizer state into the one
                live LoRA model; a new user starts from peft's initialisation (B = 0: the
                base model exactly)
    3. claim    up to `batch_size` of that user's samples (trainer/data.py, `user_id`)
    4. train    the same step as the shared model's (loss, KL to the base: adapter off)
    5. save     weights/users/u{user}/v{N:06d}/ (adapter_model.safetensors +
                adapter_config.json, optimizer state), completion marker last
    6. commit   ONE transaction: training_steps (with user_id) + adapter_versions 'saved' +
                the samples marked trained by that step
    7. publish  `/load_lora_adapter {"lora_name": "user{U}-v{N}", "lora_path"}`, then
                `user_adapters` names it (the proxy serves the user with it from then on),
                'published', and the user's previous adapter is unloaded

A user's versions count 1, 2, … on their own. Crash safety is the shared trainer's: a kill
before 6 rolls the claim back and the folder is rewritten by the next try; a kill after 6
publishes on restart (`ensure_adapters`). The engine forgets adapters when it restarts;
`ensure_adapters` (at start and whenever the trainer is idle) loads every published one
again, and the proxy serves the base model until then. Users who opted out of training get
no adapter: their samples are skipped, and an adapter they had is unloaded, its folders
deleted and its versions retired. `clawrl users delete` removes a user's adapters from the
engine, the disk and the database (proxy/admin.py).
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from statistics import mean
from typing import Any, cast

import httpx
from sqlalchemy import Table, delete, func, select, text, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.engine import Engine

from clawrl.base.db import AdapterVersion, UserAdapter, create_engine
from clawrl.base.settings import EngineSettings
from trainer.adapters import AdapterPublishError, engine_adapters, load_adapter, unload_adapter
from trainer.backends.torch import TorchBackend
from trainer.config import Settings
from trainer.data import STEPS, Claim, claim_batch, record_step, replay_of

log = logging.getLogger("clawrl.trainer")
ADAPTERS = cast(Table, AdapterVersion.__table__)
USER_ADAPTERS = cast(Table, UserAdapter.__table__)
COMPLETE = ".complete"
# While nobody has samples ready, look this often for them (and at the engine's adapters).
IDLE_CHECK_S = 30.0


def adapter_dir(weights_dir: Path, user_id: int, version: int) -> Path:
    return weights_dir / "users" / f"u{user_id}" / f"v{version:06d}"


def adapter_name(user_id: int, version: int) -> str:
    """The engine's name for a user's adapter version (unique: a new version, a new name)."""
    return f"user{user_id}-v{version}"


@dataclass(frozen=True)
class Ready:
    user_id: int
    samples: int
    waited_s: float


def ready_users(db: Engine) -> list[Ready]:
    """Users with untrained samples, the user whose adapter was trained longest ago first."""
    query = text("""
        SELECT s.user_id, count(*) AS samples,
               extract(epoch FROM now() - min(s.created_at)) AS waited_s,
               (SELECT max(a.created_at) FROM adapter_versions a
                 WHERE a.user_id = s.user_id) AS last_trained
        FROM samples s
        WHERE s.trained_step IS NULL AND s.skipped_reason IS NULL
        GROUP BY s.user_id
        ORDER BY last_trained ASC NULLS FIRST, waited_s DESC, s.user_id""")
    with db.connect() as conn:
        return [Ready(int(r.user_id), int(r.samples), float(r.waited_s))
                for r in conn.execute(query)]


def pick_user(ready: list[Ready], batch_size: int, max_wait_s: float,
              min_batch_size: int = 1) -> int | None:
    """The first user (in `ready_users` order) with a full batch, or one that waited long
    enough and holds `min_batch_size`: round robin over users, so a busy user cannot starve
    the others."""
    for r in ready:
        if r.samples >= batch_size or (r.waited_s >= max_wait_s
                                       and r.samples >= min(min_batch_size, batch_size)):
            return r.user_id
    return None


def newest_version(db: Engine, user_id: int) -> tuple[int, Path | None]:
    """The version a user's training continues from (0 and None: no adapter yet), and its
    folder: the newest version that is not retired."""
    with db.connect() as conn:
        row = conn.execute(
            select(ADAPTERS.c.version, ADAPTERS.c.path)
            .where(ADAPTERS.c.user_id == user_id, ADAPTERS.c.status != "retired")
            .order_by(ADAPTERS.c.version.desc()).limit(1)).first()
    return (0, None) if row is None else (int(row.version), Path(row.path))


def next_version(db: Engine, user_id: int) -> int:
    """Versions keep counting past retired ones, so an engine name is never reused."""
    with db.connect() as conn:
        top = conn.execute(select(func.max(ADAPTERS.c.version))
                           .where(ADAPTERS.c.user_id == user_id)).scalar()
    return int(top or 0) + 1


def next_step(db: Engine) -> int:
    with db.connect() as conn:
        return int(conn.execute(select(func.max(STEPS.c.step))).scalar() or 0) + 1


# -- the engine's side: trainer/adapters.py ---------------------------------------------
def publish_adapter(db: Engine, engine: EngineSettings, user_id: int, version: int,
                    path: Path) -> None:
    """Load a saved adapter version into the engine, then point the user's requests at it
    and unload the one they had."""
    name = adapter_name(user_id, version)
    load_adapter(engine, name, path)
    with db.begin() as conn:
        old = conn.execute(select(USER_ADAPTERS.c.name)
                           .where(USER_ADAPTERS.c.user_id == user_id)).scalar()
        values = {"name": name, "version": version, "path": str(path), "loaded": True,
                  "updated_at": func.now()}
        conn.execute(pg_insert(USER_ADAPTERS).values(user_id=user_id, **values)
                     .on_conflict_do_update(index_elements=["user_id"], set_=values))
        conn.execute(update(ADAPTERS)
                     .where(ADAPTERS.c.user_id == user_id, ADAPTERS.c.version == version)
                     .values(status="published", published_at=func.now()))
    if old is not None and old != name:
        try:
            unload_adapter(engine, old)
        except (AdapterPublishError, httpx.HTTPError) as exc:  # it only costs memory (LRU)
            log.warning("could not unload %s: %s", old, exc, extra={"action": "unload_failed"})


def ensure_adapters(db: Engine, engine: EngineSettings, weights_dir: Path) -> int:
    """Load every user's served adapter the engine lacks (an engine restart forgets them),
    publish versions saved but never published (killed in between), take adapters away
    from users who opted out of training, and delete deleted users' folders. Returns how
    many adapters were (re)loaded."""
    sweep_deleted(db, weights_dir)
    remove_opted_out(db, engine)
    with db.connect() as conn:
        pending = conn.execute(text("""
            SELECT DISTINCT ON (a.user_id) a.user_id, a.version, a.path
            FROM adapter_versions a JOIN users u ON u.id = a.user_id
            WHERE a.status = 'saved' AND NOT u.train_opt_out
              AND a.version > coalesce((SELECT version FROM user_adapters x
                                        WHERE x.user_id = a.user_id), 0)
            ORDER BY a.user_id, a.version DESC""")).all()
        served = conn.execute(select(USER_ADAPTERS.c.user_id, USER_ADAPTERS.c.name,
                                     USER_ADAPTERS.c.path)).all()
    loaded = 0
    for row in pending:
        publish_adapter(db, engine, row.user_id, row.version, Path(row.path))
        loaded += 1
    have = engine_adapters(engine)
    for row in served:
        if row.name not in have and all(p.user_id != row.user_id for p in pending):
            load_adapter(engine, row.name, Path(row.path))
            loaded += 1
    return loaded


def sweep_deleted(db: Engine, weights_dir: Path) -> list[str]:
    """Delete the adapter folders of users that no longer exist (deleted while their folders
    were out of the deleting process's reach)."""
    root = weights_dir / "users"
    if not root.is_dir():
        return []
    with db.connect() as conn:
        users = {int(i) for i in conn.execute(text("SELECT id FROM users")).scalars()}
    gone = [d for d in root.iterdir()
            if d.is_dir() and d.name[1:].isdigit() and int(d.name[1:]) not in users]
    for d in gone:
        shutil.rmtree(d)
    return [str(d) for d in gone]


def remove_opted_out(db: Engine, engine: EngineSettings) -> None:
    """A user who opted out of training has no adapter: unloaded, folders deleted, versions
    retired, `user_adapters` row gone."""
    with db.connect() as conn:
        gone = conn.execute(text("""
            SELECT u.id, x.name FROM users u
            LEFT JOIN user_adapters x ON x.user_id = u.id
            WHERE u.train_opt_out AND (x.user_id IS NOT NULL OR EXISTS (
                SELECT 1 FROM adapter_versions a WHERE a.user_id = u.id
                AND a.status <> 'retired'))""")).all()
    for row in gone:
        delete_user_adapters(db, engine, row.id, row.name, keep_rows=True)
        log.info("user %d opted out of training: adapter removed", row.id,
                 extra={"action": "adapter_removed"})


def delete_user_adapters(db: Engine, engine: EngineSettings | None, user_id: int,
                         name: str | None, *, keep_rows: bool) -> list[str]:
    """Unload the user's adapter from the engine, delete their adapter folders, and either
    retire their versions (`keep_rows`) or delete them. Returns the folders deleted."""
    with db.connect() as conn:
        paths = [Path(p) for p in conn.execute(
            select(ADAPTERS.c.path).where(ADAPTERS.c.user_id == user_id)).scalars()]
    if engine is not None and name is not None:
        unload_adapter(engine, name)
    with db.begin() as conn:
        conn.execute(delete(USER_ADAPTERS).where(USER_ADAPTERS.c.user_id == user_id))
        if keep_rows:
            conn.execute(update(ADAPTERS).where(ADAPTERS.c.user_id == user_id)
                         .values(status="retired"))
        else:
            conn.execute(delete(ADAPTERS).where(ADAPTERS.c.user_id == user_id))
    deleted = []
    for folder in {p.parent for p in paths}:
        if folder.is_dir():
            shutil.rmtree(folder)
            deleted.append(str(folder))
    return deleted


def user_id_of(db: Engine, name: str) -> int | None:
    with db.connect() as conn:
        found = conn.execute(text("SELECT id FROM users WHERE name = :n"), {"n": name}).scalar()
    return None if found is None else int(found)


def list_user_versions(db: Engine, user_id: int) -> list[dict[str, Any]]:
    """A user's adapter versions, oldest first, with whether the folder is complete."""
    with db.connect() as conn:
        rows = conn.execute(select(ADAPTERS).where(ADAPTERS.c.user_id == user_id)
                            .order_by(ADAPTERS.c.version)).mappings().all()
    return [dict(r) | {"folder": "ok" if (Path(r["path"]) / COMPLETE).is_file() else "missing"}
            for r in rows]


def rollback_user(db: Engine, engine: EngineSettings, user_id: int, version: int) -> str:
    """Serve the user their adapter version N again (0: no adapter, the base model) and
    retire every newer version: the trainer continues that user's adapter from N. Returns
    what the user is served now."""
    with db.connect() as conn:
        current = conn.execute(select(USER_ADAPTERS.c.name)
                               .where(USER_ADAPTERS.c.user_id == user_id)).scalar()
        row = conn.execute(select(ADAPTERS.c.path).where(ADAPTERS.c.user_id == user_id,
                                                          ADAPTERS.c.version == version)).first()
    if version == 0:
        if current is not None:
            unload_adapter(engine, current)
        with db.begin() as conn:
            conn.execute(delete(USER_ADAPTERS).where(USER_ADAPTERS.c.user_id == user_id))
            conn.execute(update(ADAPTERS).where(ADAPTERS.c.user_id == user_id)
                         .values(status="retired"))
        return "the base model"
    if row is None or not (Path(row.path) / COMPLETE).is_file():
        raise AdapterPublishError(f"no saved adapter version {version} for this user")
    publish_adapter(db, engine, user_id, version, Path(row.path))
    with db.begin() as conn:
        conn.execute(update(ADAPTERS).where(ADAPTERS.c.user_id == user_id,
                                            ADAPTERS.c.version > version)
                     .values(status="retired"))
    return adapter_name(user_id, version)


def prune_user(db: Engine, user_id: int, keep: int, dry_run: bool = False) -> list[int]:
    """Delete all but the user's newest `keep` unretired folders (never the served one) and
    retire their versions. Returns the versions pruned (with `dry_run`: that would be)."""
    with db.connect() as conn:
        served = conn.execute(select(USER_ADAPTERS.c.version)
                              .where(USER_ADAPTERS.c.user_id == user_id)).scalar()
        rows = conn.execute(select(ADAPTERS.c.version, ADAPTERS.c.path)
                            .where(ADAPTERS.c.user_id == user_id,
                                   ADAPTERS.c.status != "retired")
                            .order_by(ADAPTERS.c.version.desc())).all()
    old = [r for r in rows[keep:] if r.version != served]
    if not old or dry_run:
        return [r.version for r in old]
    with db.begin() as conn:
        conn.execute(update(ADAPTERS).where(ADAPTERS.c.user_id == user_id,
                                            ADAPTERS.c.version.in_([r.version for r in old]))
                     .values(status="retired"))
    for r in old:
        shutil.rmtree(r.path, ignore_errors=True)
    return [r.version for r in old]


# -- one personal step ----------------------------------------------------------------------
def _rows(user_id: int, step: int, version: int, stats: Any, claim: Claim,
          path: Path | None) -> tuple[dict[str, Any], dict[str, Any] | None]:
    rewards = [r for r in claim.rewards if r is not None]
    reward_mean = mean(rewards) if rewards else None
    metrics = stats.as_metrics() | {"skipped": dict(claim.skipped), "user_id": user_id}
    ok = stats.status == "ok"
    step_row = dict(step=step, version=None, status=stats.status, user_id=user_id,
                    num_samples=stats.num_samples, num_tokens=stats.num_tokens,
                    loss=stats.loss, reward_mean=reward_mean,
                    staleness_mean=mean(claim.batch.staleness),
                    skipped_stale=claim.skipped.get("stale", 0),
                    tokens_per_s=stats.tokens_per_s, metrics=metrics)
    if not ok or path is None:
        return step_row, None
    return step_row, dict(user_id=user_id, version=version, step=step, path=str(path),
                          status="saved", num_samples=stats.num_samples, loss=stats.loss,
                          reward_mean=reward_mean, stats=metrics)


def train_user(settings: Settings, db: Engine, backend: TorchBackend, user_id: int,
               step: int) -> str | None:
    """One step of `user_id`'s adapter. Returns a progress line, or None when the user had
    nothing trainable after all (their samples were skipped or taken meanwhile)."""
    cfg = settings.trainer
    current, folder = newest_version(db, user_id)
    if folder is None:
        backend.fresh_adapter(cfg.seed * 1_000_003 + user_id)
    else:
        backend.load_adapter(folder)
    # The user was picked because their batch is full or waited long enough: take it now.
    claim, skipped = claim_batch(db, cfg.model_copy(update={"max_wait_s": 0.0,
                                                          "min_batch_size": 1}),
                                 backend.limits, current, give_up_after_s=0.0,
                                 user_id=user_id)
    if claim is None:
        if skipped:
            log.info("user %d: skipped samples %s", user_id, dict(skipped),
                     extra={"action": "skip"})
        return None
    version = next_version(db, user_id)
    path = adapter_dir(settings.weights_dir(), user_id, version)
    try:
        stats = backend.train_step(claim.batch, replay_of(db, cfg, step, user_id))
        if stats.status == "ok":
            if path.exists():  # a try killed before its commit left it
                shutil.rmtree(path)
            backend.save_adapter(path)
            (path / COMPLETE).write_text(json.dumps({"user_id": user_id, "version": version,
                                                     "step": step}))
        step_row, version_row = _rows(user_id, step, version, stats, claim,
                                      path if stats.status == "ok" else None)
        record_step(claim, step=step_row, version=version_row,
                    trained=stats.status == "ok", versions=ADAPTERS)
    except BaseException:
        claim.release()
        raise
    if version_row is None:
        return f"step {step:>5} user {user_id}: skipped: {stats.reason}"
    try:
        publish_adapter(db, settings.engine, user_id, version, path)
        status = f"{adapter_name(user_id, version)} published"
    except (AdapterPublishError, httpx.HTTPError) as exc:
        log.error("user %d v%d not published (the user keeps the previous adapter): %s",
                  user_id, version, exc, extra={"action": "publish_failed"})
        status = f"{adapter_name(user_id, version)} NOT published (saved)"
    prune_user(db, user_id, cfg.keep_adapter_versions)
    loss = "-" if stats.loss is None else f"{stats.loss:+.4f}"
    return (f"step {step:>5} user {user_id} v{version} | {stats.num_samples} samples "
            f"{stats.num_tokens} tok | loss {loss} | {status}")


def train_personal(settings: Settings, *, max_steps: int | None = None, once: bool = False,
                   should_stop: Any = None, backend: TorchBackend | None = None) -> int:
    """The personal trainer loop (module docstring). Returns the number of ok steps."""
    from clawrl.base.dbcli import resolve_url

    cfg = settings.trainer
    stop = should_stop or (lambda: False)
    db = create_engine(resolve_url(settings))
    if backend is None:
        backend = TorchBackend(cfg)
        backend.load(settings.model_dir())
    try:
        try:
            ensure_adapters(db, settings.engine, settings.weights_dir())
        except (AdapterPublishError, httpx.HTTPError) as exc:
            log.warning("could not restore adapters in the engine: %s", exc,
                        extra={"action": "engine_unreachable"})
        step, ok_steps, idle_since = next_step(db), 0, time.monotonic()
        while not stop() and (max_steps is None or ok_steps < max_steps):
            user = pick_user(ready_users(db), cfg.batch_size, cfg.max_wait_s,
                             cfg.min_batch_size)
            line = None if user is None else train_user(settings, db, backend, user, step)
            if line is None:
                if once and time.monotonic() - idle_since >= cfg.max_wait_s:
                    print("no trainable samples ready", flush=True)
                    break
                if time.monotonic() - idle_since >= IDLE_CHECK_S:
                    try:
                        ensure_adapters(db, settings.engine, settings.weights_dir())
                    except (AdapterPublishError, httpx.HTTPError) as exc:
                        log.warning("could not restore adapters: %s", exc,
                                    extra={"action": "engine_unreachable"})
                    idle_since = time.monotonic()
                time.sleep(cfg.poll_s)
                continue
            print(line, flush=True)
            ok_steps += "skipped:" not in line
            step += 1
            idle_since = time.monotonic()
            if once:
                break
        return ok_steps
    finally:
        db.dispose()
