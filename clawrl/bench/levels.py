"""A level of an environment benchmark: the episodes of some seeds, N at a time, each run by an
episode function (a scripted agent, no model). Shared by `clawrl bench env --env swe|gui`."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable
from typing import TypeVar

T = TypeVar("T")


async def run_level(concurrency: int, seeds: Iterable[int],
                    episode: Callable[[int], Awaitable[T]]) -> list[T]:
    """`episode(seed)` for every seed, `concurrency` at a time, in seed order."""
    gate = asyncio.Semaphore(concurrency)

    async def one(seed: int) -> T:
        async with gate:
            return await episode(seed)

    return await asyncio.gather(*(one(seed) for seed in seeds))
