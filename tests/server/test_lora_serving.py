"""LoRA adapters through the server (issue 23): selected by ``model``, bound to tenants
(another's adapter is a 404 and absent from /v1/models), more adapters than slots swapped in
with every answer its own adapter's, composed with n, structured output, penalties,
logprobs and echo; loaded and unloaded at run time under load without a failed or mixed
request; prefix-cache hits never across adapters."""

import asyncio

import aiohttp
import pytest

from tests.lora_models import ADAPTERS, llama_config, write_base_and_adapters
from tests.server.conftest import get, metric_value
from tests.server.helpers import post
from tests.server.inprocess import InProcessServer
from tinyserve import LLM, LoRARequest, SamplingParams
from tinyserve.config import EngineConfig, TenantConfig

transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")

BASE = "stories260k"  # the in-process server's name for its one model
ADMIN, ONE, ALL = "key-admin", "key-one", "key-all"
TENANTS = (TenantConfig("ops", ADMIN, admin=True),
           TenantConfig("one", ONE, adapters=("a_qv",)),
           TenantConfig("all", ALL))
PROMPTS = [[1, 40, 41, 42, 43], [1, 7, 9, 11], [1, 200, 201, 202, 203, 204, 205]]


def auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    return write_base_and_adapters(tmp_path_factory.mktemp("lora_srv"),
                                   llama_config(transformers))


@pytest.fixture(scope="module")
def reference(paths):
    """Greedy tokens of each (prompt, adapter) from the offline LLM (tested against PEFT)."""
    llm = LLM(str(paths["base"]), dtype="float32", max_loras=3, max_lora_rank=16)
    want = {}
    for name in [None, *ADAPTERS]:
        lora = None if name is None else LoRARequest(name, 1, str(paths[name]))
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=6, temperature=0.0,
                                                    ignore_eos=True), lora_request=lora)
        want[name] = [list(o.token_ids) for o in outs]
    return want


@pytest.fixture(scope="module")
def srv(paths):
    from tinyserve.engine.device_engine import DeviceEngine

    engine = DeviceEngine(EngineConfig(model=str(paths["base"]), dtype="float32",
                                       num_kv_blocks=128, max_loras=1, max_lora_rank=16,
                                       max_num_seqs=8))
    server = InProcessServer(engine=engine, tenants=TENANTS, lora_modules=tuple(
        (name, str(paths[name]), None) for name in ADAPTERS))
    yield server
    server.stop()


def completion(model: str, prompt: list[int], **kw) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": 6, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, **kw}


def models(srv, key: str) -> dict:
    import json
    _, text = get(srv.url + "/v1/models", headers=auth(key))
    return json.loads(text)


def test_models_lists_what_the_tenant_may_use(srv):
    cards = {c["id"]: c for c in models(srv, ADMIN)["data"]}
    assert set(cards) == {BASE, *ADAPTERS}
    assert all(cards[a]["parent"] == BASE for a in ADAPTERS) and cards[BASE]["parent"] is None
    assert {c["id"] for c in models(srv, ONE)["data"]} == {BASE, "a_qv"}


def test_another_tenants_adapter_is_a_404_as_if_it_did_not_exist(srv):
    async def main():
        status, got, _ = await post(srv.url, "/v1/completions", completion("a_all", [1, 5]),
                                    auth(ONE))
        assert status == 404 and got["error"]["code"] == "model_not_found", got
        status, nothing, _ = await post(srv.url, "/v1/completions",
                                        completion("no_such", [1, 5]), auth(ONE))
        assert status == 404 and nothing["error"]["message"].replace("no_such", "a_all") == \
            got["error"]["message"]
        status, got, _ = await post(srv.url, "/v1/completions", completion("a_qv", [1, 5]),
                                    auth(ONE))
        assert status == 200 and got["model"] == "a_qv", got
    asyncio.run(main())


def test_more_adapters_than_slots_each_answer_with_its_own(srv, reference):
    """One slot, three adapters and the base, all at once: every answer is its adapter's."""
    _, before = get(srv.url + "/metrics")

    async def main():
        async with aiohttp.ClientSession() as s:
            async def one(model, prompt):
                async with s.post(srv.url + "/v1/completions", json=completion(model, prompt),
                                  headers=auth(ALL)) as r:
                    return r.status, await r.json()
            jobs = [(m, i) for m in [BASE, *ADAPTERS] for i in range(len(PROMPTS))] * 2
            return jobs, await asyncio.gather(*(one(m, PROMPTS[i]) for m, i in jobs))
    jobs, answers = asyncio.run(main())
    for (model, i), (status, body) in zip(jobs, answers, strict=True):
        assert status == 200, body
        want = reference[None if model == BASE else model][i]
        assert body["choices"][0]["token_ids"] == want, (model, i)
    _, after = get(srv.url + "/metrics")
    loads = metric_value(after, "tinyserve:lora_loads_total") - \
        metric_value(before, "tinyserve:lora_loads_total")
    assert loads >= len(ADAPTERS) - 1, loads  # swapped through the one slot (one was in it)
    for name in ADAPTERS:
        assert metric_value(after, "tinyserve:lora_requests_total", f'lora_name="{name}"') >= 6
    assert 'max_lora="1"' in after  # vLLM's lora_requests_info


