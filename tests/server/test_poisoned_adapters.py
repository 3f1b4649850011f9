"""Untrusted adapters through the server (issue 36): an adapter is read and checked whole
before its load answers 200 (NaN / Inf weights, an absurd alpha and malformed files are a 400
naming the file); one that can no longer be read later fails only its own requests, and is
never run on the weights its slot held before; a poisoned tenant's requests (an adapter whose
logits overflow, absurd parameters) beside a good tenant's leave every good answer as it is
alone, /health at 200 and no step failed."""

import asyncio
import collections
import json
import os
import shutil
import time

import aiohttp
import pytest

from tests.lora_models import llama_config, write_base_and_adapters
from tests.server.conftest import get, metric_value
from tests.server.helpers import post
from tests.server.inprocess import InProcessServer
from tinyserve.config import EngineConfig, TenantConfig

transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")
torch = pytest.importorskip("torch")
from safetensors.torch import load_file, save_file  # noqa: E402

ADMIN, GOOD, BAD = "key-admin", "key-good", "key-bad"
TENANTS = (TenantConfig("ops", ADMIN, admin=True), TenantConfig("good", GOOD),
           TenantConfig("bad", BAD))
PROMPTS = [[1, 40, 41, 42, 43], [1, 7, 9, 11], [1, 200, 201, 202, 203, 204, 205], [1, 5]]


def auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def variant(root, src, name, weights=None, config=None):
    """A copy of adapter ``src`` with its tensors and config changed."""
    dst = root / name
    shutil.copytree(src, dst)
    if weights is not None:
        tensors = load_file(dst / "adapter_model.safetensors")
        weights(tensors)
        save_file(tensors, dst / "adapter_model.safetensors")
    if config is not None:
        cfg = json.loads((dst / "adapter_config.json").read_text())
        cfg.update(config)
        (dst / "adapter_config.json").write_text(json.dumps(cfg))
    return dst


def fill(value, every=False):
    def change(tensors):
        for i, key in enumerate(sorted(tensors)):
            if every or i == 0:
                tensors[key] = torch.full_like(tensors[key], value)
    return change


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("poisoned")
    paths = write_base_and_adapters(root, llama_config(transformers))
    good = paths["a_qv"]
    paths.update(
        nan=variant(root, good, "nan", fill(float("nan"))),
        inf=variant(root, good, "inf", fill(float("inf"))),
        alpha=variant(root, good, "alpha", config={"lora_alpha": 1e300}),
        # finite weights whose products overflow float32: logits NaN / inf at run time
        huge=variant(root, good, "huge", fill(1e30, every=True)),
        gone=variant(root, paths["a_all"], "gone"))
    return paths


@pytest.fixture(scope="module")
def srv(paths):
    from tinyserve.engine.device_engine import DeviceEngine

    # one device slot, one adapter in host memory: every adapter change is a load
    engine = DeviceEngine(EngineConfig(model=str(paths["base"]), dtype="float32",
                                       num_kv_blocks=128, max_loras=1, max_cpu_loras=1,
                                       max_lora_rank=16, max_num_seqs=16))
    server = InProcessServer(engine=engine, tenants=TENANTS, lora_modules=(
        ("a_qv", str(paths["a_qv"]), None), ("huge", str(paths["huge"]), None)))
    yield server
    server.stop()


def completion(model, prompt, **kw):
    return {"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, **kw}


async def load(srv, name, path):
    return await post(srv.url, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path},
                      auth(ADMIN))


def solo(srv, model, prompt, key=GOOD):
    status, body, _ = asyncio.run(post(srv.url, "/v1/completions", completion(model, prompt),
                                       auth(key)))
    assert status == 200, body
    return body["choices"][0]["token_ids"]


def healthy_and_no_failed_step(srv):
    status, _ = get(srv.url + "/health")
    _, metrics = get(srv.url + "/metrics")
    assert status == 200
    assert metric_value(metrics, "tinyserve:failed_steps_total") == 0
    return metrics


