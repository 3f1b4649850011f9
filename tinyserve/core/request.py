"""Request: one request while the engine holds it - its sequence, its text, its timings.

Keyed by the server's own integer id (also the sequence's id), owned by whoever drives the
EngineCore: the batcher actor when serving, ``LLM.generate`` offline. The timing fields stay at
their defaults offline. What its reader has been sent, and what waits to be, is the replies'
(actors/replies.py), not the request's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tinyserve.core.sequence import Sequence
from tinyserve.text.detokenizer import IncrementalDetokenizer


@dataclass(slots=True, eq=False)
class Request:
    seq: Sequence
    detok: IncrementalDetokenizer
    arrival_time: float = 0.0  # time.monotonic() when the API accepted it
    internal: bool = False  # the server's own warm-up: kept out of request metrics
    n: int = 1  # the API request's n on its first choice, 0 on the others (for metrics)
    first_scheduled: float | None = None
    token_times: list[float] = field(default_factory=list)

    @property
    def request_id(self) -> int:
        return self.seq.seq_id
