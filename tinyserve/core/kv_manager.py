"""KVCacheManager: what each sequence holds in the BlockPool, and the prefix cache on top.

The one place that turns "sequence needs N more token slots" into block allocations, and
"these blocks are now full" into prefix-cache entries. Pure Python.

With a sliding window on every layer (``window``: Mistral v0.1, Phi-3 with a window), no query
to come attends to a key older than ``window`` positions behind the next token, so the blocks
wholly behind that are given back as soon as the sequence passes them (``drop_behind_window``):
a long chat holds about window / block_size blocks, not its whole history. Given-back blocks
stay in the prefix index until evicted, like any released block.
"""

from __future__ import annotations

from tinyserve.core.block_pool import BlockPool
from tinyserve.core.sequence import Sequence


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def min_kv_blocks(max_model_len: int, block_size: int, window: int | None,
                  max_num_batched_tokens: int) -> int:
    """The fewest KV blocks that let any one sequence run alone: its whole context, or with a
    window on every layer (blocks behind it given back), the window behind its next token plus
    a step in flight and the step being planned (each at most the token budget), one block of
    slack at either end. The engine sizes against it; the scheduler relies on it (preemption
    always ends)."""
    whole = -(-max_model_len // block_size)
    if window is None:
        return whole
    span = window - 1 + 2 * max_num_batched_tokens
    return min(whole, -(-span // block_size) + 1)


class KVCacheManager:
    def __init__(self, pool: BlockPool, enable_prefix_caching: bool = True,
                 window: int | None = None) -> None:
        self.pool = pool
        self.block_size = pool.block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.window = window  # every layer's sliding window, if every layer has one
        self.prefix_queries = 0  # prompt tokens of admitted requests
        self.prefix_hits = 0  # of those, tokens served from the cache

    def match_prefix(self, seq: Sequence) -> int:
        """Give a sequence with no blocks its longest cached prefix; returns the hit tokens.

        At most (num_tokens - 1) // block_size blocks: the last token is always computed (its
        logits are needed), and the computation then starts on a block boundary, so nothing is
        ever written into a shared block.
        """
        assert not seq.block_ids and seq.num_computed_tokens == 0
        hits: list[int] = []
        if self.enable_prefix_caching:
            max_blocks = (seq.num_tokens - 1) // self.block_size
            if seq.params.prompt_logprobs is not None:  # positions it still needs logits for
                max_blocks = min(max_blocks, len(seq.prompt_lps) // self.block_size)
            hits = self.pool.lookup(seq.block_hashes(max_blocks, self.block_size))
        seq.block_ids = hits
        seq.num_committed_blocks = len(hits)
        seq.num_computed_tokens = len(hits) * self.block_size
        self.drop_behind_window(seq)  # (hits the first computed query cannot see)
        return seq.num_computed_tokens

    def record_admission(self, seq: Sequence) -> None:
        """Count a request's prefix lookup once, when it is first admitted (not on the retries
        of a blocked queue head, nor on recomputes after preemption)."""
        seq.num_cached_tokens = min(seq.num_computed_tokens, seq.num_prompt_tokens)
        self.prefix_queries += seq.num_prompt_tokens
        self.prefix_hits += seq.num_cached_tokens

    def allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Blocks for ``num_new_tokens`` more tokens; False (nothing taken) if the pool is dry."""
        need = cdiv(seq.num_computed_tokens + seq.num_inflight + num_new_tokens,
                    self.block_size) - len(seq.block_ids)
        if need <= 0:
            return True
        blocks = self.pool.allocate(need)
        if blocks is None:
            return False
        seq.block_ids.extend(blocks)
        return True

    def commit(self, seq: Sequence) -> None:
        """Index the blocks that the last step filled completely."""
        if not self.enable_prefix_caching:
            return
        full = seq.num_computed_tokens // self.block_size
        if full <= seq.num_committed_blocks:
            return
        hashes = seq.block_hashes(full, self.block_size)
        for i in range(seq.num_committed_blocks, full):
            self.pool.register(seq.block_ids[i], hashes[i])
        seq.num_committed_blocks = full

    def drop_behind_window(self, seq: Sequence) -> None:
        """Give back the blocks wholly behind the window of the next token to compute: keys at
        positions <= next - window are never attended again. O(blocks dropped)."""
        if self.window is None:
            return
        behind = max(0, seq.num_computed_tokens - self.window + 1) // self.block_size
        if behind > seq.num_dropped_blocks:
            self.pool.release(seq.block_ids[seq.num_dropped_blocks:behind])
            seq.num_dropped_blocks = behind

    def free(self, seq: Sequence) -> None:
        """Release all of a sequence's blocks it still holds; tail blocks first, so they are
        evicted first (a prefix is more likely to be shared than a tail)."""
        self.pool.release(reversed(seq.block_ids[seq.num_dropped_blocks:]))
        seq.block_ids = []
        seq.num_committed_blocks = 0
        seq.num_dropped_blocks = 0
        seq.num_computed_tokens = 0

    def held(self, seq: Sequence) -> int:
        """Blocks the sequence holds a reference on."""
        return len(seq.block_ids) - seq.num_dropped_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage
