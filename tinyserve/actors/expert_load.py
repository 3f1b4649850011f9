"""The experts' load as an operator sees it: from the cumulative per-expert token counts a
step carries about once a second (StepStats.expert_load, counted on the device by the routing
kernel), each sparse layer's busiest expert over its mean expert in a sliding window."""

from __future__ import annotations

import math
from collections import deque

EXPERT_WINDOW_S = 60.0


class ExpertLoadWindow:
    """Per-layer expert imbalance over a sliding window, from the cumulative per-expert token
    counts a step carries about once a second (StepStats.expert_load)."""

    def __init__(self, window_s: float = EXPERT_WINDOW_S) -> None:
        self.window_s = window_s
        self._snaps: deque[tuple[float, dict[int, tuple[int, ...]]]] = deque()

    def add(self, now: float, load: tuple[tuple[int, tuple[int, ...]], ...]
            ) -> list[tuple[int, float]]:
        """(layer, max / mean tokens per expert) since the oldest snapshot in the window; NaN
        for a layer that routed no token in it (idle: no imbalance to report, and never the
        last busy window's figure kept)."""
        counts = dict(load)
        if self._snaps and any(a < b for layer, c in counts.items()
                               for a, b in zip(c, self._snaps[-1][1].get(layer, c))):
            self._snaps.clear()  # the counters restarted (a reloaded model)
        self._snaps.append((now, counts))
        while len(self._snaps) > 1 and self._snaps[1][0] <= now - self.window_s:
            self._snaps.popleft()
        base = self._snaps[0][1]
        out = []
        for layer, c in counts.items():
            delta = [a - b for a, b in zip(c, base.get(layer, (0,) * len(c)))]
            total = sum(delta)
            out.append((layer, max(delta) * len(delta) / total if total > 0 else math.nan))
        return out
