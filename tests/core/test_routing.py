"""Model routing (tinyserve.core.routing) and the multi-model options of tinyserve.config.

Pure Python: no server, no torch.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tinyserve.cli.models import build_models, parse_model_arg
from tinyserve.cli.values import parse_fallback, parse_route
from tinyserve.config import BUNDLED, EngineConfig, ModelSpec
from tinyserve.core import routing
from tinyserve.core.routing import Router, check_weights, describe, sticky_point
from tinyserve.models import STORIES260K

KEYS = [f"default\0user-{i}" for i in range(1000)]
W90 = (("a", 90.0), ("b", 10.0))
W80 = (("a", 80.0), ("b", 20.0))


def _split(router: Router, alias: str, keys=KEYS) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for key in keys:
        out.setdefault(router.resolve(alias, key), []).append(key)
    return out


# ---------------------------------------------------------------- sticky_point


def test_sticky_point_is_deterministic_and_in_unit_interval():
    points = [sticky_point("chat", k) for k in KEYS]
    assert points == [sticky_point("chat", k) for k in KEYS]
    assert all(0.0 <= p < 1.0 for p in points)
    assert len(set(points)) == len(points)  # 64-bit hashes: no collisions among 1000 keys
    # Spread over the interval, not bunched: every tenth of it holds some keys.
    assert {int(p * 10) for p in points} == set(range(10))


def test_sticky_point_depends_on_alias():
    differing = sum(sticky_point("chat", k) != sticky_point("chat2", k) for k in KEYS)
    assert differing == len(KEYS)


def test_sticky_point_accepts_lone_surrogates():
    key = "user-\ud800"  # not encodable as plain UTF-8 (e.g. from a JSON \ud800 escape)
    assert 0.0 <= sticky_point("chat", key) < 1.0
    assert sticky_point("chat", key) != sticky_point("chat", "user-")


# ---------------------------------------------------------------- Router.resolve


def test_weighted_split_is_close_to_weights():
    router = Router(["a", "b"], [("chat", W90)])
    split = _split(router, "chat")
    assert set(split) == {"a", "b"}
    assert abs(len(split["a"]) / len(KEYS) - 0.90) <= 0.03
    assert abs(len(split["b"]) / len(KEYS) - 0.10) <= 0.03


def test_three_way_split_is_close_to_weights():
    router = Router(["a", "b", "c"], [("chat", (("a", 1), ("b", 2), ("c", 1)))])
    split = _split(router, "chat")
    for name, share in (("a", 0.25), ("b", 0.5), ("c", 0.25)):
        assert abs(len(split[name]) / len(KEYS) - share) <= 0.03


def test_same_key_always_resolves_to_same_model():
    router = Router(["a", "b"], [("chat", (("a", 50.0), ("b", 50.0)))])
    first = {k: router.resolve("chat", k) for k in KEYS}
    for _ in range(4):
        assert {k: router.resolve("chat", k) for k in KEYS} == first
    # A fresh router with the same table routes every key the same way (no per-process state).
    again = Router(["a", "b"], [("chat", (("a", 50.0), ("b", 50.0)))])
    assert {k: again.resolve("chat", k) for k in KEYS} == first


def test_model_name_resolves_to_itself_and_unknown_to_none():
    router = Router(["a", "b"], [("chat", W90)])
    for key in ("", "default\0user-1", "x"):
        assert router.resolve("a", key) == "a"
        assert router.resolve("b", key) == "b"
        assert router.resolve("nope", key) is None
        assert router.resolve("", key) is None
    assert Router(["a"]).resolve("chat", "k") is None


def test_weight_scale_does_not_matter():
    small = Router(["a", "b"], [("chat", (("a", 0.9), ("b", 0.1)))])
    big = Router(["a", "b"], [("chat", W90)])
    assert sum(small.resolve("chat", k) != big.resolve("chat", k) for k in KEYS) <= 1


def test_zero_weight_never_gets_traffic():
    router = Router(["a", "b", "c"], [("chat", (("a", 0), ("b", 1.0), ("c", 0.0)))])
    assert set(_split(router, "chat")) == {"b"}
    router = Router(["a", "b", "c"], [("chat", (("a", 3), ("b", 0), ("c", 1)))])
    split = _split(router, "chat")
    assert set(split) == {"a", "c"}
    assert abs(len(split["a"]) / len(KEYS) - 0.75) <= 0.03


@pytest.mark.parametrize("point", [0.0, 1.0 - 2**-53, 1.0])
def test_interval_ends_never_land_on_zero_weight(monkeypatch, point):
    # 1.0 is reachable: int / 2**64 rounds to 1.0 for the top 2**10 hash values.
    monkeypatch.setattr(routing, "sticky_point", lambda alias, key: point)
    router = Router(["a", "b", "c", "d"],
                    [("chat", (("a", 0.0), ("b", 0.3), ("c", 0.7), ("d", 0.0)))])
    assert router.resolve("chat", "k") == ("b" if point == 0.0 else "c")


def test_set_route_returns_old_weights_and_moves_keys_minimally():
    router = Router(["a", "b"], [("chat", W90)])
    before = {k: router.resolve("chat", k) for k in KEYS}
    old = router.set_route("chat", W80)
    assert old == W90
    assert router.table() == {"chat": {"a": 80.0, "b": 20.0}}
    after = {k: router.resolve("chat", k) for k in KEYS}
    assert all(after[k] == "b" for k in KEYS if before[k] == "b")  # b's keys stay
    moved = [k for k in KEYS if before[k] != after[k]]
    assert moved and all(before[k] == "a" and after[k] == "b" for k in moved)
    # Only about a tenth of the keys move (90 -> 80 on a), not a reshuffle.
    assert abs(len(moved) / len(KEYS) - 0.10) <= 0.03
    share_b = sum(v == "b" for v in after.values()) / len(KEYS)
    assert abs(share_b - 0.20) <= 0.03
    # Going back restores the original routing exactly.
    assert router.set_route("chat", W90) == W80
    assert {k: router.resolve("chat", k) for k in KEYS} == before


def test_set_route_unknown_alias_is_key_error():
    router = Router(["a", "b"], [("chat", W90)])
    with pytest.raises(KeyError):
        router.set_route("other", W80)
    with pytest.raises(KeyError):
        router.set_route("a", W80)  # a model, not an alias
    assert router.table() == {"chat": {"a": 90.0, "b": 10.0}}


BAD_WEIGHTS = [
    pytest.param((("a", 0), ("b", 0)), id="all-zero"),
    pytest.param((), id="empty"),
    pytest.param((("a", 1.0), ("zzz", 1.0)), id="unknown-target"),
    pytest.param((("a", 1.0), ("a", 2.0)), id="duplicate-target"),
    pytest.param((("a", -1.0), ("b", 2.0)), id="negative"),
    pytest.param((("a", math.nan), ("b", 1.0)), id="nan"),
    pytest.param((("a", math.inf), ("b", 1.0)), id="inf"),
    pytest.param((("a", True), ("b", 1.0)), id="bool"),
    pytest.param((("a", "1"), ("b", 1.0)), id="string"),
    pytest.param((("a", None), ("b", 1.0)), id="none"),
]


@pytest.mark.parametrize("weights", BAD_WEIGHTS)
def test_bad_weights_are_refused(weights):
    with pytest.raises(ValueError):
        check_weights("chat", weights, ["a", "b"])
    with pytest.raises(ValueError):
        Router(["a", "b"], [("chat", weights)])
    router = Router(["a", "b"], [("chat", W90)])
    with pytest.raises(ValueError):
        router.set_route("chat", weights)
    assert router.routes["chat"] == W90  # a refused change leaves the route as it was


def test_check_weights_normalises_to_floats():
    assert check_weights("chat", (("a", 3), ("b", 0)), ["a", "b"]) == (("a", 3.0), ("b", 0.0))
    assert all(type(w) is float for _, w in check_weights("chat", (("a", 3), ("b", 1)), "ab"))


@pytest.mark.parametrize("models, routes, fallbacks", [
    pytest.param(["a", "b"], [("a", W90)], [], id="alias-is-a-model"),
    pytest.param(["a", "b"], [("chat", W90), ("chat", W80)], [], id="duplicate-alias"),
    pytest.param(["a", "b"], [], [("a", "zzz")], id="fallback-to-unknown"),
    pytest.param(["a", "b"], [], [("zzz", "a")], id="fallback-from-unknown"),
    pytest.param(["a", "b"], [("chat", W90)], [("chat", "a")], id="fallback-from-alias"),
    pytest.param(["a", "b"], [], [("a", "a")], id="fallback-to-itself"),
    pytest.param(["a", "b", "c"], [], [("a", "b"), ("a", "c")], id="two-fallbacks"),
])
def test_router_constructor_refuses(models, routes, fallbacks):
    with pytest.raises(ValueError):
        Router(models, routes, fallbacks)


def test_valid_fallback_is_recorded():
    router = Router(["a", "b"], [("chat", W90)], [("a", "b")])
    assert router.fallbacks == {"a": "b"}
    assert Router(["a", "b"]).fallbacks == {}
    assert router.models == ("a", "b")


def test_aliases_are_routed_independently():
    weights = (("a", 50.0), ("b", 50.0))
    router = Router(["a", "b"], [("chat", weights), ("chat2", weights)])
    one = {k: router.resolve("chat", k) for k in KEYS}
    two = {k: router.resolve("chat2", k) for k in KEYS}
    differing = sum(one[k] != two[k] for k in KEYS)
    # Independent 50/50 splits disagree on about half the keys.
    assert abs(differing / len(KEYS) - 0.5) <= 0.05
    # ... and changing one alias leaves the other alone.
    router.set_route("chat", (("a", 0.0), ("b", 1.0)))
    assert {k: router.resolve("chat2", k) for k in KEYS} == two
    assert set(_split(router, "chat")) == {"b"}


def test_table_and_describe():
    router = Router(["a", "b"], [("chat", W90), ("beta", (("b", 1), ("a", 0.5)))])
    assert router.table() == {"chat": {"a": 90.0, "b": 10.0}, "beta": {"b": 1.0, "a": 0.5}}
    assert describe(W90) == "a:90,b:10"
    assert describe((("b", 1.0), ("a", 0.5))) == "b:1,a:0.5"


def test_describe_round_trips_through_parse_route():
    for weights in (W90, (("org:model", 0.25), ("b", 3.0)), (("a", 0.0), ("b", 1.0))):
        assert parse_route("chat=" + describe(weights)) == ("chat", weights)


# ---------------------------------------------------------------- config: --model


def test_parse_model_arg_bare_directory():
    assert parse_model_arg("/some/dir") == (None, "/some/dir", {})
    assert parse_model_arg("stories260k") == (None, "stories260k", {})
    # A directory that contains '=' or ',' stays a bare directory when its "name" has a '/'.
    assert parse_model_arg("/x/a=b,c") == (None, "/x/a=b,c", {})


def test_parse_model_arg_with_name_and_options():
    assert parse_model_arg("a=/d,quantization=int8,kv_share=0.3") == (
        "a", "/d", {"quantization": "int8", "kv_share": "0.3"})
    assert parse_model_arg("a=/d") == ("a", "/d", {})
    assert parse_model_arg("m-1.x=/d,max_model_len=128") == ("m-1.x", "/d", {"max_model_len": "128"})


@pytest.mark.parametrize("text", [
    "a=/d,bogus=1",
    "a=/d,quantization",  # no '='
    "a=/d,kv_share=0.5,",  # empty option
    "a=",
    "a=,kv_share=0.5",
])
def test_parse_model_arg_refuses(text):
    with pytest.raises(ValueError):
        parse_model_arg(text)


@pytest.fixture
def elsewhere(tmp_path, monkeypatch):
    """Run from an empty directory, so a relative ``stories260k`` is not a local directory."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_build_models_default_is_bundled(elsewhere):
    specs = build_models(EngineConfig(), [])
    assert specs == (ModelSpec("stories260k", EngineConfig()),)
    assert Path(specs[0].engine.resolved_model) == STORIES260K
    assert STORIES260K.name == BUNDLED


