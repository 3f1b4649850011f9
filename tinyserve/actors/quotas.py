"""Per-tenant quotas, owned by the admission actor: concurrency limits and token buckets.

A request costs its prompt tokens plus its ``max_tokens`` when admitted (what it may use);
what it did not generate is refunded when its handler ends, so a tenant that asks for much
and uses little is not throttled for it. A bucket holds one minute of tokens and refills
continuously; a request that does not fit waits ``Retry-After`` seconds, the time the bucket
needs to hold its cost.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from tinyserve.config import TenantConfig
from tinyserve.messages import Failed


@dataclass(slots=True)
class TokenBucket:
    per_minute: int
    level: float = field(init=False)
    _stamp: float = field(init=False)
    clock: Callable[[], float] = time.monotonic

    def __post_init__(self) -> None:
        self.level = float(self.per_minute)
        self._stamp = self.clock()

    def _refill(self) -> None:
        now = self.clock()
        self.level = min(float(self.per_minute),
                         self.level + (now - self._stamp) * self.per_minute / 60.0)
        self._stamp = now

    def wait_for(self, cost: int) -> float:
        """Seconds until ``cost`` tokens are there (0: now); inf if it never fits."""
        if cost > self.per_minute:
            return math.inf
        self._refill()
        return max(0.0, (cost - self.level) * 60.0 / self.per_minute)

    def take(self, cost: int) -> None:
        self._refill()
        self.level -= cost

    def give_back(self, tokens: int) -> None:
        self._refill()
        self.level = min(float(self.per_minute), self.level + tokens)


@dataclass(slots=True)
class _TenantState:
    cfg: TenantConfig
    bucket: TokenBucket | None
    in_flight: int = 0  # admitted, handler not yet ended


class TenantQuotas:
    def __init__(self, tenants: tuple[TenantConfig, ...],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._state = {t.name: _TenantState(t, TokenBucket(t.tokens_per_minute, clock=clock)
                                            if t.tokens_per_minute else None)
                       for t in tenants}

    def refuse(self, tenant: str, cost: int) -> tuple[str, Failed] | None:
        """(reason, the 429) if the tenant may not have ``cost`` more tokens now, else None."""
        st = self._state[tenant]
        limit = st.cfg.max_concurrent
        if limit is not None and st.in_flight >= limit:
            return "concurrency", Failed(
                429, f"tenant {tenant!r} already has {limit} requests in flight, its limit",
                retry_after=1.0)
        if st.bucket is not None:
            wait = st.bucket.wait_for(cost)
            if wait == math.inf:
                return "tokens", Failed(
                    400, f"this request may use {cost} tokens (prompt + max_tokens), more than "
                    f"tenant {tenant!r} gets per minute ({st.bucket.per_minute})",
                    param="max_tokens")
            if wait > 0:
                return "tokens", Failed(
                    429, f"tenant {tenant!r} is over its {st.bucket.per_minute} tokens per "
                    "minute", retry_after=wait)
        return None

    def admit(self, tenant: str, cost: int) -> None:
        st = self._state[tenant]
        st.in_flight += 1
        if st.bucket is not None:
            st.bucket.take(cost)

    def release(self, tenant: str, unused_tokens: int) -> None:
        st = self._state[tenant]
        st.in_flight -= 1
        if st.bucket is not None and unused_tokens > 0:
            st.bucket.give_back(unused_tokens)

    def in_flight(self, tenant: str) -> int:
        return self._state[tenant].in_flight
