"""Every message that crosses an actor queue, in one file: this is the wiring diagram.

    api/ ---Ask--> Admission --Submit--> Batcher --StepPlan--> Executor
       ^  |                 |                   ^  |                   |
       |  +----Abort--------|------------------>|  +---StepResult------+
       +--Accepted/Failed---+ (the Ask's answer)|
       +--------Output/Failed (per request)-----+
    Batcher, Admission, api/ --StepStats/RequestFinished/Rerouted/...--> Metrics

With several models each has its own batcher (and engine core); admission picks the batcher
(a fallback's, when the model is degraded or down), and the one executor runs the batchers'
steps in turn: its inbox takes (model name, StepPlan).
    Supervisor: watches every actor task and the step in flight (no messages: it reads
    snapshots and, on a fatal fault, fails every pending request through the API)

Messages are small frozen msgspec Structs; token ids are tuples; no tensors cross a queue. A
Submit carries its request's handle (its own output queue and the slot it holds), as actors
carry a reply-to address. Request ids are the server's own integers: nothing a client sends
ever keys server state.
"""

from __future__ import annotations

from typing import Any

import msgspec

from tinyserve.sampling_params import (  # noqa: F401  (what requests carry)
    FULL_VOCAB,
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_PROMPT_LOGPROB_ENTRIES,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    FieldError,
    GrammarSpec,
    SamplingParams,
)

# -- Batcher <-> Executor ---------------------------------------------------------------------


PLACEHOLDER = -1  # a token sampled by the model's previous step, not known when planned
DRAFT = -2  # a draft token the runner's draft model proposes (speculation, draft_model)


class ScheduledSeq(msgspec.Struct, frozen=True):
    """One sequence's share of a step: compute ``token_ids`` at positions start_pos.. .
    A PLACEHOLDER token (only ever the last) is the token this sequence's previous step
    samples; the executor fills it in before the step runs."""

    seq_id: int
    token_ids: tuple[int, ...]  # the tokens whose K/V this step computes
    start_pos: int  # tokens already in the KV cache (cached prefix + earlier chunks)
    # The sequence's KV block ids from index ``first_block`` on: only those the runner's
    # persistent block table lacks (first_block 0: the whole table, the row starts afresh).
    # With the blocks sent before, they cover start_pos + len(token_ids).
    new_blocks: tuple[int, ...]
    sample: bool  # the chunk reaches the end of the sequence: draw its next token
    params: SamplingParams
    seed: int  # this draw's seed (mix_seed(request seed, tokens drawn so far))
    epoch: int = 0  # the sequence's preemption count when planned: older results are stale
    first_block: int = 0
    # Only for sequences whose logits are processed (params.penalized) when sampling: their
    # output so far (a trailing PLACEHOLDER: the token the step before samples), their prompt
    # (with a repetition penalty) and the ids banned for this draw (min_tokens). Snapshots:
    # the scheduler's lists keep growing while the step runs.
    output_ids: tuple[int, ...] | None = None
    prompt_ids: tuple[int, ...] | None = None
    banned: tuple[int, ...] = ()
    # prompt_logprobs: the prompt tokens that follow this chunk's first positions (one per
    # position, while the next token is still the prompt's): their logprobs are wanted.
    prompt_targets: tuple[int, ...] = ()
    lora_slot: int = -1  # the device slot of its LoRA adapter (-1: the base model)
    # Speculation (core/speculation.py): token_ids are the last token and num_drafts proposed
    # tokens, and a token is drawn at every position: row 0 with ``seed`` and ``banned``,
    # row i with spec_seeds[i - 1] and spec_banned[i - 1] (the history through draft i)
    num_drafts: int = 0
    spec_seeds: tuple[int, ...] = ()
    spec_banned: tuple[tuple[int, ...], ...] = ()
    spec_row: int = 0  # the runner's rows of one verify (0: the sequence's own entry)
    # draft_model: the drafts are DRAFT until the runner's draft model proposes them; its
    # cache is valid below draft_from, and draft_prefix are the tokens from there to the last
    draft_from: int = 0
    draft_prefix: tuple[int, ...] = ()


class LoraLoad(msgspec.Struct, frozen=True):
    """Copy an adapter into a device slot before the step runs (core/lora_slots.py)."""

    slot: int
    adapter_id: int
    path: str  # its PEFT directory (the runner keeps recent ones in host memory)
    scale: float  # alpha / r (rsLoRA: alpha / sqrt(r))


class StepPlan(msgspec.Struct, frozen=True, tag=True):
    step_id: int
    seqs: tuple[ScheduledSeq, ...]
    # Sequences released since the last plan (finished, aborted, preempted): the runner drops
    # their block-table rows before it reads this plan's entries.
    freed: tuple[int, ...] = ()
    lora_loads: tuple[LoraLoad, ...] = ()  # adapters into slots, before this step runs

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)


