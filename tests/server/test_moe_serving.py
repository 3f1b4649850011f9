"""Mixture-of-experts models through the server (issue 37): a Mixtral and a Qwen3-MoE
random-weight checkpoint answer greedy completions with transformers' tokens, whole and
streamed, several at once."""

import asyncio

import pytest

from tests.engine.moe_families import build
from tests.engine.test_families import hf_greedy, prompt
from tests.server.helpers import post
from tests.server.inprocess import InProcessServer
from tinyserve.config import EngineConfig

pytest.importorskip("transformers")


@pytest.mark.parametrize("name", ["mixtral_e6_top2", "qwen3moe_e60_dense"])
def test_greedy_completions_equal_transformers(name, tmp_path):
    from tinyserve.engine.device_engine import DeviceEngine

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
    finally:
        server.stop()