def test_build_models_named_bundled_copies(elsewhere):
    specs = build_models(EngineConfig(), ["x=stories260k", "y=stories260k,quantization=int8"])
    assert [s.name for s in specs] == ["x", "y"]
    assert specs[0].engine.quantization is None
    assert specs[1].engine.quantization == "int8"
    for spec in specs:
        assert spec.engine.model == BUNDLED
        assert Path(spec.engine.resolved_model) == STORIES260K


def test_build_models_keeps_shared_options(elsewhere):
    base = EngineConfig(max_num_seqs=7, block_size=32, dtype="float32", quantization="int8")
    specs = build_models(base, ["x=/d1", "y=/d2,quantization=,max_model_len=99"])
    assert [s.engine.model for s in specs] == ["/d1", "/d2"]
    assert all(s.engine.max_num_seqs == 7 and s.engine.block_size == 32 for s in specs)
    assert specs[0].engine.quantization == "int8"
    assert specs[1].engine.quantization is None  # "quantization=" turns it off for one model
    assert specs[0].engine.max_model_len is None and specs[1].engine.max_model_len == 99


def test_resolved_model(elsewhere):
    assert EngineConfig().resolved_model == str(STORIES260K)
    assert EngineConfig(model=BUNDLED).resolved_model == str(STORIES260K)
    assert EngineConfig(model="/some/dir").resolved_model == "/some/dir"
    assert EngineConfig(random_demo=True).resolved_model == "tinyserve-demo"
    (elsewhere / BUNDLED).mkdir()  # a local directory of that name wins over the bundled one
    assert EngineConfig(model=BUNDLED).resolved_model == BUNDLED