class SeqOutput(msgspec.Struct, frozen=True):
    seq_id: int
    token_id: int
    logprob: float
    top_logprobs: tuple[tuple[int, float], ...] | None = None
    # The sequence cannot go on within what its request allows (its grammar failed, or the
    # grammar, logit_bias bans and min_tokens leave no token): it ends with this error, and
    # token_id means nothing. error_reason: ConstraintFailed.reason.
    error: str | None = None
    error_reason: str = "grammar"
    # A verify step's further tokens (the accepted drafts' draws, then the correction or the
    # bonus): (token, logprob, top logprobs) each, after token_id
    more: tuple[tuple[int, float, tuple[tuple[int, float], ...] | None], ...] = ()


class PromptLogprobs(msgspec.Struct, frozen=True):
    """A chunk's prompt logprobs: entry i is for the prompt token at start_pos + i + 1."""

    seq_id: int
    start_pos: int
    entries: tuple[tuple[float, int, tuple[tuple[int, float], ...]], ...]  # (lp, rank, top N)


class SeqFault(msgspec.Struct, frozen=True):
    """A sequence the runner could not run, or whose draw it cannot trust, while the rest of
    the step went on: it ends with this error and nothing of it this step counts (its KV
    for the step is not committed to the prefix cache). ``reason``: RequestFault.reason."""

    seq_id: int
    reason: str
    message: str


class PlanAhead(msgspec.Struct, frozen=True, tag=True):
    """Batcher to itself (a timer): time to plan the step behind the one running."""


class StepResult(msgspec.Struct, frozen=True, tag=True):
    step_id: int
    outputs: tuple[SeqOutput, ...]
    error: str | None = None  # the step failed; no sequence advanced
    seconds: float = 0.0  # wall time of the forward pass + sampling
    prompt_logprobs: tuple[PromptLogprobs, ...] = ()
    faults: tuple[SeqFault, ...] = ()  # sequences that ended by a fault of their own
    # tokens routed to each expert so far, per sparse layer: ((layer, (count per expert)), ...);
    # about once a second on a mixture-of-experts model, else None (engine/model/moe.py)
    expert_load: tuple[tuple[int, tuple[int, ...]], ...] | None = None


# -- api -> Admission -> Batcher -------------------------------------------------------------


class Submit(msgspec.Struct, frozen=True, tag=True, kw_only=True):
    """One choice of an API request, to run: built by the API, decided by admission (inside
    an Ask), run by the batcher."""

    request_id: int  # the server's own id (never the client's X-Request-Id)
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    arrival_time: float  # time.monotonic() when the API accepted it
    # actors.lanes.RequestHandle: the request's reply queue and the slot admission gives it
    handle: Any
    cache_salt: bytes = b""  # the tenant's cache group: prefix-cache sharing scope
    tenant: str = "default"
    priority: int = 0  # the tenant's
    model: str = ""  # the served model it was routed to ("": the only one)
    internal: bool = False  # the server's own warm-up: kept out of request metrics and quotas
    # The API request's ``n`` on its first choice, 0 on the others (metrics count it once).
    n: int = 1
    # n > 1: the first choice's id, on the others: they start once it has its first token
    after: int | None = None
    adapter: Any = None  # core.adapters.AdapterSpec: the LoRA adapter it runs with (None: base)

    @property
    def reply_to(self) -> Any:
        """The request's reply queue (Output | Failed), owned by the request."""
        return self.handle.replies


class Ask(msgspec.Struct, frozen=True, tag=True):
    """api -> Admission: one API request's choices, decided together. ``answer`` (an
    asyncio Future, the Ask's reply-to) gets Accepted (every choice admitted and sent on to its
    batcher) or the Failed that refused them all."""

    submits: tuple[Submit, ...]
    answer: Any


class Abort(msgspec.Struct, frozen=True, tag=True):
    """The client is gone. Sent only by the request's handle once admission has taken it
    (admission queues the Submit first, so an Abort can never overtake its Submit); the
    batcher tells the handle it has it (``abort_taken``)."""

    request_id: int
    handle: Any = None


class AbortAll(msgspec.Struct, frozen=True, tag=True):
    """End of a timed-out drain: end every request in the batcher with this error."""

    status: int
    message: str


# -- admission's answer, and replies on a request's own queue ----------------------------------


class Accepted(msgspec.Struct, frozen=True, tag=True):
    model: str = ""  # the model that will answer (a fallback, if admission rerouted it)


class Failed(msgspec.Struct, frozen=True, tag=True):
    """The request ends with this HTTP error: rejected by admission (429, 503), refused by the
    engine (400), or cut short after it was accepted (500 failed step, 503 drain / fault)."""

    status: int
    message: str
    retry_after: float | None = None
    param: str | None = None  # the request field at fault, for a 400