def test_adapters_compose_with_n_grammars_penalties_logprobs_and_echo(srv, reference):
    async def main():
        status, got, _ = await post(srv.url, "/v1/completions", completion(
            "a_out", PROMPTS[0], n=2, logprobs=2, echo=True), auth(ALL))
        assert status == 200, got
        for c in got["choices"]:
            assert c["token_ids"] == reference["a_out"][0]  # greedy: both choices agree
            assert len(c["logprobs"]["top_logprobs"]) == len(PROMPTS[0]) + 6  # prompt too
        status, got, _ = await post(srv.url, "/v1/completions", completion(
            "a_all", PROMPTS[1], guided_regex="[a-z]{1,4}", ignore_eos=False), auth(ALL))
        assert status == 200, got
        import re
        assert re.fullmatch("[a-z]{1,4}", got["choices"][0]["text"]), got
        status, got, _ = await post(srv.url, "/v1/completions", completion(
            "a_qv", PROMPTS[2], presence_penalty=1.5, repetition_penalty=1.3), auth(ALL))
        assert status == 200 and len(got["choices"][0]["token_ids"]) == 6, got
    asyncio.run(main())


def test_prefix_cache_hits_never_come_from_another_adapters_blocks(srv):
    prompt = [1] + list(range(60, 100))  # two full blocks and more

    async def cached(model: str) -> int:
        status, got, _ = await post(srv.url, "/v1/completions", completion(model, prompt),
                                    auth(ALL))
        assert status == 200, got
        return (got["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)

    async def main():
        first = await cached("a_qv")
        return first, await cached("a_all"), await cached(BASE), await cached("a_qv")
    first, other, base, again = asyncio.run(main())
    assert first == 0 and other == 0 and base == 0 and again >= 32


def test_load_and_unload_at_run_time_under_load(srv, paths, reference):
    async def main():
        async with aiohttp.ClientSession() as s:
            async def admin(path, body, key=ADMIN):
                async with s.post(srv.url + path, json=body, headers=auth(key)) as r:
                    return r.status, await r.text()
            status, text = await admin("/v1/load_lora_adapter", {
                "lora_name": "a_new", "lora_path": str(paths["a_all"])}, key=ALL)
            assert status == 403, text
            status, text = await admin("/v1/load_lora_adapter", {
                "lora_name": "a_new", "lora_path": str(paths["a_all"])})
            assert status == 200, text
            status, text = await admin("/v1/load_lora_adapter", {
                "lora_name": "bad", "lora_path": str(paths["base"])})
            assert status == 400 and "adapter" in text, text

            async def stream(model, i):
                body = {**completion(model, PROMPTS[i]), "stream": True, "max_tokens": 12}
                async with s.post(srv.url + "/v1/completions", json=body,
                                  headers=auth(ALL)) as r:
                    return r.status, await r.text()
            running = [asyncio.ensure_future(stream(m, i)) for m in ("a_new", "a_qv")
                       for i in range(3)]
            await asyncio.sleep(0.3)
            status, text = await admin("/v1/unload_lora_adapter", {"lora_name": "a_new"})
            assert status == 200, text
            assert all(f.done() for f in running[:3])  # it waited for the streams using it
            done = await asyncio.gather(*running)
            assert all(st == 200 and "data: [DONE]" in body for st, body in done), done
            async with s.post(srv.url + "/v1/completions", json=completion("a_new", [1, 5]),
                              headers=auth(ALL)) as r:
                assert r.status == 404
            async with s.get(srv.url + "/v1/models", headers=auth(ADMIN)) as r:
                assert "a_new" not in {c["id"] for c in (await r.json())["data"]}
            async with s.post(srv.url + "/v1/completions", json=completion("a_qv", PROMPTS[0]),
                              headers=auth(ALL)) as r:  # the others are untouched
                assert (await r.json())["choices"][0]["token_ids"] == reference["a_qv"][0]
    asyncio.run(main())
    assert srv.wait_idle() == {"running": 0, "waiting": 0, "kv_usage": 0.0, "requests": 0,
                               "live": 0}