def test_kv_split_by_blocks():
    specs = build_models(EngineConfig(num_kv_blocks=100), ["a=D,kv_share=0.25", "b=D"])
    assert [s.engine.num_kv_blocks for s in specs] == [25, 75]
    assert all(s.engine.kv_cache_memory is None for s in specs)


def test_kv_split_by_bytes():
    specs = build_models(EngineConfig(kv_cache_memory=1000), ["a=D,kv_share=0.25", "b=D"])
    assert [s.engine.kv_cache_memory for s in specs] == [250, 750]
    assert all(s.engine.num_kv_blocks is None for s in specs)


def test_kv_split_equal_without_shares():
    specs = build_models(EngineConfig(num_kv_blocks=90), ["a=D", "b=D", "c=D"])
    assert [s.engine.num_kv_blocks for s in specs] == [30, 30, 30]


def test_kv_split_by_blocks_does_not_lose_a_block_to_float_rounding():
    # 100 * 0.29 is 28.999... in floating point: truncating it would leave a block unused.
    specs = build_models(EngineConfig(num_kv_blocks=100), ["a=D,kv_share=0.29", "b=D"])
    assert [s.engine.num_kv_blocks for s in specs] == [29, 71]


def test_kv_split_from_free_memory_is_share_of_what_is_left():
    specs = build_models(EngineConfig(), ["a=D,kv_share=0.25", "b=D"])
    assert [s.engine.kv_share for s in specs] == [0.25, 0.75]  # of the budget (the CPU's)
    assert [s.engine.kv_share_of_free for s in specs] == [0.25, 1.0]  # of free GPU memory
    assert all(s.engine.num_kv_blocks is None and s.engine.kv_cache_memory is None for s in specs)
    # Shares below 1 in all stay what they say: each model's share of the whole budget.
    specs = build_models(EngineConfig(), ["a=D,kv_share=0.25", "b=D,kv_share=0.25"])
    assert [s.engine.kv_share for s in specs] == [0.25, 0.25]
    assert [s.engine.kv_share_of_free for s in specs] == [0.25, pytest.approx(1 / 3)]
    specs = build_models(EngineConfig(), ["a=D", "b=D", "c=D", "d=D"])
    assert [s.engine.kv_share for s in specs] == pytest.approx([1 / 4] * 4)
    # a takes 1/4 of all, b 1/3 of the 3/4 left, c half of the rest, d all that remains.
    assert [s.engine.kv_share_of_free for s in specs] == pytest.approx([1 / 4, 1 / 3, 1 / 2, 1.0])
    # Shares that sum to 1 but for rounding never divide by (almost) nothing.
    specs = build_models(EngineConfig(), ["a=D,kv_share=0.5", "b=D,kv_share=0.5",
                                          "c=D,kv_share=1e-10"])
    assert all(0 < s.engine.kv_share_of_free <= 1 for s in specs)


