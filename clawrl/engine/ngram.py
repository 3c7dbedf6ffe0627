"""Draft tokens for speculative decoding from what the engine wrote before (SGLang's `NGRAM`
speculative algorithm, in spirit): after the last `n` tokens of a sequence, propose the tokens
that followed the same `n` tokens the last time they were seen, in an earlier output (or its
prompt's tail). A judge writes the same few verdicts and hints over and over, so most of an
answer can be drafted and then checked in one forward pass (clawrl/engine/scheduler.py).

The table is bounded (least recently written first out) and lives as long as the engine.
"""

from __future__ import annotations

from collections import OrderedDict


class NgramDraft:
    def __init__(self, num_draft_tokens: int = 8, max_n: int = 4,
                 capacity: int = 100_000) -> None:
        if num_draft_tokens < 1 or max_n < 1:
            raise ValueError("num_draft_tokens and max_n must be at least 1")
        self.k, self.max_n, self.capacity = num_draft_tokens, max_n, capacity
        self._next: OrderedDict[tuple[int, ...], tuple[int, ...]] = OrderedDict()
        # How drafts fared, for the engine's log and the tests.
        self.proposed = self.accepted = 0

    def learn(self, ids: list[int]) -> None:
        """Remember, for every run of 1..max_n tokens in `ids`, the k tokens after it."""
        for end in range(1, len(ids)):
            follow = tuple(ids[end:end + self.k])
            for n in range(1, min(self.max_n, end) + 1):
                key = tuple(ids[end - n:end])
                self._next[key] = follow
                self._next.move_to_end(key)
        while len(self._next) > self.capacity:
            self._next.popitem(last=False)

    def draft(self, context: list[int], limit: int) -> list[int]:
        """Up to `limit` (and k) tokens likely to follow `context`: the continuation of its
        longest tail seen before; [] when no tail was."""
        for n in range(min(self.max_n, len(context)), 0, -1):
            follow = self._next.get(tuple(context[-n:]))
            if follow:
                return list(follow[:min(limit, self.k)])
        return []