class TokenInfo(msgspec.Struct, frozen=True):
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]


class Output(msgspec.Struct, frozen=True, tag=True):
    """New text of one request since its last Output; the last one has a finish_reason."""

    text: str
    tokens: tuple[TokenInfo, ...]  # logprobs of the new tokens (empty unless requested)
    num_new_tokens: int
    finish_reason: str | None = None  # "stop" | "length" | "abort" (the client left)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    # On the first Output of a request that asked for them: one entry per prompt token, the
    # first None (nothing precedes it); TokenInfo.top holds the top N, rank in prompt_ranks.
    prompt_logprobs: tuple[TokenInfo | None, ...] | None = None
    prompt_ranks: tuple[int, ...] = ()
    # On the last Output, when finish_reason is "stop": the stop string that matched, or the
    # stop_token_ids entry that ended it (vLLM's stop_reason); None for EOS
    stop_reason: str | int | None = None
    # The ids of the new tokens (a stop token included), when params.return_token_ids
    token_ids: tuple[int, ...] = ()


# -- -> Metrics -------------------------------------------------------------------------------


class StepStats(msgspec.Struct, frozen=True, tag=True):
    """Scheduler and cache state after a step; counters are cumulative totals."""

    # vLLM's iteration tokens: the whole prompt of each request that got its first token in
    # the step, plus the tokens the step generated (0: nothing generated, or a state update)
    num_tokens: int
    num_running: int
    num_waiting: int
    kv_usage: float
    preemptions: int
    prompt_tokens_computed: int
    prefix_queries: int
    prefix_hits: int
    slo_limit: int = 0  # requests the SLO controller lets the server hold (0: no control)
    degradation_level: int = 0
    model: str = ""
    # LoRA (only where the model serves adapters): vLLM's lora_requests_info, and the loads
    lora: tuple[tuple[str, ...], tuple[str, ...], int, int] | None = None  # running, waiting, max, loads
    # Speculation totals (None: not configured): verify steps, draft tokens, accepted ones,
    # and accepted by draft position
    spec: tuple[int, int, int, tuple[int, ...]] | None = None
    # StepResult.expert_load, passed on when a step carried it
    expert_load: tuple[tuple[int, tuple[int, ...]], ...] | None = None


class RequestFinished(msgspec.Struct, frozen=True, tag=True):
    finish_reason: str
    tenant: str
    model: str
    within_slo: bool | None  # None: no SLO set
    prompt_tokens: int
    generation_tokens: int
    queue_seconds: float | None
    ttft_seconds: float | None
    e2e_seconds: float
    itl_seconds: tuple[float, ...]
    max_tokens: int = 0  # the request's max_tokens (after defaults)
    n: int = 1  # the API request's n on its first choice, 0 on the others
    adapter: str = ""  # its LoRA adapter's name ("": the base model)


class AdmissionRejected(msgspec.Struct, frozen=True, tag=True):
    tenant: str
    reason: str  # "concurrency" | "tokens" | "capacity" | "degraded" | "unavailable"
    model: str = ""  # the model it was routed to


class Rerouted(msgspec.Struct, frozen=True, tag=True):
    """A degradable request for ``model`` is served by ``fallback`` instead."""

    model: str
    fallback: str
    tenant: str
    reason: str  # "degraded" (the model's SLO ladder at level 2+) | "down" (its steps fail)


class ApiAnswered(msgspec.Struct, frozen=True, tag=True):
    """An API request answered (any status), by route: the per-endpoint request count."""

    endpoint: str  # the route's path template, e.g. /v1/responses/{response_id}
    code: str  # HTTP status, as text (499: the client left first)


class RequestFailed(msgspec.Struct, frozen=True, tag=True):
    code: str  # HTTP status, as text


class ConstraintFailed(msgspec.Struct, frozen=True, tag=True):
    """A request ended mid-generation because its constraints could not go on."""

    model: str
    # "grammar" (the request's grammar failed: a matcher limit) | "dead_end" (it allows no
    # token) | "nothing_allowed" (grammar + bans + min_tokens leave none) | "grammar_crash"
    # (the matcher raised: a 500)
    reason: str


class StepFailed(msgspec.Struct, frozen=True, tag=True):
    """A step raised with no request to blame: every request in it ended with a 500."""

    model: str


class RequestFault(msgspec.Struct, frozen=True, tag=True):
    """A request ended by a fault of its own while its neighbours in the step went on."""

    model: str
    # "adapter" (its LoRA adapter could not be read into its slot) | "non_finite" (its logits
    # were NaN or infinite) | "invalid" (its inputs or parameters could not run: found when
    # the step raised, and the step ran again without it)
    reason: str