def test_nan_inf_and_absurd_alpha_are_refused_at_load(srv, paths):
    async def main():
        for name, why in (("nan", "NaN or infinite"), ("inf", "NaN or infinite"),
                          ("alpha", "lora_alpha 1e+300 scales the adapter by 2.5e+299")):
            status, body, _ = await load(srv, name, str(paths[name]))
            assert status == 400 and why in body["error"]["message"], body
            assert str(paths[name]) in body["error"]["message"]
            assert body["error"]["param"] == "lora_path"
            status, body, _ = await post(srv.url, "/v1/completions", completion(name, [1, 5]),
                                         auth(GOOD))
            assert status == 404, body  # never registered
    asyncio.run(main())
    healthy_and_no_failed_step(srv)


@pytest.mark.parametrize("case", ["list", "null", "string", "deep", "entry", "offsets",
                                  "sparse", "long_path"])
def test_malformed_adapter_files_are_a_400_naming_the_file(srv, paths, tmp_path, case):
    d = variant(tmp_path, paths["a_qv"], "bad")
    cfg_file, weights = d / "adapter_config.json", d / "adapter_model.safetensors"
    named = str(cfg_file)
    if case in ("list", "null", "string", "deep"):
        cfg_file.write_text({"list": "[]", "null": "null", "string": '"lora"',
                             "deep": "[" * 200_000 + "]" * 200_000}[case])
    elif case in ("entry", "offsets"):
        raw = weights.read_bytes()
        size = int.from_bytes(raw[:8], "little")
        header = json.loads(raw[8:8 + size])
        key = next(k for k in header if k != "__metadata__")
        header[key] = 7 if case == "entry" else {**header[key], "data_offsets": [0, 1 << 40]}
        text = json.dumps(header).encode()
        weights.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + size:])
        named = str(weights)
    elif case == "sparse":
        os.truncate(weights, 2 << 30)  # a 2 GiB file, holes after the real tensors
        named = str(weights)
    path = str(d) if case != "long_path" else "/" + "x" * 5000
    status, body, _ = asyncio.run(load(srv, "bad", path))
    assert status == 400, body
    assert body["error"]["type"] == "invalid_request_error"
    if case == "long_path":
        assert "lora_path must be a path of 1 to 4096 characters" in body["error"]["message"]
    else:
        assert named in body["error"]["message"], body
    healthy_and_no_failed_step(srv)


def test_an_adapter_that_can_no_longer_be_read_fails_only_its_own_requests(srv, paths):
    """'gone' passes its load, leaves host memory (one adapter fits) and then its directory
    is removed: its requests are 500s naming the file - beside them a base request and one on
    another adapter answer as alone, and the next request on 'gone' is a 500 again, never an
    answer on the weights of the slot's previous occupant."""
    alone = {m: solo(srv, m, PROMPTS[0]) for m in ("stories260k", "a_qv")}
    assert asyncio.run(load(srv, "gone", str(paths["gone"])))[0] == 200
    assert asyncio.run(load(srv, "a_out", str(paths["a_out"])))[0] == 200  # (gone leaves
    shutil.rmtree(paths["gone"])                                           # host memory)

    async def main():
        async with aiohttp.ClientSession() as s:
            async def one(model):
                async with s.post(srv.url + "/v1/completions",
                                  json=completion(model, PROMPTS[0], max_tokens=12),
                                  headers=auth(GOOD)) as r:
                    return r.status, await r.json()
            return await asyncio.gather(*(one(m) for m in ("stories260k", "gone", "a_qv")))
    (s1, base), (s2, gone), (s3, other) = asyncio.run(main())
    assert s1 == 200 and base["choices"][0]["token_ids"][:4] == alone["stories260k"]
    assert s3 == 200 and other["choices"][0]["token_ids"][:4] == alone["a_qv"]
    assert s2 == 500 and "could not be loaded" in gone["error"]["message"], gone
    assert "adapter_model.safetensors" in gone["error"]["message"]
    for _ in range(2):  # the slot held a_qv last: still a 500, loaded anew each time
        status, body, _ = asyncio.run(post(srv.url, "/v1/completions",
                                           completion("gone", PROMPTS[1]), auth(GOOD)))
        assert status == 500, body
    metrics = healthy_and_no_failed_step(srv)
    assert metric_value(metrics, "tinyserve:request_faults_total", 'reason="adapter"') >= 3


