"""The fleet's pieces that need no Ray: the routing decision, the prompt text it keys on,
the relay's hold-back of a stream's opening, and the configuration. (The fleet itself runs
under Ray in tests/fleet, a step of its own in .ci/run.)"""

import msgspec
import pytest

from tinyserve.fleet.app import FleetConfig
from tinyserve.fleet.policy import LoadGuard, ReplicaLoad, prefix_counts, rank
from tinyserve.fleet.relay import FleetRequest, ReplicaDown, relay_headers, routing_text
from tinyserve.fleet.replica import _Holdback, has_output, load_from_metrics

IDS = ["a", "b", "c"]


def loads(**kw):
    out = {i: ReplicaLoad() for i in IDS}
    out.update(kw)
    return out


def test_prefix_owner_wins_while_load_is_close():
    ls = loads(a=ReplicaLoad(running=10, waiting=5), b=ReplicaLoad(running=2))
    assert rank(IDS, ls, ["a"], LoadGuard()) == [["a"], ["c", "b"]]


def test_load_guard_needs_both_absolute_and_relative_excess():
    g = LoadGuard(abs_threshold=32, rel_threshold=1.5)
    # 40 more than the least loaded and far above 1.5x: the owner is skipped.
    ls = loads(a=ReplicaLoad(running=64, waiting=40), b=ReplicaLoad(running=64),
               c=ReplicaLoad(running=64))
    assert rank(IDS, ls, ["a"], g)[0] == ["b"]
    # 40 more, but only 1.4x the least loaded: still the owner (its cache is worth it).
    ls = loads(a=ReplicaLoad(running=140), b=ReplicaLoad(running=100), c=ReplicaLoad(running=100))
    assert rank(IDS, ls, ["a"], g)[0] == ["a"]
    # 3x but only 20 more: the owner.
    ls = loads(a=ReplicaLoad(running=30), b=ReplicaLoad(running=10), c=ReplicaLoad(running=10))
    assert rank(IDS, ls, ["a"], g)[0] == ["a"]


def test_full_kv_moves_the_request_when_another_replica_has_room():
    g = LoadGuard()
    ls = loads(a=ReplicaLoad(kv_usage=0.97), b=ReplicaLoad(kv_usage=0.5, running=3),
               c=ReplicaLoad(kv_usage=0.96, running=1))
    assert rank(IDS, ls, ["a"], g)[0] == ["b"]
    everyone_full = {i: ReplicaLoad(kv_usage=0.99) for i in IDS}
    assert rank(IDS, everyone_full, ["a"], g)[0] == ["a"]  # nowhere better to go


def test_exclude_and_readiness():
    ls = loads(b=ReplicaLoad(ready=False))
    # The retry's failed replica goes last, behind the one that is not ready.
    assert rank(IDS, ls, ["a"], LoadGuard(), exclude=["a"]) == [["c"], ["b", "a"]]
    # Only not-ready replicas left: used rather than nothing (they answer 503 themselves).
    ls = {i: ReplicaLoad(ready=False) for i in IDS}
    assert rank(IDS, ls, [], LoadGuard(), exclude=["a", "b"])[0] == ["c"]
    # Every replica excluded (a one-replica fleet's retry): try them anyway, at once.
    assert rank(["a"], loads(), ["a"], LoadGuard(), exclude=["a"]) == [["a"], []]
    assert rank([], {}, [], LoadGuard()) == []


def test_ties_spread_by_what_this_router_picked():
    ls = loads()
    assert rank(IDS, ls, IDS, LoadGuard(), picked={"a": 3, "b": 1, "c": 2})[0] == ["b"]
    assert rank(IDS, ls, [], LoadGuard(), picked={"a": 1, "b": 1, "c": 0})[0] == ["c"]