def test_kv_reserve_bytes_counts_later_models_weights(tmp_path):
    """From the safetensors headers: tensors as stored, the decoder's projections at their
    quantized size; what is not weights (config.json) is not counted."""
    import torch
    from safetensors.torch import save_file

    d1, d2, d3 = (tmp_path / n for n in ("m1", "m2", "m3"))
    for d, rows in ((d1, 5), (d2, 50), (d3, 2)):
        d.mkdir()
        save_file({"model.layers.0.mlp.up_proj.weight": torch.zeros(rows, 256),
                   "model.embed_tokens.weight": torch.zeros(10, 10)}, str(d / "model.safetensors"))
        (d / "config.json").write_bytes(b"{}" * 500)
    fp32 = {d: rows * 256 * 4 + 400 for d, rows in ((d1, 5), (d2, 50), (d3, 2))}
    specs = build_models(EngineConfig(), [f"a={d1}", f"b={d2},quantization=int8", f"c={d3}"])
    int8_d2 = 50 * 256 + 50 * 4 + 400  # a byte a weight, an fp32 scale a row; embedding fp32
    assert [s.engine.kv_reserve_bytes for s in specs] == [int8_d2 + fp32[d3], fp32[d3], 0]
    specs = build_models(EngineConfig(), [f"a={d1}", f"b={d2},quantization=int4"])
    assert specs[0].engine.kv_reserve_bytes == 50 * 2 * (64 + 5) + 400  # 2 groups of 128 a row
    # With an explicit KV budget nothing is reserved: the budget is already fixed.
    specs = build_models(EngineConfig(num_kv_blocks=10), [f"a={d1}", f"b={d2}"])
    assert [s.engine.kv_reserve_bytes for s in specs] == [0, 0]


