"""Every message that crosses an actor queue, in one file: this is the wiring diagram.

Messages are small frozen msgspec Structs. Token ids are tuples; no tensors cross a queue.

    Batcher --StepPlan--> Executor --StepResult--> Batcher
"""

from __future__ import annotations

import msgspec

from tinyserve.engine.sampling import SamplingParams


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
