"""Reward by weight version, kept up to date incrementally for the console.

The `reward_by_version` view (migration 0002) reads every turn; with a million turns that
takes seconds, too slow for a page or a live chart. `RewardTally` reads the whole log once,
then only what is new: turns and judgments past the ids it has seen (primary-key range
scans), and only rows older than `LAG_S`, so that a transaction still in flight when it
looked is not skipped. A turn judged again moves from its previous judgment's counts to
the new one's (the latest judgment counts, as in the view). Deleted users' turns leave the
counts at the next full rebuild (every `REBUILD_S`, in the background while pages keep the
old counts; or at once after `reset()`, which the console calls when it deletes a user).
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

LAG_S = 2.0
REBUILD_S = 600.0
BATCH = 1_000_000

NEW_TURNS = text("""
    SELECT weight_version, count(*) FILTER (WHERE kind = 'main') AS turns, count(*) AS every
    FROM turns
    WHERE id > :mark AND id <= :upto GROUP BY weight_version
""")
# The newest id of the next batch among rows older than the lag; the batch then takes every
# row up to it, also younger ones (a row is never skipped for being young once passed).
_LAST = "SELECT max(id) FROM (SELECT id FROM {table} WHERE id > :mark AND created_at < " \
        "now() - make_interval(secs => :lag) ORDER BY id LIMIT :batch) b"
LAST_TURN = text(_LAST.format(table="turns"))
LAST_JUDGMENT = text(_LAST.format(table="judgments"))

# Each new judgment adds its turn's reward; the judgment it replaces (the turn's previous
# one) is taken back out. Judgments of side turns are not counted, as in the view.
NEW_JUDGMENTS = text("""
    WITH nj AS (
        SELECT id, turn_id, reward, hint FROM judgments
        WHERE id > :mark AND id <= :upto
    ), d AS (
        SELECT turn_id, 1 AS sign, reward, hint IS NOT NULL AS hinted FROM nj
        UNION ALL
        SELECT nj.turn_id, -1, p.reward, p.hint IS NOT NULL FROM nj
        JOIN LATERAL (SELECT reward, hint FROM judgments p
                      WHERE p.turn_id = nj.turn_id AND p.id < nj.id
                      ORDER BY p.id DESC LIMIT 1) p ON true
    )
    SELECT t.weight_version,
           sum(d.sign) AS judged,
           sum(d.sign) FILTER (WHERE d.reward = 1) AS positive,
           sum(d.sign) FILTER (WHERE d.reward = 0) AS neutral,
           sum(d.sign) FILTER (WHERE d.reward = -1) AS negative,
           sum(d.sign) FILTER (WHERE d.reward IS NULL) AS abstained,
           sum(d.sign) FILTER (WHERE d.hinted) AS hints
    FROM d JOIN turns t ON t.id = d.turn_id AND t.kind = 'main'
    GROUP BY t.weight_version
""")


@dataclass
class VersionCounts:
    turns: int = 0
    judged: int = 0
    positive: int = 0
    neutral: int = 0
    negative: int = 0
    abstained: int = 0
    hints: int = 0

    @property
    def scored(self) -> int:
        return self.positive + self.neutral + self.negative

    @property
    def mean(self) -> float | None:
        return (self.positive - self.negative) / self.scored if self.scored else None

    @property
    def std(self) -> float | None:
        """Spread of the rewards (population sd; rewards are -1, 0 or +1)."""
        mean = self.mean
        if mean is None:
            return None
        mean_sq = (self.positive + self.negative) / self.scored
        return math.sqrt(max(0.0, mean_sq - mean * mean))


def version_key(version: str | None) -> tuple[int, int, str]:
    """Sort versions numerically when they are numbers ('2' < '10'); unknown (None) first."""
    if version is None:
        return (0, 0, "")
    return (1, int(version), "") if version.isdigit() else (2, 0, version)


@dataclass
class RewardTally:
    db: AsyncEngine
    counts: dict[str | None, VersionCounts] = field(default_factory=dict)
    total_turns: int = 0  # every kind (side turns too)
    turn_mark: int = 0
    judgment_mark: int = 0
    built_at: float = 0.0
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    _rebuild: asyncio.Task[None] | None = None

    async def reset(self) -> None:
        """Forget everything: the next refresh reads the whole log again."""
        async with self._lock:
            self.counts, self.turn_mark, self.judgment_mark, self.built_at = {}, 0, 0, 0.0
            self.total_turns = 0

    async def refresh(self) -> None:
        """Catch up with the log; the first call reads all of it (seconds per million turns).
        Every REBUILD_S a fresh tally is built in the background and swapped in."""
        if self.built_at and time.monotonic() - self.built_at > REBUILD_S \
                and self._rebuild is None:
            self._rebuild = asyncio.create_task(self._rebuild_now())
        async with self._lock:
            await self._catch_up()
            if not self.built_at:
                self.built_at = time.monotonic()

    async def _rebuild_now(self) -> None:
        try:
            fresh = RewardTally(self.db)
            await fresh.refresh()
            async with self._lock:
                await fresh._catch_up()
                self.counts, self.total_turns = fresh.counts, fresh.total_turns
                self.turn_mark, self.judgment_mark = fresh.turn_mark, fresh.judgment_mark
                self.built_at = time.monotonic()
        finally:
            self._rebuild = None

    async def _catch_up(self) -> None:
        params = {"lag": LAG_S, "batch": BATCH}
        async with self.db.connect() as conn:
            while (last := (await conn.execute(LAST_TURN, {
                    **params, "mark": self.turn_mark})).scalar()) is not None:
                for version, turns, every in (await conn.execute(NEW_TURNS, {
                        "mark": self.turn_mark, "upto": last})).all():
                    self._at(version).turns += turns
                    self.total_turns += every
                self.turn_mark = last
            while (last := (await conn.execute(LAST_JUDGMENT, {
                    **params, "mark": self.judgment_mark})).scalar()) is not None:
                for r in (await conn.execute(NEW_JUDGMENTS, {
                        "mark": self.judgment_mark, "upto": last})).all():
                    c = self._at(r.weight_version)
                    c.judged += r.judged or 0
                    c.positive += r.positive or 0
                    c.neutral += r.neutral or 0
                    c.negative += r.negative or 0
                    c.abstained += r.abstained or 0
                    c.hints += r.hints or 0
                self.judgment_mark = last

    def _at(self, version: str | None) -> VersionCounts:
        return self.counts.setdefault(version, VersionCounts())

    def rows(self) -> list[dict[str, Any]]:
        """One dict per version, in version order, for pages and the live chart."""
        out = []
        for version in sorted(self.counts, key=version_key):
            c = self.counts[version]
            if c.turns == 0 and c.judged == 0:
                continue
            out.append({"version": version, "turns": c.turns, "judged": c.judged,
                        "mean": c.mean, "std": c.std, "positive": c.positive,
                        "neutral": c.neutral, "negative": c.negative,
                        "abstained": c.abstained, "hints": c.hints})
        return out
