"""`clawrl eval --track toolcall`: an agent track's rounds against a running stack.

Instead of simulated people, one agent user runs tool-call episodes (clawrl/envs/toolcall.py)
through the proxy with the episode pool (clawrl/envs/pool.py), exactly as `clawrl env
toolcall` does: sessions marked with `X-Session-Id`, tool results as next states (judged by the
frozen judge: the process reward), the verified outcome posted at the end. Each round runs
waves of episodes on held-in questions until a batch is ready, waits for the trainer's next
version, then probes `probes` episodes on held-out questions as side turns (never trained, no
outcome posted). A probe row's `satisfied` is the success rate, `correct` the share of final
answers that state the asked fact (looked up or not).

The methods differ only in where the reward comes from (all train with `rl`):
`outcome+process` (the outcome mixed with the judge's vote at weight 0.5), `outcome` (the
outcome alone), `process` (the judge's votes alone); `none` never trains.
"""

from __future__ import annotations

import time
from collections import Counter
from functools import partial
from typing import Any

from clawrl.envs.pool import PoolConfig, PoolResult, run_pool
from clawrl.eval.config import EvalConfig
from clawrl.eval.rounds import serving_version, train_one_version, version_stats

AGENT = "agent-toolcall"
MAX_STEPS = 4
WAVE = 16  # episodes per wave while a batch fills


async def run_agent_rounds(config: EvalConfig, method: str, proxy_url: str, db_url: str,
                           engine_url: str, on_round: Any) -> None:
    """Create the agent's key, then episodes / wait for training / probe, round by round."""
    from clawrl.base.db import create_async
    from proxy import admin
    from proxy.auth import VERIFIER

    db = create_async(db_url)
    try:
        await admin.ensure_user(db, AGENT)
        # One key for every simulated agent (no per-key limit in flight), a verifier key:
        # the agent track posts each episode's verified outcome.
        key = (await admin.create_key(db, AGENT, name="clawrl eval", rate_limit_rpm=0,
                                      max_concurrent=0, scopes=[VERIFIER])).secret
    finally:
        await db.dispose()
    base_url = f"{proxy_url}/v1"
    db = create_async(db_url)
    started = time.monotonic()
    try:
        for rnd in range(config.rounds + 1):
            failed: list[int] = []  # per wave: episodes whose request or outcome was refused
            if rnd > 0 and method != "none":
                await train_one_version(config, db, method, engine_url,
                                        config.max_chats * -(-config.batch_size // 16),
                                        partial(_train_wave, config, rnd, base_url, key, failed))
            version = await serving_version(engine_url)
            probe = await run_pool(_probe(config), base_url, key)
            row = probe_row(config, method, rnd, version, await version_stats(db, version),
                            probe, time.monotonic() - started)
            on_round(method, rnd, [{**row, "failed_train_episodes": sum(failed)}])
    finally:
        await db.dispose()


async def _train_wave(config: EvalConfig, rnd: int, base_url: str, key: str,
                      failed: list[int], wave: int) -> None:
    """One wave of training episodes; how many the proxy refused goes to `failed`."""
    result = await run_pool(_pool(config, rnd, wave), base_url, key)
    failed.append(sum(result.errors().values()))


def _pool(config: EvalConfig, rnd: int, wave: int) -> PoolConfig:
    """A wave of training episodes: held-in questions, seeds apart per seed/round/wave."""
    return PoolConfig(env="toolcall", episodes=WAVE, concurrency=config.parallel * 2,
                      max_steps=MAX_STEPS, seed=(config.seed * 1000 + rnd * 40 + wave) * 1000,
                      group=config.group,
                      max_tokens=96, session_prefix=f"train-r{rnd}-w{wave}",
                      options={"split": "train", "world_seed": config.world_seed})


def _probe(config: EvalConfig) -> PoolConfig:
    """The probe: the same episodes every round (held-out questions unless the run asked for
    held-in ones, `probe_split`), as side turns, no outcome."""
    return PoolConfig(env="toolcall", episodes=config.probes, concurrency=config.parallel * 4,
                      max_steps=MAX_STEPS, seed=10_000_000 + config.seed * 1000, max_tokens=96,
                      session_prefix="probe", headers={"X-Turn-Type": "side"},
                      post_outcome=False,
                      options={"split": config.probe_split, "world_seed": config.world_seed})


def probe_row(config: EvalConfig, method: str, rnd: int, version: str, stats: dict[str, Any],
              probe: PoolResult, elapsed: float) -> dict[str, Any]:
    ok = probe.ok
    if not ok:
        raise RuntimeError(f"every probe episode failed: {dict(probe.errors())}")
    moves = Counter(str(e.details.get("first_move")) for e in ok)
    return {"method": method, "seed": config.seed, "round": rnd, "version": version, **stats,
            "user": AGENT, "pref": "toolcall",
            "satisfied": round(sum(1 for e in ok if (e.outcome or 0) > 0) / len(ok), 4),
            "correct": round(sum(1 for e in ok if e.details.get("answer_correct")) / len(ok), 4),
            "first_move": {k: round(v / len(ok), 4) for k, v in sorted(moves.items())},
            "failed_probes": len(probe.episodes) - len(ok),
            "mean_steps": round(sum(e.steps for e in ok) / len(ok), 2),
            "elapsed_s": round(elapsed, 1)}
