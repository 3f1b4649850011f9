"""EngineCore: schedule -> execute -> postprocess, the step loop both front ends drive.

The executor is not called here: ``LLM.generate`` runs the plan inline, the server's executor
actor runs it in a worker thread. Everything here is pure Python and owned by one caller (the
offline loop or the batcher actor).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tinyserve.config import SpeculativeConfig
from tinyserve.core import stopping
from tinyserve.core.adapters import AdapterSpec
from tinyserve.core.block_pool import BlockPool
from tinyserve.core.engines import EngineInfo
from tinyserve.core.kv_manager import KVCacheManager
from tinyserve.core.request import Request
from tinyserve.core.scheduler import Scheduler, SchedulerConfig
from tinyserve.core.sequence import Sequence
from tinyserve.messages import (
    FULL_VOCAB,
    MAX_LOGPROBS,
    MAX_PROMPT_LOGPROB_ENTRIES,
    FieldError,
    SamplingParams,
    StepPlan,
    StepResult,
)
from tinyserve.text.detokenizer import IncrementalDetokenizer
from tinyserve.text.tokenizer import Tokenizer

if TYPE_CHECKING:
    from tinyserve.config import EngineConfig


@dataclass(frozen=True, slots=True)
class CoreConfig:
    num_kv_blocks: int
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    vocab_size: int
    eos_token_ids: frozenset[int]
    enable_prefix_caching: bool = True
    seed: int = 0
    kv_window: int | None = None  # every layer's sliding window: older blocks are given back
    max_loras: int = 0  # LoRA adapter slots on the device (0: no adapters)
    speculative: SpeculativeConfig | None = None  # speculative decoding (None: off)

    @classmethod
    def from_engine(cls, cfg: EngineConfig, info: EngineInfo) -> CoreConfig:
        """The scheduler's view of a loaded engine (sizes resolved at load time)."""
        return cls(num_kv_blocks=info.num_kv_blocks, block_size=info.block_size,
                   max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_batched_tokens,
                   max_model_len=info.max_model_len, vocab_size=info.vocab_size,
                   eos_token_ids=info.eos_token_ids,
                   enable_prefix_caching=cfg.enable_prefix_caching, seed=cfg.seed,
                   kv_window=info.kv_window, max_loras=info.max_loras,
                   # the engine's: a draft model is loaded by it, whatever cfg says
                   speculative=info.speculative)


class EngineCore:
    def __init__(self, cfg: CoreConfig, tokenizer: Tokenizer) -> None:
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.kv = KVCacheManager(BlockPool(cfg.num_kv_blocks, cfg.block_size),
                                 cfg.enable_prefix_caching, cfg.kv_window)
        self.scheduler = Scheduler(SchedulerConfig(cfg.max_num_seqs, cfg.max_num_batched_tokens,
                                                   cfg.max_model_len, cfg.eos_token_ids,
                                                   cfg.max_loras, cfg.speculative), self.kv)
        self._rng = random.Random(cfg.seed)
        self.requests: dict[int, Request] = {}  # by the server's id (= the sequence's id)

    def check(self, prompt_token_ids: list[int] | tuple[int, ...], params: SamplingParams) -> None:
        """Everything a step relies on, checked before the request can join one: a value that
        passed here can never make a step raise (FieldError names the field)."""
        if not prompt_token_ids:
            raise FieldError("prompt", "prompt: must contain at least one token")
        check_token_ids(prompt_token_ids, self.cfg.vocab_size, "prompt")
        check_sampling_vocabulary(params, self.cfg.vocab_size, len(prompt_token_ids) - 1)

    def add_request(self, request_id: int, prompt_token_ids: list[int] | tuple[int, ...],
                    params: SamplingParams, cache_salt: bytes = b"", priority: int = 0,
                    tenant: str = "", adapter: AdapterSpec | None = None,
                    **serving) -> Request:
        """Queue a request; ``serving`` fills the Request's reply queue and timing fields.
        ``adapter``: the LoRA adapter it runs with (its prefix-cache blocks are its own)."""
        if request_id in self.requests:
            raise ValueError(f"duplicate request id {request_id}")
        self.check(prompt_token_ids, params)
        if adapter is not None and self.scheduler.lora_slots is None:
            raise ValueError("this engine serves no LoRA adapters")
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        salt = cache_salt if adapter is None else cache_salt + adapter.cache_salt
        seq = Sequence(request_id, tuple(prompt_token_ids), params, seed, cache_salt=salt,
                       priority=priority, tenant=tenant, adapter=adapter)
        self.scheduler.add(seq)
        req = Request(seq, IncrementalDetokenizer(
            self.tokenizer, seq.prompt_token_ids, params.stop, params.skip_special_tokens,
            params.include_stop_str_in_output, params.min_tokens), **serving)
        self.requests[request_id] = req
        return req

    def release(self, request_id: int) -> Request | None:
        """Forget a request; one still unfinished is aborted (its blocks are freed at once)."""
        req = self.requests.pop(request_id, None)
        if req is not None and not req.seq.is_finished:
            self.scheduler.finish(req.seq, "abort")
        return req

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    def schedule(self) -> StepPlan | None:
        return self.scheduler.schedule()

    def process(self, plan: StepPlan, result: StepResult) -> list[Request]:
        """Apply a step's tokens; detokenize; finish on stop strings. Returns the requests that
        advanced or failed. Finished ones stay in ``requests`` until ``release``."""
        updated = []
        eos, finish = self.cfg.eos_token_ids, self.scheduler.finish
        for seq in self.scheduler.update(plan, result):
            req = self.requests[seq.seq_id]
            if seq.finish_reason != "error":
                stopping.after_text(seq, req.detok, eos, finish)
            updated.append(req)
        return updated


