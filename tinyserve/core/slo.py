"""SLO controller: keeps windowed P95 TTFT and ITL under their targets by moving one limit.

``limit`` is how many requests the server holds at once (running + waiting; admission's
capacity, and the scheduler's max_num_seqs when smaller); the step's token budget (the prefill
share of a step) shrinks in proportion, so fewer prompt tokens ride along with each decode.
Each closed window (``window_s``) with samples is judged against the targets:

    violated (a P95 over its target)        limit x 0.7, at least 1       (multiplicative decrease)
    comfortable (every P95 < 0.8 x target)  limit + limit / 8, at least 1 (gentle increase)
    in between                              unchanged                      (hysteresis)

The window after a decrease is not judged: its first tokens mostly belong to requests admitted
under the old limit, and judging them would cut again for the same excess (measured: without
this pause the limit overshot far below what the server can serve in time).

A limit that cannot go lower, or 3 overloaded windows in a row, escalate the degradation
level; 3 comfortable windows at the full limit, with nobody turned away, de-escalate it. A
window is overloaded when it violates a target, or when admission turned requests away for
capacity during it (``pressure``: its running count of such refusals) while the limit was
cut below its maximum - the server then meets its targets only by refusing work, which is
what the ladder exists to make selective. Refusals at the full limit are ordinary
back-pressure and change nothing.
Levels (what admission does):

    0 normal
    1 shed the lowest priority: its new requests get 503 + Retry-After
    2 also send degradable tenants to the model's fallback (--fallback) and cap their
      max_tokens
    3 admit only the highest priority

Pure Python with an injectable clock, so it is tested without a server.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

DECREASE = 0.7
COMFORT = 0.8  # a P95 under this share of its target counts as comfortable
STREAK = 3  # windows in a row before the level moves
MAX_LEVEL = 3
LEVEL_NAMES = ("normal", "shedding the lowest priority",
               "shedding the lowest priority, degradable tenants to the fallback and capped",
               "only the highest priority admitted")


@dataclass(frozen=True, slots=True)
class WindowStats:
    end: float
    ttft_p95: float | None
    itl_p95: float | None
    limit: int
    level: int
    violated: bool


def p95(values: list[float]) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(0.95 * len(values)))]


class SloController:
    def __init__(self, ttft_s: float | None, itl_s: float | None, max_limit: int,
                 window_s: float = 1.0, clock: Callable[[], float] = time.monotonic,
                 pressure: Callable[[], int] = lambda: 0) -> None:
        self.ttft_s, self.itl_s = ttft_s, itl_s
        self.pressure = pressure  # wired by the server to admission's count
        self._refused = 0  # pressure() when the last window closed
        self.max_limit = max_limit
        self.window_s = window_s
        self.clock = clock
        self.limit = max_limit
        self.level = 0
        self.reason = ""
        self._ttft: list[float] = []
        self._itl: list[float] = []
        self._window_end = clock() + window_s
        self._bad = self._good = 0
        self._pause = False  # skip judging the window after a decrease

    @property
    def enabled(self) -> bool:
        return self.ttft_s is not None or self.itl_s is not None

    def observe(self, ttft: float | None = None, itls: tuple[float, ...] = ()) -> None:
        if not self.enabled:  # (no window ever closes to take them: they would pile up)
            return
        if ttft is not None:
            self._ttft.append(ttft)
        self._itl.extend(itls)

    def met(self, ttft: float | None, itls: tuple[float, ...]) -> bool:
        """Did one request meet the targets (its TTFT, and the mean of its ITLs)?"""
        if self.ttft_s is not None and (ttft is None or ttft > self.ttft_s):
            return False
        return self.itl_s is None or not itls or sum(itls) / len(itls) <= self.itl_s

    def tick(self, idle: bool = False) -> WindowStats | None:
        """Close the window if it is over; returns its stats (None while it is open).

        ``idle``: the model holds no request. A window with no samples is then calm (nothing
        waits, nobody was turned away), so a model whose traffic went elsewhere - to its
        fallback, or shed - still steps back down its ladder and gets the traffic back."""
        now = self.clock()
        if now < self._window_end or not self.enabled:
            return None
        self._window_end = now + self.window_s
        ttft, itl = p95(self._ttft), p95(self._itl)
        self._ttft, self._itl = [], []
        refused, self._refused = self._refused, self.pressure()
        # Refusals at the full limit are plain back-pressure (the server is as busy as it was
        # configured to be, and on target); under a cut limit they mean it keeps its targets
        # only by turning work away.
        refusing = self._refused > refused and self.limit < self.max_limit
        if ttft is None and itl is None and not refusing and not idle:
            return None  # busy, but nothing finished a first token: no evidence either way
        if self._pause:
            self._pause = False
            return None
        over = [(v, t) for v, t in ((ttft, self.ttft_s), (itl, self.itl_s))
                if v is not None and t is not None]
        violated = any(v > t for v, t in over)
        if violated:
            self._good = 0
            self._bad += 1
            floor_hit = self.limit == 1
            self.limit = max(1, int(self.limit * DECREASE))
            self._pause = True
            if floor_hit or self._bad >= STREAK:
                self._set_level(self.level + 1, "P95 over target")
                self._bad = 0
        else:
            # (no samples: calm only if the model is idle - a busy window proves nothing)
            comfortable = all(v < COMFORT * t for v, t in over) if over else idle
            if comfortable:
                self.limit = min(self.max_limit, self.limit + max(1, self.limit // 8))
            if refusing:
                self._good = 0
                self._bad += 1
                if self._bad >= STREAK:
                    self._set_level(self.level + 1, "turning requests away for capacity")
                    self._bad = 0
            elif comfortable:
                self._bad = 0
                self._good += 1
                if self._good >= STREAK and self.limit == self.max_limit and self.level:
                    self._set_level(self.level - 1, "P95 back under target")
                    self._good = 0
        return WindowStats(now, ttft, itl, self.limit, self.level, violated)

    def scheduler_limits(self, max_num_seqs: int, max_num_batched_tokens: int) -> tuple[int, int]:
        """(max running sequences, tokens per step) under the current limit. The budget keeps
        room for every running decode plus some prefill, so nothing starves."""
        running = min(max_num_seqs, self.limit)
        share = self.limit / self.max_limit
        return running, max(2 * running, int(max_num_batched_tokens * share))

    def _set_level(self, level: int, why: str) -> None:
        level = max(0, min(MAX_LEVEL, level))
        if level != self.level:
            self.level = level
            self.reason = f"{LEVEL_NAMES[level]} ({why})" if level else ""