@pytest.mark.parametrize("quantization", [None, "int8", "int4"])
def test_weight_estimate_bounds_what_loads(quantization):
    import torch

    from tinyserve.cli.models import _weight_bytes
    from tinyserve.engine.loading.checkpoint import load_weights
    from tinyserve.engine.loading.model_config import load_model_config
    from tinyserve.models import STORIES260K

    loaded = load_weights(STORIES260K, load_model_config(STORIES260K), torch.float32, "cpu",
                          quantization).nbytes()
    estimate = _weight_bytes(str(STORIES260K), {"quantization": quantization} if quantization else {})
    assert loaded <= estimate <= 1.05 * loaded


@pytest.mark.parametrize("args", [
    pytest.param(["a=D,kv_share=0.6", "b=D,kv_share=0.6"], id="sum-over-1"),
    pytest.param(["a=D,kv_share=0", "b=D"], id="zero"),
    pytest.param(["a=D,kv_share=1.5"], id="over-1"),
    pytest.param(["a=D,kv_share=-0.5", "b=D"], id="negative"),
    pytest.param(["a=D,kv_share=half", "b=D"], id="not-a-number"),
    pytest.param(["a=D,kv_share=nan", "b=D"], id="nan"),
    pytest.param(["a=D,kv_share=", "b=D"], id="empty"),
    pytest.param(["a=D,kv_share=0.5", "b=D,kv_share=0.5", "c=D"], id="nothing-left-for-c"),
    pytest.param(["a=D,kv_share=1", "b=D"], id="nothing-left-for-b"),
])
@pytest.mark.parametrize("base", [EngineConfig(), EngineConfig(num_kv_blocks=100)],
                         ids=["free-memory", "blocks"])
def test_bad_kv_shares_are_refused(base, args):
    with pytest.raises(ValueError):
        build_models(base, args)


@pytest.mark.parametrize("args, served", [
    pytest.param(["a=/d1", "a=/d2"], None, id="duplicate-name"),
    pytest.param(["/x/m", "/y/m"], None, id="duplicate-dir-basename"),
    pytest.param(["a=/d1", "b=/d2"], "foo", id="served-name-with-two-models"),
    pytest.param(["a=/d,quantization=int3"], None, id="bad-quantization"),
    pytest.param(["a=/d,kv_cache_dtype=fp8"], None, id="bad-kv-cache-dtype"),
    pytest.param(["a=/d,max_model_len=long"], None, id="bad-max-model-len"),
    pytest.param(["a=/d,max_model_len=0"], None, id="zero-max-model-len"),
])
def test_build_models_refuses(args, served):
    with pytest.raises(ValueError):
        build_models(EngineConfig(), args, served_model_name=served)


