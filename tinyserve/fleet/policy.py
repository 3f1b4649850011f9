"""The fleet's routing decision, free of Ray so it can be read and tested on its own.

Cache-aware with a load guard, as SGLang's and vLLM's routers do it: a request goes to the
replica that already holds the longest prefix of its prompt (so its KV blocks are reused),
unless that replica is loaded well beyond the least loaded one - then to the least loaded.
Load is what the replicas' own /metrics say: running + waiting requests, and KV usage.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class ReplicaLoad:
    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0
    ready: bool = True

    @property
    def requests(self) -> float:
        return self.running + self.waiting

    @classmethod
    def from_stats(cls, stats: Mapping | None) -> ReplicaLoad:
        """From a replica's ``record_routing_stats`` (empty until its first report)."""
        s = stats or {}
        return cls(float(s.get("running", 0.0)), float(s.get("waiting", 0.0)),
                   float(s.get("kv_usage", 0.0)), bool(s.get("ready", True)))


@dataclass(frozen=True)
class LoadGuard:
    """When the prefix owner counts as overloaded, compared with ``least``, the least loaded
    replica with KV room: more than ``abs_threshold`` requests above it *and* more than
    ``rel_threshold`` times its load (SGLang's balance_abs/rel thresholds), or KV usage at
    ``kv_high`` while it is below."""

    abs_threshold: float = 32.0
    rel_threshold: float = 1.5
    kv_high: float = 0.95

    def overloaded(self, owner: ReplicaLoad, least: ReplicaLoad) -> bool:
        if owner.kv_usage >= self.kv_high > least.kv_usage:
            return True
        return (owner.requests - least.requests > self.abs_threshold
                and owner.requests > self.rel_threshold * least.requests)


def prefix_counts(matched: int, text: str, threshold: float) -> bool:
    """Whether a prefix match of ``matched`` characters of ``text`` makes its holders the
    owners. The model key ahead of the prompt (``model\\0prompt``, relay.routing_text) is
    shared by every request to that model and never counts: with it, two unrelated prompts
    "matched" on the key alone (12 of ~100 characters, over the 0.1 threshold) and every new
    prefix followed the first one to its replica."""
    key = text.find("\0") + 1  # 0 when there is no key
    prompt = len(text) - key
    return prompt > 0 and matched - key > 0 and matched - key >= threshold * prompt


def rank(ids: Sequence[str], loads: Mapping[str, ReplicaLoad], owners: Sequence[str],
         guard: LoadGuard, exclude: Sequence[str] = (),
         picked: Mapping[str, int] | None = None) -> list[list[str]]:
    """Replicas to try, best first, as ranks (Ray's router takes the first rank that has a
    replica with room); every replica appears once.

    ``owners``: replicas holding the longest matching prefix, or the emptiest ones for a
    prompt nobody has seen. The first rank is the least loaded owner that is not overloaded,
    else the least loaded replica with KV room. Replicas not ready come after ready ones, and
    excluded ones (a retry's failed replica) last: a one-replica fleet still retries on
    itself rather than waiting for a replica that may never come. Ties go to the replica
    picked least often so far (``picked``): the metrics lag a burst."""
    if not ids:
        return []
    picked = picked or {}

    def order(group: Sequence[str]) -> list[str]:
        return sorted(group, key=lambda i: (loads[i].requests, loads[i].kv_usage,
                                            picked.get(i, 0)))

    live = [i for i in ids if i not in exclude]
    ready = order([i for i in live if loads[i].ready])
    pool = ready or order(live)
    tail = [i for i in order(live) if i not in pool] + order([i for i in ids if i in exclude])
    if not pool:
        return [tail[:1], tail[1:]]
    # Where a request goes when its owner is overloaded: the least loaded replica with KV
    # room, if any has room.
    roomy = [i for i in pool if loads[i].kv_usage < guard.kv_high] or pool
    least = loads[roomy[0]]
    owned = [i for i in pool if i in set(owners) and not guard.overloaded(loads[i], least)]
    first = (owned or roomy)[0]
    return [[first], [i for i in pool if i != first] + tail]
