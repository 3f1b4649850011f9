"""Mixture-of-experts models through the server (issue 37): a Mixtral, a Qwen3-MoE and a gpt-oss
random-weight checkpoint answer greedy completions with transformers' tokens, several at once,
and /metrics shows each sparse layer's expert load imbalance."""

import asyncio

import aiohttp
import pytest

from tests.engine.moe_families import build
from tests.engine.test_families import hf_greedy, prompt
from tests.server.helpers import post
from tests.server.inprocess import InProcessServer
from tinyserve.config import EngineConfig

pytest.importorskip("transformers")


@pytest.mark.parametrize("name", ["mixtral_e6_top2", "qwen3moe_e60_dense", "gptoss_e60_top4"])
def test_greedy_completions_equal_transformers(name, tmp_path, monkeypatch):
    from tinyserve.engine.device_engine import DeviceEngine
    from tinyserve.engine.running import runner

    monkeypatch.setattr(runner, "EXPERT_LOAD_EVERY_S", 0.0)  # every step's readback carries it

    hf = build(name, tmp_path)
    engine = DeviceEngine(EngineConfig(model=str(tmp_path), dtype="float32", num_kv_blocks=64,
                                       max_num_seqs=4))
    server = InProcessServer(engine=engine)
    prompts = [prompt(20 + i, 9 + 5 * i) for i in range(3)]
    want = [hf_greedy(hf, p, 12)[0] for p in prompts]
    try:
        async def main():
            bodies = [{"model": "stories260k", "prompt": p, "max_tokens": 12, "min_tokens": 12,
                       "temperature": 0, "return_token_ids": True} for p in prompts]
            return await asyncio.gather(*(post(server.url, "/v1/completions", b)
                                          for b in bodies))
        for (status, body, _), tokens in zip(asyncio.run(main()), want, strict=True):
            assert status == 200, body
            assert body["choices"][0]["token_ids"] == tokens, name

        async def metrics():
            async with aiohttp.ClientSession() as s, s.get(server.url + "/metrics") as r:
                return await r.text()
        gauge = {}
        for line in asyncio.run(metrics()).splitlines():
            if line.startswith("tinyserve:moe_expert_load_imbalance{"):
                gauge[line.split('layer="')[1].split('"')[0]] = float(line.rsplit(" ", 1)[1])
        sparse = [str(i) for i, layer in enumerate(engine.runner.model.w.layers)
                  if layer.experts is not None]
        E = engine.runner.model.cfg.num_experts
        assert sorted(gauge) == sorted(sparse), gauge
        assert all(1.0 <= v <= E for v in gauge.values()), gauge
    finally:
        server.stop()
