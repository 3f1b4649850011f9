"""BlockPool and prefix hashing: no model, no torch."""

import pytest

from tinyserve.core.block_pool import BlockPool, block_hash
from tinyserve.core.kv_manager import KVCacheManager
from tinyserve.core.sequence import Sequence
from tinyserve.messages import SamplingParams


def h(i: int) -> bytes:
    return block_hash(None, [i])


def test_allocate_and_release_counts():
    pool = BlockPool(4, 16)
    a = pool.allocate(3)
    assert len(set(a)) == 3 and pool.num_available == 1 and pool.usage == 0.75
    assert pool.allocate(2) is None and pool.num_available == 1  # all or nothing
    pool.release(a)
    assert pool.num_available == 4 and pool.usage == 0.0
    pool.check_integrity()


def test_release_twice_is_an_error():
    pool = BlockPool(2, 16)
    [b] = pool.allocate(1)
    pool.release([b])
    with pytest.raises(RuntimeError):
        pool.release([b])


def test_cached_blocks_are_reused_and_count_as_free():
    pool = BlockPool(4, 16)
    a, b = pool.allocate(2)
    pool.register(a, h(1))
    pool.register(b, h(2))
    pool.release([b, a])
    assert pool.usage == 0.0 and pool.num_cached == 2
    hits = pool.lookup([h(1), h(2), h(3)])
    assert hits == [a, b]  # longest present prefix
    assert pool.usage == 0.5
    again = pool.lookup([h(1)])  # shared: a second reference
    assert again == [a]
    pool.release([a])
    assert pool.usage == 0.5  # still referenced once
    pool.check_integrity()


def test_lookup_stops_at_first_miss():
    pool = BlockPool(4, 16)
    a, b = pool.allocate(2)
    pool.register(b, h(2))
    pool.release([a, b])
    assert pool.lookup([h(1), h(2)]) == []


def test_eviction_is_least_recently_released_first():
    pool = BlockPool(3, 16)
    blocks = pool.allocate(3)
    for i, blk in enumerate(blocks):
        pool.register(blk, h(i))
    pool.release([blocks[1]])
    pool.release([blocks[0]])
    pool.release([blocks[2]])
    [first] = pool.allocate(1)
    assert first == blocks[1] and pool.num_evictions == 1
    assert pool.lookup([h(1)]) == []  # its hash is gone
    assert pool.lookup([h(0)]) == [blocks[0]]  # others still cached
    pool.check_integrity()


def test_free_blocks_are_used_before_evicting_cached_ones():
    pool = BlockPool(3, 16)
    a, b = pool.allocate(2)
    pool.register(a, h(7))
    pool.release([a, b])
    [c] = pool.allocate(1)
    assert c != a and pool.num_evictions == 0


def test_duplicate_content_stays_private():
    pool = BlockPool(3, 16)
    a, b = pool.allocate(2)
    pool.register(a, h(5))
    pool.register(b, h(5))
    pool.release([a, b])
    assert pool.num_cached == 1
    assert pool.lookup([h(5)]) == [a]
    pool.check_integrity()


def test_block_hash_chains_and_salts():
    x = block_hash(None, [1, 2, 3])
    assert block_hash(None, [1, 2, 3]) == x
    assert block_hash(x, [1, 2, 3]) != x  # same tokens, other parent
    assert block_hash(None, [1, 2, 3], salt=b"tenant-a") != x
    assert block_hash(None, [1, 2, 3], salt=b"tenant-a") != block_hash(None, [1, 2, 3], b"tenant-b")


def test_a_finished_sequence_releases_its_tail_first_so_its_head_is_evicted_last():
    # A prefix is more likely to be shared than a tail: under pressure, the pool must evict
    # a finished sequence's last block first and keep its leading blocks cached longest.
    pool = BlockPool(3, 4)
    kv = KVCacheManager(pool)
    prompt = tuple(range(10, 22))  # 12 tokens: 3 full blocks
    seq = Sequence(0, prompt, SamplingParams(max_tokens=1), seed=0)
    assert kv.allocate(seq, len(prompt))
    head, middle, tail = seq.block_ids
    seq.num_computed_tokens = len(prompt)
    kv.commit(seq)
    kv.free(seq)
    assert pool.num_cached == 3 and pool.usage == 0.0
    assert pool.allocate(1) == [tail]  # the least recently released: the tail
    assert pool.allocate(1) == [middle]
    again = Sequence(1, prompt + (99,), SamplingParams(max_tokens=1), seed=0)
    assert kv.match_prefix(again) == 4 and again.block_ids == [head]  # the head still hits
    pool.check_integrity()
