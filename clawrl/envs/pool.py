"""The episode pool: N episodes at once, each driving the proxy through the OpenAI SDK exactly
as a user's agent would.

    result = await run_pool(PoolConfig(env="terminal", episodes=64, concurrency=16),
                            base_url="http://127.0.0.1:8000/v1", api_key="ck-…")

Per episode: `env.reset()`, then up to `max_steps` chat requests, each carrying the whole
conversation so far and `X-Session-Id: <prefix>-<run>-<episode>`; the request of the last
allowed step also carries `X-Session-Done: 1`. After each reply, `env.step(reply)` gives the
next state (tool results as `tool` messages), appended before the next request, so the proxy
attaches it to the reply's turn. When the episode ends (the environment says done, or the
steps run out) its verified outcome is posted to `POST /v1/sessions/{id}/outcome`. An episode
that ends before its last allowed step sent no `X-Session-Done` (it is known to be the last
only after its reply): its final turn closes with the session timeout, like any chat's, and
having no next state it is never trained, whichever way the session ends.
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

from clawrl.envs.protocol import Message
from clawrl.envs.registry import make_env


@dataclass
class PoolConfig:
    env: str = "terminal"
    episodes: int = 16
    concurrency: int = 4
    max_steps: int = 6
    seed: int = 0  # episode i gets seed + i // group (the terminal track: its task and details)
    group: int = 1  # episodes per environment seed: `group` episodes of each task (GRPO)
    model: str = "default"
    max_tokens: int = 128
    temperature: float = 1.0
    session_prefix: str = "env"
    timeout_s: float = 300.0  # per request (the SDK retries twice)
    options: dict[str, Any] = field(default_factory=dict)  # passed to the environment
    headers: dict[str, str] = field(default_factory=dict)  # sent with every request
    post_outcome: bool = True  # False: measure only (e.g. side-turn probes), report nothing


@dataclass
class EpisodeResult:
    index: int
    session_id: str
    task: str
    steps: int            # chat requests sent
    outcome: float | None  # None when the episode failed before it was verified
    done_sent: bool       # whether a request carried X-Session-Done
    seconds: float
    error: str | None = None
    request_ms: list[float] = field(default_factory=list)  # each chat request, as the SDK saw it
    details: dict[str, Any] = field(default_factory=dict)  # the environment's `details()`


@dataclass
class PoolResult:
    episodes: list[EpisodeResult]
    seconds: float

    @property
    def ok(self) -> list[EpisodeResult]:
        return [e for e in self.episodes if e.error is None]

    @property
    def episodes_per_s(self) -> float:
        return len(self.ok) / self.seconds if self.seconds > 0 else 0.0

    @property
    def steps_per_s(self) -> float:
        return sum(e.steps for e in self.ok) / self.seconds if self.seconds > 0 else 0.0

    def by_task(self) -> dict[str, tuple[int, int, float]]:
        """task -> (episodes, solved, mean steps), over the episodes that finished."""
        groups: dict[str, list[EpisodeResult]] = defaultdict(list)
        for e in self.ok:
            groups[e.task].append(e)
        return {task: (len(es), sum(1 for e in es if (e.outcome or 0) > 0),
                       sum(e.steps for e in es) / len(es)) for task, es in sorted(groups.items())}

    def errors(self) -> Counter[str]:
        return Counter(e.error for e in self.episodes if e.error is not None)


def reply_message(message: Any) -> Message:
    """The assistant message to send back, from the SDK's object: role, content, tool calls
    (what an agent framework keeps; the proxy matches on text and parsed tool calls)."""
    out: Message = {"role": "assistant", "content": message.content or ""}
    if message.tool_calls:
        out["tool_calls"] = [{"id": c.id, "type": "function",
                              "function": {"name": c.function.name,
                                           "arguments": c.function.arguments}}
                             for c in message.tool_calls]
    return out


def step_seed(seed: int, index: int, step: int) -> int:
    """The sampling seed (OpenAI's `seed`) of episode `index`'s step `step` in a pool run
    with `seed`: distinct for every episode (a group's episodes of one task still differ) and
    the same when the run is repeated, so a probe pool run against each version samples with
    the same random numbers."""
    return random.Random(f"step-{seed}-{index}-{step}").randrange(2**31)


async def run_episode(client: Any, cfg: PoolConfig, index: int, run_id: str) -> EpisodeResult:
    """One episode through `client` (an `openai.AsyncOpenAI` pointed at the proxy)."""
    import openai

    env = make_env(cfg.env, cfg.seed + index // cfg.group, **cfg.options)
    session = f"{cfg.session_prefix}-{run_id}-{index}"
    start = time.perf_counter()
    task, steps, done_sent = "", 0, False
    request_ms: list[float] = []
    try:
        obs = await env.reset()
        task = obs.task
        messages = list(obs.messages)
        extra: dict[str, Any] = {"tools": obs.tools} if obs.tools else {}
        while steps < cfg.max_steps:
            steps += 1
            headers = {**cfg.headers, "X-Session-Id": session}
            if steps == cfg.max_steps:
                headers["X-Session-Done"] = "1"
                done_sent = True
            sent = time.perf_counter()
            completion = await client.chat.completions.create(
                model=cfg.model, messages=messages, max_tokens=cfg.max_tokens,
                temperature=cfg.temperature, extra_headers=headers,
                seed=step_seed(cfg.seed, index, steps), **extra)
            request_ms.append((time.perf_counter() - sent) * 1e3)
            reply = reply_message(completion.choices[0].message)
            messages.append(reply)
            step = await env.step(reply)
            messages.extend(step.messages)
            if step.done:
                break
        outcome = await env.outcome()
        if cfg.post_outcome:
            await client.post(f"/sessions/{quote(session, safe='')}/outcome",
                              body={"outcome": outcome}, cast_to=object)
        details = env.details() if hasattr(env, "details") else {}
        return EpisodeResult(index, session, task, steps, outcome, done_sent,
                             time.perf_counter() - start, None, request_ms, details)
    except (openai.APIError, OSError, RuntimeError) as exc:
        error = (f"HTTP {exc.status_code}" if isinstance(exc, openai.APIStatusError)
                 else type(exc).__name__)
        return EpisodeResult(index, session, task, steps, None, done_sent,
                             time.perf_counter() - start, error, request_ms)
    finally:
        await env.close()


async def run_pool(cfg: PoolConfig, base_url: str, api_key: str,
                   on_episode: Any = None) -> PoolResult:
    """Run `cfg.episodes` episodes, `cfg.concurrency` at a time, through one SDK client
    (one connection pool, as one agent service would); `on_episode(result)` after each."""
    from openai import AsyncOpenAI

    run_id = uuid.uuid4().hex[:8]
    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=2,
                         timeout=cfg.timeout_s)
    gate = asyncio.Semaphore(cfg.concurrency)

    async def one(i: int) -> EpisodeResult:
        async with gate:
            result = await run_episode(client, cfg, i, run_id)
        if on_episode is not None:
            on_episode(result)
        return result

    start = time.perf_counter()
    try:
        results = await asyncio.gather(*(one(i) for i in range(cfg.episodes)))
    finally:
        await client.close()
    return PoolResult(list(results), time.perf_counter() - start)


def print_result(result: PoolResult, file: Any = None) -> None:
    """The pool's table: per task, then the totals."""
    print(f"{'task':<12} {'episodes':>8} {'solved':>6} {'rate':>5} {'steps':>5}", file=file)
    for task, (n, solved, steps) in result.by_task().items():
        print(f"{task:<12} {n:>8} {solved:>6} {solved / n:>5.2f} {steps:>5.1f}", file=file)
    ok = result.ok
    solved = sum(1 for e in ok if (e.outcome or 0) > 0)
    rate = f"{solved / len(ok):.2f}" if ok else "-"
    print(f"{len(ok)} episodes in {result.seconds:.1f} s: {solved} solved ({rate}), "
          f"{result.episodes_per_s:.2f} episodes/s, {result.steps_per_s:.1f} steps/s", file=file)
    for error, n in sorted(result.errors().items()):
        print(f"failed: {n} episode(s) with {error}", file=file)
