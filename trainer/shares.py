"""How many samples of each user one version of the shared model takes (docs/trainer.md,
"Fair share"). Pure arithmetic on counts, no torch: `trainer/data.py` draws by it and
`clawrl eval --attack` asks it when a batch is full.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class ShareRule:
    """The fair share's sizes, in samples (`TrainerSettings.share_rule`).

    batch_size: what a user alone may fill. quota: the most of one user's samples in a
    version while another user waits. floor: what one user may always take while others
    wait, however few they have. max_batch: the most samples of a version however many
    users wait."""

    batch_size: int
    quota: int
    floor: int
    max_batch: int


def user_limits(waiting: Mapping[int, int], rule: ShareRule) -> dict[int, int]:
    """Per user with samples waiting (`waiting`: user -> samples ready, > 0), the most of
    theirs this version takes: the whole `batch_size` for a user alone; otherwise up to the
    `quota`, but no more than the most any other waiting user puts in, unless that is below
    the `floor`. So a user who floods takes no larger part of a version than the busiest other
    user (and the floor while the others have few), and never shrinks another's quota."""
    if len(waiting) < 2:
        return {user: rule.batch_size for user in waiting}
    puts = {user: min(n, rule.quota) for user, n in waiting.items()}
    top = sorted(puts.values(), reverse=True)
    limits = {}
    for user, n in puts.items():
        busiest_other = top[1] if n == top[0] else top[0]
        limits[user] = min(rule.quota, max(rule.floor, busiest_other))
    return limits


def full_size(users_waiting: int, rule: ShareRule) -> int:
    """How many samples make a version's batch full: `batch_size` for one user; with n
    users waiting, each one's quota (n · quota), at most `max_batch`. A batch below it is
    partial and waits for more (docs/trainer.md, "Versions at a person's pace")."""
    if users_waiting < 2:
        return rule.batch_size
    return min(rule.max_batch, users_waiting * rule.quota)
