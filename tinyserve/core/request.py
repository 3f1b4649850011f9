"""Request: everything about one request while the engine holds it, in one object.

Keyed by the server's own integer id (also the sequence's id), owned by whoever drives the
EngineCore: the batcher actor when serving, ``LLM.generate`` offline. The serving fields
(reply queue, timings) stay at their defaults offline.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tinyserve.core.sequence import Sequence
from tinyserve.text.detokenizer import IncrementalDetokenizer


@dataclass(slots=True, eq=False)
class Request:
    seq: Sequence
    detok: IncrementalDetokenizer
    reply_to: Any = None  # serving: the request's own bounded reply queue
    arrival_time: float = 0.0  # time.monotonic() when the API accepted it
    internal: bool = False  # the server's own warm-up: kept out of request metrics
    n: int = 1  # the API request's n on its first choice, 0 on the others (for metrics)
    first_scheduled: float | None = None
    token_times: list[float] = field(default_factory=list)
    sent_tokens: int = 0  # output tokens already handed to the reply queue
    prompt_logprobs_sent: bool = False
    held: list = field(default_factory=list)  # serving: Outputs waiting to go out (replies.py)
    handed: bool = False  # serving: its reader has been handed something (replies.py)

    @property
    def request_id(self) -> int:
        return self.seq.seq_id
