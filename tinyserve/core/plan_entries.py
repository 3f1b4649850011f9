"""A sequence's share of a step as the runner gets it (a ScheduledSeq): the scheduler decides
how many tokens; this says which, at what positions, with which blocks, seeds and history, and
counts them as in flight. Per sequence per step: attribute reads hoisted, positional
construction (hundreds of these a step)."""

from __future__ import annotations

import msgspec

from tinyserve.core.sequence import Sequence, mix_seed
from tinyserve.messages import DRAFT, PLACEHOLDER, ScheduledSeq


def plan_entry(seq: Sequence, n: int, eos_token_ids: frozenset[int]) -> ScheduledSeq:
    """The next n of its tokens to compute (the last a PLACEHOLDER when the step in flight
    samples it); a draw when they reach its end."""
    start = seq.num_computed_tokens + seq.num_inflight
    end = start + n
    token_ids, pending = seq.token_ids, seq.num_pending
    size = len(token_ids)
    if n == 1:  # a decode: the token the step in flight samples, or the last one known
        known = (token_ids[start],) if start < size else (PLACEHOLDER,)
    else:
        known = tuple(token_ids[start:end])
        if len(known) != n:
            known += (PLACEHOLDER,) * (n - len(known))
    sample = end == size + pending
    first = seq.blocks_sent  # the runner keeps the table: send only blocks it lacks
    block_ids = seq.block_ids
    num_blocks = len(block_ids)
    p = seq.params
    num_prompt = len(seq.prompt_token_ids)
    # (positional, in ScheduledSeq's field order; a greedy draw's seed is never read)
    entry = ScheduledSeq(
        seq.seq_id, known, start, tuple(block_ids[first:]) if first < num_blocks else (),
        sample, p, mix_seed(seq.seed, size - num_prompt + pending) if not p.greedy else 0,
        seq.num_preemptions, first, None, None, (), (), seq.lora_slot)
    if sample and p.needs_history:
        entry = with_history(entry, seq, eos_token_ids)
    if p.prompt_logprobs is not None and start < num_prompt - 1:
        last = num_prompt - 1  # the last position whose next token is the prompt's
        if len(seq.prompt_lps) < last:
            entry = msgspec.structs.replace(
                entry, prompt_targets=seq.prompt_token_ids[start + 1:min(end, last) + 1])
    seq.blocks_sent = num_blocks
    seq.num_inflight += n
    seq.num_pending = pending + sample
    return entry


def verify_entry(seq: Sequence, drafts: tuple[int, ...], eos_token_ids: frozenset[int]
                 ) -> ScheduledSeq:
    """One verify (core/speculation.py): the last token and the drafts at positions
    p..p+K, a draw at each, row i's seed and min_tokens bans those of plain decoding's i-th
    next draw."""
    start, K = seq.num_computed_tokens, len(drafts)
    first = seq.blocks_sent
    drawn = seq.num_output_tokens
    p = seq.params
    entry = ScheduledSeq(
        seq.seq_id, (seq.token_ids[-1],) + drafts, start, tuple(seq.block_ids[first:]),
        True, p, mix_seed(seq.seed, drawn), seq.num_preemptions, first,
        lora_slot=seq.lora_slot, num_drafts=K,
        spec_seeds=tuple(mix_seed(seq.seed, drawn + i) for i in range(1, K + 1)),
        spec_banned=tuple(banned_ids(seq, drawn + i, eos_token_ids) for i in range(1, K + 1)),
        draft_from=seq.draft_len,
        draft_prefix=tuple(seq.token_ids[seq.draft_len:start]) if drafts[0] == DRAFT else ())
    if p.needs_history:
        entry = with_history(entry, seq, eos_token_ids)
    seq.blocks_sent = len(seq.block_ids)
    seq.num_inflight += K + 1
    seq.num_pending += 1
    seq.verifying = True
    return entry


def banned_ids(seq: Sequence, drawn: int, eos_token_ids: frozenset[int]) -> tuple[int, ...]:
    """The ids draw number ``drawn`` may not take (vLLM: no stop token before min_tokens; a
    grammar wins: once complete it allows only EOS, and a ban on top would leave nothing)."""
    p = seq.params
    if drawn < p.min_tokens and p.guided is None:
        eos = () if p.ignore_eos else tuple(eos_token_ids)
        return tuple(sorted(set(p.stop_token_ids) | set(eos)))
    return ()


def with_history(entry: ScheduledSeq, seq: Sequence, eos_token_ids: frozenset[int]
                 ) -> ScheduledSeq:
    """What the runner needs to process this draw's logits: O(output) per step, paid only
    by requests that ask for penalties, logit_bias, min_tokens or a grammar."""
    p = seq.params
    banned = banned_ids(seq, seq.num_output_tokens + seq.num_pending, eos_token_ids)
    return msgspec.structs.replace(
        entry, output_ids=tuple(seq.output_token_ids) + (PLACEHOLDER,) * seq.num_pending,
        prompt_ids=seq.prompt_token_ids if p.repetition_penalty != 1.0 else None,
        banned=banned)
