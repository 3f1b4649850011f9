"""BlockPool: the KV cache's physical blocks, as bookkeeping (the tensors live in the executor).

Every block is in exactly one state:

    free       ref 0, no hash       in `_free` (a FIFO)
    cached     ref 0, hashed        in `_evictable` (LRU order: oldest first), still reusable
    in use     ref > 0              referenced by one or more sequences (shared when hashed)

A full block is indexed by a chained hash (parent hash, its token ids, a tenant salt), so two
sequences with the same prefix share blocks, and a finished sequence's blocks stay reusable
until the pool needs them: allocation takes free blocks first, then evicts the least recently
released cached block. Pure Python; no torch.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence


def block_hash(parent: bytes | None, token_ids: Sequence[int], salt: bytes = b"") -> bytes:
    """Content hash of a full block, chained to its parent so equal hashes mean equal prefixes.

    A keyed cryptographic hash (not Python's ``hash``): a tenant must not be able to craft a
    collision that reads another tenant's cached KV. ``salt`` separates tenants entirely.
    """
    h = hashlib.blake2b(digest_size=16, key=salt[:64])
    h.update(parent or b"\x00" * 16)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._ref = [0] * num_blocks
        self._hash: list[bytes | None] = [None] * num_blocks
        self._by_hash: dict[bytes, int] = {}
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self.num_evictions = 0

    # -- capacity ---------------------------------------------------------------------------
    @property
    def num_available(self) -> int:
        """Blocks an allocation can take now: free plus cached-but-unreferenced."""
        return len(self._free) + len(self._evictable)

    @property
    def num_in_use(self) -> int:
        return self.num_blocks - self.num_available

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by a live sequence (cached, unreferenced ones are free)."""
        return self.num_in_use / self.num_blocks

    @property
    def num_cached(self) -> int:
        return len(self._by_hash)

    # -- operations -------------------------------------------------------------------------
    def allocate(self, n: int) -> list[int] | None:
        """n fresh blocks with ref 1, or None (and no change) if the pool cannot supply them."""
        if n > self.num_available:
            return None
        out = []
        for _ in range(n):
            if self._free:
                b = self._free.popleft()
            else:
                b, _ = self._evictable.popitem(last=False)
                h = self._hash[b]
                del self._by_hash[h]
                self._hash[b] = None
                self.num_evictions += 1
            self._ref[b] = 1
            out.append(b)
        return out

    def lookup(self, hashes: Iterable[bytes]) -> list[int]:
        """Take a reference on the cached blocks of the longest prefix of ``hashes`` present."""
        hits = []
        for h in hashes:
            b = self._by_hash.get(h)
            if b is None:
                break
            if self._ref[b] == 0:
                del self._evictable[b]
            self._ref[b] += 1
            hits.append(b)
        return hits

    def release(self, blocks: Iterable[int]) -> None:
        """Drop one reference on each block, in the given order (released last = evicted last)."""
        for b in blocks:
            if self._ref[b] <= 0:
                raise RuntimeError(f"block {b} released more times than it was taken")
            self._ref[b] -= 1
            if self._ref[b] == 0:
                if self._hash[b] is None:
                    self._free.append(b)
                else:
                    self._evictable[b] = None

    def register(self, block: int, h: bytes) -> None:
        """Index a block whose tokens are now final. A duplicate of a cached block stays private."""
        if self._hash[block] is not None or h in self._by_hash:
            return
        self._hash[block] = h
        self._by_hash[h] = block

    def check_integrity(self) -> None:
        """Assert the invariants above; tests call it after every scheduler step."""
        free, evictable = set(self._free), set(self._evictable)
        assert len(free) == len(self._free), "duplicate block in the free list"
        assert not free & evictable, "a block is both free and cached"
        for b in range(self.num_blocks):
            r, h = self._ref[b], self._hash[b]
            assert r >= 0, f"block {b} has negative refs"
            if r == 0:
                assert (b in free) == (h is None) and (b in evictable) == (h is not None), \
                    f"unreferenced block {b} is in the wrong list"
            else:
                assert b not in free and b not in evictable, f"block {b} in use but listed as free"
            if h is not None:
                assert self._by_hash.get(h) == b, f"block {b}'s hash is not indexed to it"
        assert all(self._hash[b] == h for h, b in self._by_hash.items()), "stale hash index entry"