def test_the_model_key_alone_is_no_prefix_match():
    # Two unrelated prompts to one model share only "model\0": no owner (the CI failure: every
    # new prefix followed the first to its replica).
    a = routing_text(msgspec.json.encode({"model": "stories260k", "prompt": "Tom had a ball. " * 4}))
    key = len("stories260k") + 1
    assert not prefix_counts(key, a, 0.1)
    assert not prefix_counts(key + 1, a, 0.1)  # a shared first letter is not 10% of the prompt
    assert prefix_counts(key + 7, a, 0.1) and not prefix_counts(key + 6, a, 0.1)  # 64 chars
    assert prefix_counts(len(a), a, 1.0)
    # An empty key (a body without "model"): only the NUL is skipped, a NUL in the prompt is
    # the prompt's
    b = routing_text(msgspec.json.encode({"prompt": "x\0" * 32}))
    assert prefix_counts(1 + 7, b, 0.1) and not prefix_counts(1 + 6, b, 0.1)
    assert not prefix_counts(1, b, 0.0) and not prefix_counts(0, "", 0.0)


def test_every_replica_is_ranked_once():
    ls = loads(a=ReplicaLoad(running=5), c=ReplicaLoad(running=1))
    r = rank(IDS, ls, ["c"], LoadGuard())
    assert sorted(sum(r, [])) == IDS and r[0] == ["c"]


def test_replica_load_from_stats_defaults_before_the_first_report():
    assert ReplicaLoad.from_stats({}) == ReplicaLoad()
    assert ReplicaLoad.from_stats(None).ready
    s = ReplicaLoad.from_stats({"running": 3, "waiting": 2, "kv_usage": 0.5, "ready": False})
    assert s.requests == 5 and s.kv_usage == 0.5 and not s.ready


@pytest.mark.parametrize("body, text", [
    ({"prompt": "Once upon"}, "\0Once upon"),  # (no model: an empty key)
    ({"prompt": ["first", "second"]}, "\0first"),
    ({"prompt": [1, 2, 3]}, "\x001 2 3"),
    ({"prompt": [[4, 5], [6]]}, "\x004 5"),
    ({"messages": [{"role": "system", "content": "Be brief."},
                   {"role": "user", "content": [{"type": "text", "text": "Hi"}]}]},
     "\0system:Be brief.\nuser:Hi\n"),
    ({"prompt": "a\0b"}, "\0a\0b"),  # a NUL in the prompt stays the prompt's
    ({"model": "m\0x", "prompt": "p"}, "m x\0p"),  # one in the model name does not split it
    ({"messages": "not a list"}, ""),
    ({"prompt": 7}, ""),
    ([1, 2], ""),
    # a LoRA adapter's blocks are its own: the model keys the prefix too
    ({"model": "a_qv", "prompt": "Once upon"}, "a_qv\0Once upon"),
    ({"model": "base", "prompt": "Once upon"}, "base\0Once upon"),
    ({"model": "a_qv", "prompt": 7}, ""),
])
def test_routing_text(body, text):
    assert routing_text(msgspec.json.encode(body)) == text


def test_routing_text_never_raises_on_garbage():
    for raw in (b"", b"{", b"\xff\xfe", b'{"prompt": [{}]}', b'{"messages": [1, null]}'):
        assert isinstance(routing_text(raw), str)


def test_relay_headers_drop_hop_by_hop_and_lowercase():
    got = relay_headers([("Content-Type", "text/event-stream"), ("Transfer-Encoding", "chunked"),
                         ("Connection", "keep-alive"), ("X-Request-Id", "r1"),
                         ("Content-Length", "5"), ("Authorization", "Bearer k")])
    assert got == [("content-type", "text/event-stream"), ("x-request-id", "r1"),
                   ("authorization", "Bearer k")]


def test_replica_down_survives_pickling():
    import pickle

    e = pickle.loads(pickle.dumps(ReplicaDown("abc", "its server process has exited")))
    assert e.replica_id == "abc" and "exited" in str(e)
    assert FleetRequest("POST", "/v1/completions", [], b"{}").exclude == ()


def _event(doc) -> bytes:
    return b"data: " + msgspec.json.encode(doc) + b"\n\n"


def test_the_opening_event_is_held_back_until_output():
    opening = _event({"choices": [{"index": 0, "delta": {"role": "assistant"},
                                   "finish_reason": None}]})
    token = _event({"choices": [{"index": 0, "delta": {"content": "Hi"}, "finish_reason": None}]})
    h = _Holdback()
    assert not h.feed(opening)
    assert not h.feed(token[:10])  # an event split across reads
    assert h.feed(token[10:])
    assert bytes(h.buf) == opening + token


