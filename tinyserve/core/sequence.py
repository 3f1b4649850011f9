"""Sequence: the mutable state of one request, owned by the scheduler (the batcher's state).

Counting vocabulary (as in nano-vllm / vLLM):

    token_ids            prompt + generated tokens
    num_computed_tokens  tokens whose K/V are in the cache (cached prefix + computed chunks)
    block_ids            the sequence's KV blocks, in order; cover num_computed_tokens

    |<------------------- num_tokens ------------------->|
    |<--- num_computed_tokens --->|<- still to compute ->|
    |<-- prefix hit -->|

Planning a step while the previous one runs adds two counts: ``num_inflight`` tokens are
being computed by steps not yet applied, and ``num_pending`` tokens will be sampled by them.
The next step starts at num_computed_tokens + num_inflight and may read a pending token (a
placeholder the executor fills in from the previous step's output).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from tinyserve.core.adapters import AdapterSpec
from tinyserve.core.block_pool import block_hash
from tinyserve.core.spec_state import Acceptance, NgramIndex
from tinyserve.messages import SamplingParams, TokenInfo


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    seq_id: int
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    seed: int
    cache_salt: bytes = b""
    priority: int = 0  # the tenant's: higher is scheduled first and preempted last
    tenant: str = ""  # whose: fair shares within a priority are kept per tenant
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache at first admission
    block_ids: list[int] = field(default_factory=list)
    num_committed_blocks: int = 0  # leading blocks already registered in the prefix index
    # leading blocks given back because every layer's sliding window has passed them (their
    # ids stay in block_ids, so a block's index is still its token range; nothing reads them)
    num_dropped_blocks: int = 0
    blocks_sent: int = 0  # leading blocks the runner's block table holds (sent with plans)
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: str | None = None
    # why it ended with finish_reason "error" when a step said so: (reason, message), see
    # SeqOutput.error
    error: tuple[str, str] | None = None
    num_preemptions: int = 0  # also the epoch of its planned steps: older results are stale
    # Planned ahead (async scheduling): tokens in steps not yet applied, and tokens those steps
    # will sample (their ids unknown until the step returns; the next step reads them from
    # the step before it on the executor).
    num_inflight: int = 0
    num_pending: int = 0
    logprobs: list[tuple[float, tuple[tuple[int, float], ...] | None]] = field(default_factory=list)
    # prompt_logprobs: entry p is (logprob, rank, top N) of prompt token p + 1, computed at p
    prompt_lps: list[tuple[float, int, tuple[tuple[int, float], ...]]] = field(default_factory=list)
    _block_hashes: list[bytes] = field(default_factory=list)
    adapter: AdapterSpec | None = None  # its LoRA adapter (None: the base model)
    lora_slot: int = -1  # the device slot it holds while running (lora_slots.py)
    # Speculation (speculation.py): its n-gram index, its acceptance, a verify in flight
    ngram: NgramIndex | None = None
    acceptance: Acceptance = field(default_factory=Acceptance)
    verifying: bool = False
    draft_len: int = 0  # draft_model: positions its KV cache holds for this sequence
    num_new: int = 0  # tokens the last applied step appended (1, or more after a verify)
    # Read per token per step, so worked out once, by Scheduler.add (its params and the
    # model's limits): the tokens that end it (EOS unless ignore_eos, stop_token_ids) and the
    # length at which it ends (max_tokens or max_model_len).
    stop_ids: frozenset[int] = frozenset()
    token_limit: int = 0

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

    def block_hashes(self, num_blocks: int, block_size: int) -> list[bytes]:
        """Chained hashes of the first ``num_blocks`` full blocks (memoised: tokens only grow)."""
        hashes = self._block_hashes
        while len(hashes) < num_blocks:
            i = len(hashes)
            chunk = self.token_ids[i * block_size:(i + 1) * block_size]
            assert len(chunk) == block_size, "only full blocks are hashed"
            hashes.append(block_hash(hashes[-1] if hashes else None, chunk, self.cache_salt))
        return hashes[:num_blocks]

    def prompt_logprobs(self) -> tuple[tuple[TokenInfo | None, ...], tuple[int, ...]]:
        """vLLM's prompt_logprobs, the one place they are assembled: None for the first prompt
        token (nothing precedes it), then each one's logprob with the top N at its position;
        and each one's rank. O(prompt): asked for once per request."""
        prompt = self.prompt_token_ids
        infos = (None,) + tuple(TokenInfo(prompt[i + 1], lp, top)
                                for i, (lp, _, top) in enumerate(self.prompt_lps))
        return infos, tuple(rank for _, rank, _ in self.prompt_lps)


def mix_seed(seed: int, step: int) -> int:
    """A 63-bit seed for draw number ``step`` of a request (splitmix64 finalizer).

    Depends only on the request's seed and how many tokens it has drawn, so a seeded request
    draws the same tokens whatever it is batched with.
    """
    z = (seed * 0x9E3779B97F4A7C15 + step + 1) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) >> 1