def test_served_model_name():
    # Names from a directory or --served-model-name are taken as given (org/model included);
    # only NAME= prefixes are checked.
    specs = build_models(EngineConfig(), ["/some/dir"], served_model_name="meta-llama/Llama-3")
    assert [s.name for s in specs] == ["meta-llama/Llama-3"]
    assert [s.name for s in build_models(EngineConfig(), ["/x/bad name"])] == ["bad name"]
    specs = build_models(EngineConfig(), ["/some/dir"], served_model_name="foo")
    assert [(s.name, s.engine.model) for s in specs] == [("foo", "/some/dir")]
    assert [s.name for s in build_models(EngineConfig(), [], served_model_name="foo")] == ["foo"]
    assert [s.name for s in build_models(EngineConfig(), ["/some/dir"])] == ["dir"]
    # An explicit NAME= wins over --served-model-name.
    assert [s.name for s in build_models(EngineConfig(), ["a=/d"], served_model_name="foo")] == ["a"]


# ---------------------------------------------------------------- config: --route, --fallback


def test_parse_route():
    assert parse_route("chat=a:90,b:10") == ("chat", (("a", 90.0), ("b", 10.0)))
    assert parse_route("chat=a:1") == ("chat", (("a", 1.0),))
    assert parse_route("chat=a:0,b:2.5") == ("chat", (("a", 0.0), ("b", 2.5)))
    # Model names may contain ':'; the weight is after the last one.
    assert parse_route("chat=org:m:3,b:1") == ("chat", (("org:m", 3.0), ("b", 1.0)))


@pytest.mark.parametrize("text", [
    "chat", "chat=", "chat=a", "chat=a:", "chat=:1", "chat=a:x", "chat=a:-1", "=a:1",
    "chat=a:1,", "chat=a:inf", "chat=a:nan", "ch at=a:1", "-chat=a:1",
])
def test_parse_route_refuses(text):
    with pytest.raises(ValueError):
        parse_route(text)


def test_parse_route_feeds_router():
    alias, weights = parse_route("chat=a:90,b:10")
    router = Router(["a", "b"], [(alias, weights)])
    assert router.routes == {"chat": W90}
    with pytest.raises(ValueError):  # parse_route leaves target checks to the router
        Router(["a", "b"], [parse_route("chat=a:1,c:1")])


def test_parse_fallback():
    assert parse_fallback("a=b") == ("a", "b")
    assert Router(["a", "b"], fallbacks=[parse_fallback("a=b")]).fallbacks == {"a": "b"}


@pytest.mark.parametrize("text", ["a", "a=", "=b", "=", ""])
def test_parse_fallback_refuses(text):
    with pytest.raises(ValueError):
        parse_fallback(text)


def test_set_route_keeps_the_target_order_whatever_order_the_weights_come_in():
    router = Router(["a", "b"], [("chat", (("a", 50.0), ("b", 50.0)))])
    keys = [f"t\0u{i}" for i in range(2000)]
    before = [router.resolve("chat", k) for k in keys]
    router.set_route("chat", (("b", 50.0), ("a", 50.0)))  # same weights, listed the other way
    assert [router.resolve("chat", k) for k in keys] == before


@pytest.mark.parametrize("weights", [(("a", 1e308), ("b", 1e308)), (("a", 5e-324), ("b", 1.0)),
                                     (("a", 1e10), ("b", 1.0))])
def test_weights_out_of_the_exact_range_are_refused(weights):
    with pytest.raises(ValueError, match="0 or a number"):
        check_weights("chat", weights, ["a", "b"])


def test_a_down_target_gives_its_share_to_the_others_and_gets_it_back():
    router = Router(["a", "b", "c"], [("chat", (("a", 50.0), ("b", 30.0), ("c", 20.0)))])
    keys = [f"t\0u{i}" for i in range(2000)]
    before = [router.resolve("chat", k) for k in keys]
    during = [router.resolve("chat", k, {"a"}) for k in keys]
    assert "a" not in during and {"b", "c"} <= set(during)
    assert all(d == b for b, d in zip(before, during, strict=True) if b != "a")  # others stay
    assert [router.resolve("chat", k) for k in keys] == before
    assert {router.resolve("chat", k, {"a", "b", "c"}) for k in keys} == set(before)  # all down
