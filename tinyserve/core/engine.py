"""EngineCore: schedule -> execute -> postprocess, the step loop both front ends drive.

The executor is not called here: ``LLM.generate`` runs the plan inline, the server's executor
actor runs it in a worker thread. Everything here is pure Python and owned by one caller (the
offline loop or the batcher actor).
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tinyserve.core.block_pool import BlockPool
from tinyserve.core.kv_manager import KVCacheManager
from tinyserve.core.scheduler import Scheduler, SchedulerConfig
from tinyserve.core.sequence import Sequence
from tinyserve.engine.sampling import SamplingParams
from tinyserve.engine.tokenizer import IncrementalDetokenizer, Tokenizer
from tinyserve.messages import StepPlan, StepResult

if TYPE_CHECKING:
    from tinyserve.config import EngineConfig
    from tinyserve.engine.engine import EngineInfo


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

    @classmethod
    def from_engine(cls, cfg: EngineConfig, info: EngineInfo) -> CoreConfig:
        """The scheduler's view of a loaded engine (sizes resolved at load time)."""
        return cls(num_kv_blocks=info.num_kv_blocks, block_size=info.block_size,
                   max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_batched_tokens,
                   max_model_len=info.max_model_len, vocab_size=info.vocab_size,
                   eos_token_ids=info.eos_token_ids,
                   enable_prefix_caching=cfg.enable_prefix_caching, seed=cfg.seed)


class EngineCore:
    def __init__(self, cfg: CoreConfig, tokenizer: Tokenizer) -> None:
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.kv = KVCacheManager(BlockPool(cfg.num_kv_blocks, cfg.block_size),
                                 cfg.enable_prefix_caching)
        self.scheduler = Scheduler(SchedulerConfig(cfg.max_num_seqs, cfg.max_num_batched_tokens,
                                                   cfg.max_model_len, cfg.eos_token_ids), self.kv)
        self._rng = random.Random(cfg.seed)
        self._ids = itertools.count()
        self.detokenizers: dict[int, IncrementalDetokenizer] = {}

    def add_request(self, prompt_token_ids: list[int] | tuple[int, ...], params: SamplingParams,
                    cache_salt: bytes = b"") -> Sequence:
        bad = [t for t in prompt_token_ids if not 0 <= t < self.cfg.vocab_size]
        if bad:
            raise ValueError(f"prompt: token id {bad[0]} is outside the vocabulary "
                             f"[0, {self.cfg.vocab_size})")
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        seq = Sequence(next(self._ids), tuple(prompt_token_ids), params, seed,
                       cache_salt=cache_salt)
        self.scheduler.add(seq)
        self.detokenizers[seq.seq_id] = IncrementalDetokenizer(
            self.tokenizer, seq.prompt_token_ids, params.stop, params.skip_special_tokens)
        return seq

    def abort(self, seq_id: int) -> None:
        self.scheduler.abort(seq_id)
        self.detokenizers.pop(seq_id, None)

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    def schedule(self) -> StepPlan | None:
        return self.scheduler.schedule()

    def process(self, plan: StepPlan, result: StepResult) -> list[Sequence]:
        """Apply a step's tokens; detokenize; finish on stop strings. Returns updated seqs.

        Finished sequences keep their detokenizer until ``release`` so callers can read the text.
        """
        updated = self.scheduler.update(plan, result)
        for seq in updated:
            if seq.finish_reason == "error":
                continue
            detok = self.detokenizers[seq.seq_id]
            detok.add(seq.token_ids[-1])
            if detok.stopped and not seq.is_finished:
                self.scheduler.finish(seq, "stop")
        return updated

    def release(self, seq_id: int) -> IncrementalDetokenizer | None:
        return self.detokenizers.pop(seq_id, None)
