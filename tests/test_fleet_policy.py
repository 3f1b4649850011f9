"""The fleet's replica choice: longest prompt prefix unless the fleet is imbalanced."""

import random

import pytest

from tinyserve.fleet.policy import PrefixPolicy, chunk_keys

SYSTEMS = [f"System prompt number {i}: you are a helpful storyteller. " * 4 for i in range(4)]


def test_chunk_keys_chain_whole_pieces():
    a, b = chunk_keys("x" * 64 + "y" * 64 + "z" * 10, 64), chunk_keys("x" * 64 + "w" * 64, 64)
    assert len(a) == 2 and a[0] == b[0] and a[1] != b[1]  # shared first piece, then apart
    assert chunk_keys("y" * 64 + "x" * 64, 64)[1] != a[1]  # a piece's key depends on what came before
    assert chunk_keys("short", 64) == []


def test_each_prefix_sticks_to_one_replica_and_the_prefixes_spread():
    policy = PrefixPolicy(chunk=32)
    loads = {"r0": 0, "r1": 0}
    seen = {}
    rng = random.Random(0)
    for i in range(64):
        s = rng.randrange(4)
        replica, why = policy.choose(SYSTEMS[s] + f"user question {i}", loads)
        seen.setdefault(s, set()).add(replica)
    assert all(len(r) == 1 for r in seen.values())  # every prefix on one replica
    assert {next(iter(r)) for r in seen.values()} == {"r0", "r1"}  # new prefixes go where there is room


def test_an_imbalanced_fleet_sends_to_the_least_loaded_even_past_a_cache_hit():
    policy = PrefixPolicy(chunk=32, abs_threshold=4, rel_threshold=1.5)
    first, _ = policy.choose(SYSTEMS[0] + "q1", {"r0": 0, "r1": 0})
    other = "r1" if first == "r0" else "r0"
    assert policy.choose(SYSTEMS[0] + "q2", {first: 3, other: 0}) == (first, "prefix")  # within bounds
    assert policy.choose(SYSTEMS[0] + "q3", {first: 10, other: 2}) == (other, "balance")
    # both loaded alike but high: balanced again (ratio under 1.5), the prefix wins
    assert policy.choose(SYSTEMS[0] + "q4", {first: 40, other: 35})[1] == "prefix"


def test_a_short_match_does_not_count_and_a_dead_replica_is_forgotten():
    policy = PrefixPolicy(chunk=16, cache_threshold=0.5)
    r, _ = policy.choose("A" * 64, {"r0": 0, "r1": 0})
    # shares 1 of 8 pieces with the first prompt: below half, it goes where there is room
    other = "r1" if r == "r0" else "r0"
    assert policy.choose("A" * 16 + "B" * 112, {"r0": 0, "r1": 0}) == (other, "room")
    policy.forget(r)
    assert policy.match(r, chunk_keys("A" * 64, 16)) == 0
    with pytest.raises(ValueError):
        policy.choose("x", {})


def test_lru_bounds_what_a_replica_remembers():
    policy = PrefixPolicy(chunk=8, max_chunks=4)
    policy.record("r0", chunk_keys("a" * 8 * 3, 8))
    policy.record("r0", chunk_keys("b" * 8 * 3, 8))
    assert policy._size("r0") == 4
    assert policy.match("r0", chunk_keys("b" * 24, 8)) == 3  # the newest stay
    assert policy.match("r0", chunk_keys("a" * 24, 8)) == 0  # the oldest went first