@pytest.mark.parametrize("doc, out", [
    ({"choices": [{"text": "x", "finish_reason": None}]}, True),
    ({"choices": [{"text": "", "finish_reason": "length"}]}, True),
    ({"choices": [{"delta": {"role": "assistant"}, "finish_reason": None}]}, False),
    ({"choices": [{"delta": {"tool_calls": [{}]}, "finish_reason": None}]}, True),
    ({"choices": [], "usage": {"prompt_tokens": 1}}, True),
    ({"error": {"message": "boom"}}, True),
])
def test_has_output(doc, out):
    assert has_output(msgspec.json.encode(doc)) is out
    assert has_output(b"[DONE]") and has_output(b"not json")


def test_load_from_metrics_sums_models_and_takes_the_fullest_kv():
    text = "\n".join([
        '# TYPE tinyserve:num_requests_running gauge',
        'tinyserve:num_requests_running{model="a"} 3.0',
        'tinyserve:num_requests_running{model="b"} 1.0',
        '# TYPE tinyserve:num_requests_waiting gauge',
        'tinyserve:num_requests_waiting{model="a"} 7.0',
        '# TYPE tinyserve:kv_cache_usage_perc gauge',
        'tinyserve:kv_cache_usage_perc{model="a"} 0.25',
        'tinyserve:kv_cache_usage_perc{model="b"} 0.75', ""])
    assert load_from_metrics(text) == {"running": 4.0, "waiting": 7.0, "kv_usage": 0.75}
    # a replica run with --metrics-namespace vllm reads the same
    assert load_from_metrics(text.replace("tinyserve:", "vllm:")) == load_from_metrics(text)


def test_fleet_config_validation():
    assert FleetConfig(min_replicas=2, max_replicas=4).initial_replicas == 2
    # Serve sends a replica at most what its server would queue (max-num-seqs + max-waiting).
    assert FleetConfig().max_ongoing_requests == 64 + 256
    assert FleetConfig(server_args=["--max-num-seqs", "4", "--max-waiting=10"]
                       ).max_ongoing_requests == 14
    assert FleetConfig(max_ongoing_requests=7).max_ongoing_requests == 7
    # The server drains as long as Serve waits for a removed replica's requests.
    assert FleetConfig(drain_timeout_s=12).replica_server_args() == ["--drain-timeout", "12"]
    assert FleetConfig(server_args=["--drain-timeout", "5"]).replica_server_args() == [
        "--drain-timeout", "5"]
    assert FleetConfig(drain_timeout_s=12).shutdown_timeout_s() > 12
    for bad in ({"min_replicas": 0}, {"min_replicas": 3, "max_replicas": 2},
                {"initial_replicas": 5, "max_replicas": 2}, {"num_gpus": -1},
                {"server_args": ["--port", 8000]}, {"target_ongoing_requests": 0},
                {"server_args": ["--port", "8000"]}, {"server_args": ["--host=::"]},
                {"server_args": ["--no-such-flag"]}, {"max_ongoing_requests": 0}):
        with pytest.raises(ValueError):
            FleetConfig(**bad)
    with pytest.raises(ValueError, match="unknown fleet option"):
        FleetConfig.from_dict({"replicas": 2})


def test_cli_splits_fleet_and_server_options():
    from tinyserve.fleet.__main__ import config_from_args

    args, cfg = config_from_args(["--replicas", "3", "--num-gpus", "1", "--port", "9000", "--",
                                  "--model", "/m", "--max-num-seqs", "8"])
    assert (cfg.min_replicas, cfg.max_replicas, cfg.initial_replicas) == (3, 3, 3)
    assert cfg.num_gpus == 1.0 and args.port == 9000
    assert cfg.server_args == ["--model", "/m", "--max-num-seqs", "8"]
    _, cfg = config_from_args(["--min-replicas", "1", "--max-replicas", "4"])
    assert (cfg.min_replicas, cfg.max_replicas, cfg.initial_replicas) == (1, 4, 1)
    with pytest.raises(SystemExit):
        config_from_args(["--min-replicas", "3", "--max-replicas", "1"])
