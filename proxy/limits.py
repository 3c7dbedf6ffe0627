"""Fair share between API keys: requests in flight and tokens per minute, per key.

Requests per minute (proxy/auth.py, `RateLimiter`) bound how often a key may start a
request, not how much of the engine it holds: one key sending slow requests could fill every
engine slot. Two more per-key limits bound that, checked after the request is parsed and
before the engine is called (`KeyLimits.admit`):

- requests in flight (`max_concurrent`): a key at its limit is answered 429 at once, so
  it never queues in front of other keys' requests at the engine;
- tokens per minute (`rate_limit_tpm`, prompt + completion tokens): a token bucket holding
  one minute's worth. A request is admitted on an estimate (its prompt text's bytes / 4,
  plus `max_tokens` or 256 for the reply); a prompt large enough to be counted
  (proxy/prompt_size.py) is admitted on its counted tokens instead, one refused as too
  long pays for what was counted (`KeyLimits.charge`), and the bucket is corrected when the
  reply ends by what the engine reports it used (`Lease.release`), so a key that asked for
  4,096 tokens and got 20 pays for 20, and one that underestimated pays the rest later.

A key's own value overrides the proxy's default (`ProxySettings`); 0 means unlimited. The
default in flight, unless set, is a quarter of what the engine runs at once when it says
(`fair_concurrency`): one key can hold a quarter of the batch, never all of it, so another
key's request starts at once rather than queueing behind it. Like requests per minute, the
limits hold per proxy process.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from clawrl.base.errors import RateLimited

# Completion tokens assumed for admission when the request sets no `max_tokens`.
DEFAULT_COMPLETION_ESTIMATE = 256
_BYTES_PER_TOKEN = 4
# The default in flight per key when the engine does not say how many it runs at once: a
# quarter of the embedded engine's batch of 32.
FALLBACK_CONCURRENT = 8


def fair_concurrency(engine_slots: int | None) -> int:
    """A key's default requests in flight: a quarter of the engine's running requests
    (at least 1), or FALLBACK_CONCURRENT when that is unknown."""
    return max(1, engine_slots // 4) if engine_slots else FALLBACK_CONCURRENT


class Limited(Protocol):
    key_id: int
    max_concurrent: int | None
    rate_limit_tpm: int | None


def estimate_tokens(body_bytes: int, requested: int | None) -> int:
    """Tokens a request is admitted for: its prompt by size, its reply by `max_tokens`."""
    return body_bytes // _BYTES_PER_TOKEN + (requested or DEFAULT_COMPLETION_ESTIMATE)


def used_tokens(prompt_ids: list[int] | None, response_ids: list[int] | None,
                usage: dict[str, object] | None) -> int | None:
    """Prompt + completion tokens as the engine reports them (token ids, else `usage`);
    None when it reported neither."""
    if prompt_ids is not None or response_ids is not None:
        return len(prompt_ids or ()) + len(response_ids or ())
    counts = [usage.get(k) for k in ("prompt_tokens", "completion_tokens")] if usage else []
    numbers = [c for c in counts if isinstance(c, int)]
    return sum(numbers) if numbers else None


@dataclass
class Lease:
    """One admitted request: holds its in-flight slot and its token estimate until
    `release` (idempotent)."""

    limits: KeyLimits
    key_id: int
    estimate: int
    tpm: int
    released: bool = field(default=False)

    def release(self, used: int | None = None) -> None:
        """End the request; `used` (tokens the engine reported) corrects the estimate."""
        if self.released:
            return
        self.released = True
        self.limits.end(self, used)


class KeyLimits:
    def __init__(self, default_concurrent: int | None, default_tpm: int, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        # None: `fair_concurrency` of what `engine_slots()` says (the app sets it to the
        # engine's reported running requests).
        self.default_concurrent = default_concurrent
        self.default_tpm = default_tpm
        self.engine_slots: Callable[[], int | None] = lambda: None
        self._clock = clock
        self._in_flight: dict[int, int] = {}
        self._buckets: dict[int, tuple[float, float]] = {}  # key_id -> (tokens, at)

    def concurrency_for(self, principal: Limited) -> int:
        own = principal.max_concurrent
        if own is not None:
            return own
        if self.default_concurrent is not None:
            return self.default_concurrent
        return fair_concurrency(self.engine_slots())

    def tpm_for(self, principal: Limited) -> int:
        own = principal.rate_limit_tpm
        return self.default_tpm if own is None else own

    def in_flight(self, key_id: int) -> int:
        return self._in_flight.get(key_id, 0)

    def check_room(self, principal: Limited) -> None:
        """RateLimited (429) when the key has no in-flight slot free (takes nothing)."""
        limit = self.concurrency_for(principal)
        if limit > 0 and self._in_flight.get(principal.key_id, 0) >= limit:
            raise RateLimited(f"Too many requests in flight for this API key: the limit is "
                              f"{limit} at a time. Retry when one has finished.",
                              retry_after_s=1)

    def charge(self, principal: Limited, tokens: int) -> None:
        """Take `tokens` from the key's minute without a request (work done for a request
        that was then refused)."""
        tpm = self.tpm_for(principal)
        if tpm > 0:
            self._buckets[principal.key_id] = (self._refill(principal.key_id, tpm) - tokens,
                                               self._clock())

    def admit(self, principal: Limited, estimate: int) -> Lease:
        """Take an in-flight slot and `estimate` tokens for the key, or raise RateLimited
        (429 with Retry-After) and take nothing."""
        key = principal.key_id
        self.check_room(principal)
        tpm = self.tpm_for(principal)
        if tpm > 0:
            tokens = self._refill(key, tpm)
            # An estimate above the whole allowance waits for a full bucket, not forever.
            need = min(estimate, tpm)
            if tokens < need:
                retry_after = math.ceil((need - tokens) / (tpm / 60.0))
                raise RateLimited(f"Token rate limit reached for this API key: {tpm} tokens "
                                  f"per minute (prompt + completion). Retry after "
                                  f"{retry_after} s.", retry_after_s=retry_after)
            self._buckets[key] = (tokens - estimate, self._clock())
        self._in_flight[key] = self._in_flight.get(key, 0) + 1
        return Lease(self, key, estimate, tpm)

    def end(self, lease: Lease, used: int | None) -> None:
        left = self._in_flight.get(lease.key_id, 0) - 1
        if left > 0:
            self._in_flight[lease.key_id] = left
        else:
            self._in_flight.pop(lease.key_id, None)
        if lease.tpm > 0 and used is not None and lease.key_id in self._buckets:
            tokens = self._refill(lease.key_id, lease.tpm)
            self._buckets[lease.key_id] = (min(float(lease.tpm), tokens + lease.estimate - used),
                                           self._clock())

    def _refill(self, key: int, tpm: int) -> float:
        now = self._clock()
        tokens, at = self._buckets.get(key, (float(tpm), now))
        return min(float(tpm), tokens + (now - at) * tpm / 60.0)