# -- the vocabulary rules: here only (the API runs them too, before it answers 200) ----------

def check_token_ids(ids: list | tuple, vocab_size: int, field: str) -> None:
    """Every id an integer in [0, vocab_size)."""
    for t in ids:
        if not (type(t) is int and 0 <= t < vocab_size):
            shown = repr(t)
            shown = shown if len(shown) <= 40 else shown[:37] + "..."
            raise FieldError(field, f"{field}: token id {shown} is not an integer in the "
                             f"vocabulary [0, {vocab_size})")


def check_sampling_vocabulary(params: SamplingParams, vocab_size: int,
                              scored_positions: int = 0) -> None:
    """The sampling parameters that name tokens name tokens of this vocabulary, and
    prompt_logprobs=-1 (the whole vocabulary at each of ``scored_positions`` prompt positions:
    a prompt's tokens after the first, for each sequence that returns them) asks for at most
    MAX_PROMPT_LOGPROB_ENTRIES entries."""
    if params.prompt_logprobs == FULL_VOCAB:
        entries = scored_positions * vocab_size
        if entries > MAX_PROMPT_LOGPROB_ENTRIES:
            raise FieldError("prompt_logprobs", f"prompt_logprobs=-1 asks for the whole "
                             f"vocabulary ({vocab_size} tokens) at {scored_positions} prompt "
                             f"positions (each prompt's tokens after the first, per choice): "
                             f"{entries} entries, more than {MAX_PROMPT_LOGPROB_ENTRIES}. Ask "
                             f"for at most {MAX_PROMPT_LOGPROB_ENTRIES // vocab_size} positions"
                             f", or for a top N of at most {MAX_LOGPROBS}.")
    if params.top_k > vocab_size:
        raise FieldError("top_k", f"top_k must be -1, 0 (disabled) or at most the vocabulary "
                         f"size {vocab_size}, got {params.top_k}")
    if any(t >= vocab_size for t in params.stop_token_ids):
        raise FieldError("stop_token_ids", f"stop_token_ids must be token ids in the vocabulary "
                         f"[0, {vocab_size})")
    if any(t >= vocab_size for t, _ in params.logit_bias):
        raise FieldError("logit_bias", f"logit_bias keys must be token ids in the vocabulary "
                         f"[0, {vocab_size})")
    banned = {t for t, b in params.logit_bias if b <= -100.0}
    if len(banned) >= vocab_size:  # (a grammar's first mask is checked once it is compiled)
        raise FieldError("logit_bias", f"logit_bias: -100 bans every token of the vocabulary "
                         f"({vocab_size}), so nothing can be generated")