def test_a_poisoned_tenant_beside_a_good_one(srv, paths):
    """200 good requests (base and a_qv) interleaved with 50 from a tenant on an adapter whose
    logits overflow, with absurd parameters and NaN adapter loads: every good answer is its
    solo answer, /health stays 200, no step fails."""
    alone = {(m, i): solo(srv, m, PROMPTS[i]) for m in ("stories260k", "a_qv")
             for i in range(len(PROMPTS))}
    _, before = get(srv.url + "/metrics")
    bad_bodies = [
        completion("huge", PROMPTS[0]),
        completion("stories260k", [1, 513]),
        completion("stories260k", [1, 5], logit_bias={"513": 5}),
        completion("stories260k", [1, 5], top_k=2**40, temperature=1.0),
        completion("stories260k", [1, 5], seed=2**64),
        completion("huge", PROMPTS[2], temperature=1e308)]
    health = []

    async def main():
        async with aiohttp.ClientSession() as s:
            async def good(i):
                model, p = ("stories260k", "a_qv")[i % 2], (i // 2) % len(PROMPTS)
                async with s.post(srv.url + "/v1/completions", json=completion(model, PROMPTS[p]),
                                  headers=auth(GOOD)) as r:
                    return (model, p), r.status, await r.json()

            async def bad(i):
                if i % 10 == 9:
                    return await load(srv, f"nan{i}", str(paths["nan"]))
                async with s.post(srv.url + "/v1/completions", json=bad_bodies[i % 6],
                                  headers=auth(BAD)) as r:
                    return r.status, await r.json(), None

            async def watch():
                while len(health) < 1000:
                    async with s.get(srv.url + "/health") as r:
                        health.append(r.status)
                    await asyncio.sleep(0.05)
            watcher = asyncio.create_task(watch())
            gate = asyncio.Semaphore(24)

            async def gated(job):
                async with gate:
                    return await job
            jobs = []
            for i in range(50):  # 4 good, 1 bad, interleaved
                jobs += [good(4 * i + k) for k in range(4)] + [bad(i)]
            out = await asyncio.gather(*(gated(j) for j in jobs))
            watcher.cancel()
            return out
    t0 = time.monotonic()
    out = asyncio.run(main())
    goods = [o for o in out if len(o) == 3 and isinstance(o[0], tuple)]
    bads = [o for o in out if o not in goods]
    assert len(goods) == 200 and len(bads) == 50
    for key, status, body in goods:
        assert status == 200, body
        assert body["choices"][0]["token_ids"] == alone[key], key
    assert all(status in (400, 404, 500) for status, _, _ in bads), bads
    assert health and set(health) == {200}, health
    metrics = healthy_and_no_failed_step(srv)
    faults = metric_value(metrics, "tinyserve:request_faults_total", 'reason="non_finite"') - \
        metric_value(before, "tinyserve:request_faults_total", 'reason="non_finite"')
    huge = sum(1 for i in range(50) if i % 10 != 9 and i % 6 == 0)  # (1e308: a 400 first)
    statuses = dict(sorted(collections.Counter(status for status, _, _ in bads).items()))
    print(f"poisoned run: {len(goods)} good requests all as alone, bad statuses {statuses}, "
          f"{faults:g} non-finite faults, {len(health)} health probes all 200, "
          f"{time.monotonic() - t0:.1f} s")
    assert faults == huge
