"""One method's rounds against a running stack: the simulated users chat until the judge has
a batch ready, wait for the trainer's next version, then probe held-out prompts.

`loop_state`, `wait_judged` and `wait_published` are how a round knows where the loop is:
judge jobs left, usable samples not yet trained, the newest version served.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

from clawrl.cli.stack import StackError
from clawrl.eval.config import CONNECTED, PERSONAL, EvalConfig
from clawrl.world.town import World


def probe_set(world: World, n: int, seed: int) -> list[str]:
    """`n` held-out prompts: each of the world's held-out questions once in a shuffled order,
    then again, until there are `n` (a prompt asked k times is k sampled replies, so
    accuracy and satisfaction are measured on `n` replies, not on the 66 questions alone)."""
    questions = [q.text for q in world.heldout]
    rng = random.Random(f"probes-{seed}")
    out: list[str] = []
    while len(out) < n:
        out += rng.sample(questions, len(questions))
    return out[:n]


def probe_seeds(seed: int, user: int, n: int) -> list[int]:
    """The sampling seeds of one user's `n` probes: the same at every round and for every
    method of a run's seed, so each version is probed with the same random numbers as round
    0 (common random numbers: an accuracy drop is the model's change, not the sampling's)."""
    rng = random.Random(f"probe-seeds-{seed}-{user}")
    return [rng.randrange(2**31) for _ in range(n)]


async def eval_client(db: Any, name: str, proxy_url: str, *, timeout_s: float = 600.0,
                      max_retries: int = 2, **key: Any) -> Any:
    """The user `name` (made if missing), a key with no per-minute or in-flight limit (one
    simulated user stands for a crowd: the probes alone are `probes` requests at once; with
    --probes 128 a limit of 64 in flight answered 429) unless `key` sets them, and an
    `openai.AsyncOpenAI` client of the proxy with it."""
    from openai import AsyncOpenAI

    from proxy import admin

    await admin.ensure_user(db, name)
    limits = {"rate_limit_rpm": 0, "max_concurrent": 0, **key}
    created = await admin.create_key(db, name, name="clawrl eval", **limits)
    return AsyncOpenAI(base_url=f"{proxy_url}/v1", api_key=created.secret,
                       max_retries=max_retries, timeout=timeout_s)


async def train_one_version(config: EvalConfig, db: Any, method: str, engine_url: str,
                            waves: int, wave: Callable[[int], Awaitable[Any]], *,
                            per_user: int | None = None) -> None:
    """Chat in waves (`wave(k)`, at most `waves`) until a batch is ready or a version newer
    than the round's first is out, then wait until the engine serves that version: one
    published version per round. A batch is ready at `batch_size` usable samples, or, with
    `per_user` (a shared version's quota, `--attack`), once every user with samples waiting
    has that many."""
    start = (await loop_state(db, method))[2]
    rejected = await _newest_rejected(db)
    for k in range(waves):
        await wave(k)
        await wait_judged(db, method, config.round_timeout_s)
        _, ready, newest = await loop_state(db, method)
        if per_user is not None:
            ready = config.batch_size if await fewest_ready(db, method) >= per_user else 0
        if ready >= config.batch_size or newest > start:
            break
    await wait_published(db, method, engine_url, start, config.round_timeout_s, rejected)


async def run_rounds(config: EvalConfig, method: str, proxy_url: str, db_url: str,
                     engine_url: str, on_round: Any) -> None:
    """Create the users, then chat / wait for training / probe, round after round; each
    round's probe rows go to `on_round`."""
    from clawrl.base.db import create_async
    from clawrl.world.simulate import SimUser, phrasings

    says = phrasings(config.followups)

    world = World.build(config.world_seed)
    probe_prompts = probe_set(world, config.probes, config.seed)
    db = create_async(db_url)
    users: list[SimUser] = []
    try:
        for i, pref in enumerate(p for p in config.prefs for _ in range(config.users_per_pref)):
            name = f"sim-{i}-{pref}"
            client = await eval_client(db, name, proxy_url)
            users.append(SimUser(name, pref, client, random.Random(f"user-{config.seed}-{i}"),
                                 says=says))
        started = time.monotonic()
        for rnd in range(config.rounds + 1):
            if rnd > 0 and method == "none":
                for wave in range(-(-config.sessions // config.parallel)):
                    await chat_wave(config, world, users, rnd, wave)
            elif rnd > 0:
                # Chat until a full batch is ready (the trainer only trains full batches),
                # then wait for that version. (personal: every user's own batch, the
                # smallest decides; about 16 samples per wave of 2 users x 4 sessions:
                # scale with the batch)
                waves = config.max_chats * -(-config.batch_size * (
                    len(users) if method == PERSONAL else 1) // 32)
                await train_one_version(config, db, method, engine_url, waves,
                                        partial(chat_wave, config, world, users, rnd))
            if method == PERSONAL:  # each user's own adapter version
                served = await _adapter_versions(db)
            else:
                version = await serving_version(engine_url)
                served = {u.name: (version, await version_stats(db, version)) for u in users}
            results = await asyncio.gather(*(
                u.probe(world, probe_prompts, seeds=probe_seeds(config.seed, i, len(probe_prompts)))
                for i, u in enumerate(users)))
            on_round(method, rnd, [
                {"method": method, "seed": config.seed, "round": rnd,
                 "version": served.get(user.name, ("0", {}))[0],
                 **served.get(user.name, ("0", {}))[1], "user": user.name, "pref": user.pref,
                 "satisfied": round(res.satisfied, 4), "correct": round(res.correct, 4),
                 "examples": res.replies[:3], "wrong_examples": res.wrong[:5],
                 "elapsed_s": round(time.monotonic() - started, 1)}
                for user, res in zip(users, results, strict=True)])
    finally:
        for user in users:
            await user.client.close()
        await db.dispose()


async def chat_wave(config: EvalConfig, world: World, users: list[Any], rnd: int,
                    wave: int) -> None:
    """`config.parallel` concurrent chat sessions per user, each with its own seeded RNG."""
    await asyncio.gather(*(
        user.chat_session(world, rng=random.Random(f"chat-{config.seed}-{user.name}-{rnd}-"
                                                   f"{wave}-{k}"))
        for user in users for k in range(config.parallel)))


async def version_stats(db: Any, version: str) -> dict[str, Any]:
    """What the trainer recorded for the served version (empty for the base model)."""
    from sqlalchemy import text

    if not version.isdigit() or version == "0":
        return {}
    async with db.connect() as conn:
        row = (await conn.execute(text(
            "SELECT num_samples, loss, reward_mean FROM policy_versions WHERE version = :v"),
            {"v": int(version)})).first()
    return {} if row is None else {"train_samples": row[0], "train_loss": row[1],
                                   "train_reward_mean": row[2]}


async def _adapter_versions(db: Any) -> dict[str, tuple[str, dict[str, Any]]]:
    """Per user name: the version of the adapter that serves them ("0": the base model) and
    what the trainer recorded for it."""
    from sqlalchemy import text

    async with db.connect() as conn:
        rows = (await conn.execute(text(
            "SELECT u.name, x.version, a.num_samples, a.loss, a.reward_mean FROM users u "
            "JOIN user_adapters x ON x.user_id = u.id AND x.loaded "
            "JOIN adapter_versions a ON a.user_id = u.id AND a.version = x.version"))).all()
    return {r[0]: (str(r[1]), {"train_samples": r[2], "train_loss": r[3],
                               "train_reward_mean": r[4]}) for r in rows}


def _engine(engine_url: str) -> Any:
    """An `EngineClient` for the engine at `engine_url`, with the key the environment names
    (`clawrl up`'s engine needs one; in connected mode it comes from the stack's file)."""
    from clawrl.base.engine_client import EngineClient
    from clawrl.base.settings import load_settings

    key = load_settings().engine.api_key
    return EngineClient(engine_url, api_key=key.get_secret_value() if key else None,
                        timeout=10.0)


async def _engine_version(engine: Any) -> Any:
    """The engine's `weight_version` (None while it serves the base model's label only)."""
    from clawrl.base.engine_client import EngineClientError

    try:
        return (await engine.model_info()).get("weight_version")
    except EngineClientError as exc:
        what = f"answered {exc.status}" if exc.status else f"failed: {exc}"
        hint = " (set CLAWRL_ENGINE__API_KEY to its key)" if exc.status == 401 else ""
        raise StackError(f"the engine's /model_info {what}{hint}") from exc


async def _adapter_version(engine: Any) -> int | None:
    """The shared model's newest version the engine holds as a LoRA adapter (`policy-vN`,
    trainer/policy_adapter.py; older ones are unloaded as new ones come), or None."""
    from clawrl.base.engine_client import EngineClientError, policy_adapter_version

    try:
        names = await engine.adapters()
    except EngineClientError:
        return None
    versions = [v for v in map(policy_adapter_version, names) if v is not None]
    return max(versions) if versions else None


async def serving_version(engine_url: str) -> str:
    """The shared model's served version: its adapter's when it learns as one, else the
    engine's weight_version."""
    async with _engine(engine_url) as engine:
        version = await _engine_version(engine)
        adapter = await _adapter_version(engine)
    if adapter is not None:
        return str(adapter)
    # The base model serves under the engine's initial label ("default"): call it version 0.
    return "0" if version in (None, "default") else str(version)


def run_connected(config: EvalConfig, on_round: Any) -> None:
    """Measure an already running stack (its own trainer and method) over `--rounds`."""
    from clawrl.base.settings import load_settings
    from clawrl.base.statefile import apply_to_env

    apply_to_env(os.environ)  # a running `clawrl up`: its database and engine key
    settings = load_settings()
    if settings.database.url is None or not (config.proxy_url and config.engine_url):
        raise StackError("--proxy-url needs a running `clawrl up` or CLAWRL_DATABASE__URL (to "
                         "create the users' keys)")
    db_url = settings.database.url.get_secret_value()
    proxy_url = config.proxy_url.rstrip("/").removesuffix("/v1")
    asyncio.run(run_rounds(config, CONNECTED, proxy_url, db_url,
                           config.engine_url.rstrip("/"), on_round))


# Samples the trainer will use under each method (the others it skips when it meets them).
USABLE = {"rl": "reward IS NOT NULL", "opd": "teacher_logprobs IS NOT NULL",
          "combine": "(reward IS NOT NULL OR teacher_logprobs IS NOT NULL)",
          # the agent track (clawrl/eval/agents.py): every episode's session has an outcome
          "outcome+process": "true", "outcome": "true", "process": "reward IS NOT NULL"}


async def loop_state(db: Any, method: str) -> tuple[int, int, int]:
    """(judge jobs queued or running, usable samples not yet trained, newest published
    version or 0). Personal: the fewest usable samples any user has, and the oldest adapter
    version any user is served (0 while one has none)."""
    from sqlalchemy import text

    if method == PERSONAL:
        sql = f"""
        SELECT
          (SELECT count(*) FROM jobs WHERE kind = 'judge' AND status IN ('queued', 'running')),
          (SELECT coalesce(min((SELECT count(*) FROM samples s WHERE s.user_id = u.id
             AND s.trained_step IS NULL AND s.skipped_reason IS NULL
             AND {USABLE["combine"]})), 0) FROM users u),
          (SELECT coalesce(min(coalesce(x.version, 0)), 0) FROM users u
             LEFT JOIN user_adapters x ON x.user_id = u.id AND x.loaded)
        """
        async with db.connect() as conn:
            jobs, samples, newest = (await conn.execute(text(sql))).one()
        return int(jobs), int(samples), int(newest)
    sql = f"""
    SELECT
      (SELECT count(*) FROM jobs WHERE kind = 'judge' AND status IN ('queued', 'running')),
      (SELECT count(*) FROM samples WHERE trained_step IS NULL AND skipped_reason IS NULL
         AND {USABLE.get(method, "true")}),
      (SELECT coalesce(max(version), 0) FROM policy_versions WHERE published_at IS NOT NULL)
    """
    async with db.connect() as conn:
        jobs, samples, newest = (await conn.execute(text(sql))).one()
    return int(jobs), int(samples), int(newest)


async def fewest_ready(db: Any, method: str) -> int:
    """The fewest usable samples not yet trained of any user who has some (0: none)."""
    from sqlalchemy import text

    sql = f"""
    SELECT coalesce(min(n), 0) FROM (
      SELECT count(*) AS n FROM samples WHERE trained_step IS NULL AND skipped_reason IS NULL
        AND {USABLE.get(method, "true")} GROUP BY user_id) per_user
    """
    async with db.connect() as conn:
        return int((await conn.execute(text(sql))).scalar_one())


async def wait_judged(db: Any, method: str, timeout_s: float, poll_s: float = 1.0) -> None:
    """Wait until no judge job is queued or running, twice in a row (turns reach the
    database a moment after their responses: the proxy writes them in the background)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    quiet = 0
    while loop.time() < deadline:
        await asyncio.sleep(poll_s)
        jobs = (await loop_state(db, method))[0]
        quiet = quiet + 1 if jobs == 0 else 0
        if quiet >= 2:
            return
    raise StackError(f"the judge did not finish within {timeout_s:.0f} s ({jobs} jobs left)")


async def _newest_rejected(db: Any) -> int:
    """The newest version the trainer's gate rejected (never served), or 0."""
    from sqlalchemy import text

    async with db.connect() as conn:
        return int((await conn.execute(text(
            "SELECT coalesce(max(version), 0) FROM policy_versions "
            "WHERE status = 'rejected'"))).scalar() or 0)


async def wait_published(db: Any, method: str, engine_url: str, after: int,
                         timeout_s: float, rejected: int | None = None,
                         poll_s: float = 1.0) -> int:
    """Wait until a version newer than `after` is published and the engine serves it, or
    the gate rejects one newer than `rejected` (read now when not given): the engine goes
    on serving `after`, and the round probes that."""
    from proxy.auth import CACHE_TTL_S

    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    if rejected is None:
        rejected = await _newest_rejected(db)
    async with _engine(engine_url) as engine:
        while loop.time() < deadline:
            await asyncio.sleep(poll_s)
            newest = (await loop_state(db, method))[2]
            if method == PERSONAL and newest > after:
                # The engine has every user's adapter before the row names it; the proxy
                # reads the row within its key cache's time to live.
                await asyncio.sleep(CACHE_TTL_S + 0.5)
                return newest
            serving = await _engine_version(engine)
            if newest > after and str(newest) == str(serving):
                return newest
            if newest > after and await _adapter_version(engine) == newest:
                # The shared model's adapter: loaded before its row said 'published'; the
                # proxy reads the row within its key cache's time to live.
                await asyncio.sleep(CACHE_TTL_S + 0.5)
                return newest
            if await _newest_rejected(db) > rejected:  # the gate kept the served version
                return after
    raise StackError(f"the trainer published nothing after v{after} within {timeout_s:.0f} s "
                     "(see its log)")
