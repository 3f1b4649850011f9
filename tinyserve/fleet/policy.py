"""Prefix-aware replica choice with a load guard, for a router in front of several replicas.

A replica's KV cache holds the prefixes of the prompts it served, so a request should go where
its longest prompt prefix went before - unless that replica is loaded well beyond the others,
when a shorter queue beats a cache hit. The policy is SGLang router's cache-aware one:

- the fleet is *imbalanced* when  max_load - min_load > abs_threshold  and
  max_load > rel_threshold * min_load: then the least loaded replica takes the request;
- otherwise the replica with the longest matching prefix takes it if the match covers at
  least ``cache_threshold`` of the prompt; below that, the replica holding the fewest prefixes
  (the most room), load breaking ties.

Prefixes are tracked approximately, as the router cannot see the replicas' caches: the prompt
text cut into ``chunk`` characters, each chunk's key chaining the ones before it (as the
replicas' own block hashes do with tokens), remembered per replica with LRU eviction beyond
``max_chunks``. A replica that dies is forgotten; the rest keep their prefixes.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field

Replica = Hashable


def chunk_keys(text: str, chunk: int) -> list[bytes]:
    """Chained keys of the prompt's whole ``chunk``-character pieces (a trailing partial piece
    is left out: a prefix is shared by whole pieces, like KV blocks)."""
    keys, prev = [], b""
    data = text.encode("utf-8", "surrogatepass")
    for i in range(0, len(data) - chunk + 1, chunk):
        prev = hashlib.blake2b(prev + data[i:i + chunk], digest_size=12).digest()
        keys.append(prev)
    return keys


@dataclass
class PrefixPolicy:
    cache_threshold: float = 0.5  # share of the prompt a prefix match must cover to count
    abs_threshold: float = 32.0  # the load gap (requests) that ...
    rel_threshold: float = 1.5  # ... and ratio that make the fleet imbalanced
    chunk: int = 64  # characters per prefix piece
    max_chunks: int = 100_000  # per replica (LRU beyond)
    _held: dict[Replica, OrderedDict[bytes, None]] = field(default_factory=dict)

    def choose(self, prompt: str, loads: Mapping[Replica, float]) -> tuple[Replica, str]:
        """The replica for this prompt among ``loads`` (replica -> current load: requests in
        flight, or queue from its metrics); returns it and why: "prefix", "balance" (the
        fleet was imbalanced) or "room" (no useful prefix anywhere). Records the prompt as
        that replica's."""
        if not loads:
            raise ValueError("no replica to choose from")
        keys = chunk_keys(prompt, self.chunk)
        lo, hi = min(loads.values()), max(loads.values())
        if hi - lo > self.abs_threshold and hi > self.rel_threshold * lo:
            replica, why = min(loads, key=lambda r: (loads[r], self._size(r))), "balance"
        else:
            best, matched = None, 0
            for r in loads:
                n = self.match(r, keys)
                if n > matched or (n == matched and best is not None and n and loads[r] < loads[best]):
                    best, matched = r, n
            if best is not None and matched and matched >= self.cache_threshold * len(keys):
                replica, why = best, "prefix"
            else:
                replica, why = min(loads, key=lambda r: (self._size(r), loads[r])), "room"
        self.record(replica, keys)
        return replica, why

    def match(self, replica: Replica, keys: list[bytes]) -> int:
        """Leading chunks of the prompt this replica served before."""
        held = self._held.get(replica)
        n = 0
        if held:
            for key in keys:
                if key not in held:
                    break
                n += 1
        return n

    def record(self, replica: Replica, keys: list[bytes]) -> None:
        held = self._held.setdefault(replica, OrderedDict())
        for key in keys:
            held[key] = None
            held.move_to_end(key)
        while len(held) > self.max_chunks:
            held.popitem(last=False)

    def forget(self, replica: Replica) -> None:
        """The replica is gone (its cache with it)."""
        self._held.pop(replica, None)

    def _size(self, replica: Replica) -> int:
        return len(self._held.get(replica, ()))
