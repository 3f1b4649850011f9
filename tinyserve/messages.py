"""Every message that crosses an actor queue, in one file: this is the wiring diagram.

    Ingress --Submit--> Admission --Submit--> Batcher --StepPlan--> Executor
       ^                    |                   ^  |                   |
       |                    |                   |  +---StepResult------+
       +--Accepted/Rejected-+                   |
       +--------------Output (per request)------+   (Ingress --Abort--> Batcher)
    Batcher, Ingress --StepStats/RequestFinished/RequestFailed--> Metrics

Messages are small frozen msgspec Structs; token ids are tuples; no tensors cross a queue. A
Submit carries its reply-to address (the request's own output queue), as actors do.
"""

from __future__ import annotations

from typing import Any

import msgspec

from tinyserve.engine.sampling import SamplingParams

# -- Batcher <-> Executor ---------------------------------------------------------------------


class ScheduledSeq(msgspec.Struct, frozen=True):
    """One sequence's share of a step: compute ``token_ids`` at positions start_pos.. ."""

    seq_id: int
    token_ids: tuple[int, ...]  # the tokens whose K/V this step computes
    start_pos: int  # tokens already in the KV cache (cached prefix + earlier chunks)
    block_table: tuple[int, ...]  # physical KV blocks, covering start_pos + len(token_ids)
    sample: bool  # the chunk reaches the end of the sequence: draw its next token
    params: SamplingParams
    seed: int  # this draw's seed (mix_seed(request seed, tokens drawn so far))


class StepPlan(msgspec.Struct, frozen=True, tag=True):
    step_id: int
    seqs: tuple[ScheduledSeq, ...]

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)


class SeqOutput(msgspec.Struct, frozen=True):
    seq_id: int
    token_id: int
    logprob: float
    top_logprobs: tuple[tuple[int, float], ...] | None = None


class StepResult(msgspec.Struct, frozen=True, tag=True):
    step_id: int
    outputs: tuple[SeqOutput, ...]
    error: str | None = None  # the step failed; no sequence advanced
    seconds: float = 0.0  # wall time of the forward pass + sampling


# -- Ingress -> Admission -> Batcher ----------------------------------------------------------


class Submit(msgspec.Struct, frozen=True, tag=True):
    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    arrival_time: float  # time.monotonic() at ingress
    reply_to: Any  # asyncio.Queue of Accepted | Rejected | Output, owned by the request
    cache_salt: bytes = b""
    internal: bool = False  # the server's own warm-up: kept out of request metrics


class Abort(msgspec.Struct, frozen=True, tag=True):
    request_id: str


class AbortAll(msgspec.Struct, frozen=True, tag=True):
    """End of a timed-out drain: abort every request still in the batcher."""


# -- replies on a request's own queue ---------------------------------------------------------


class Accepted(msgspec.Struct, frozen=True, tag=True):
    pass


class Rejected(msgspec.Struct, frozen=True, tag=True):
    status: int  # 400 (bad prompt), 429 (queue full), 503 (not ready / draining)
    message: str
    retry_after: float | None = None


class TokenInfo(msgspec.Struct, frozen=True):
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]


class Output(msgspec.Struct, frozen=True, tag=True):
    """New text of one request since its last Output; the last one has a finish_reason."""

    text: str
    tokens: tuple[TokenInfo, ...]  # logprobs of the new tokens (empty unless requested)
    num_new_tokens: int
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0


# -- -> Metrics -------------------------------------------------------------------------------


class StepStats(msgspec.Struct, frozen=True, tag=True):
    """Scheduler and cache state after a step; counters are cumulative totals."""

    num_tokens: int  # tokens computed by the step (0 for a state-only update)
    num_running: int
    num_waiting: int
    kv_usage: float
    preemptions: int
    prompt_tokens_computed: int
    prefix_queries: int
    prefix_hits: int


class RequestFinished(msgspec.Struct, frozen=True, tag=True):
    finish_reason: str
    prompt_tokens: int
    generation_tokens: int
    queue_seconds: float | None
    ttft_seconds: float | None
    e2e_seconds: float
    itl_seconds: tuple[float, ...]


class RequestFailed(msgspec.Struct, frozen=True, tag=True):
    code: str  # HTTP status, as text
