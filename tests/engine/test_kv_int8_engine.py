"""--kv-cache-dtype int8 through the whole engine: quality against fp32 on stories260k, the
block pool's capacity for one --kv-cache-memory, and sequences that really run together."""

import json

import pytest
import torch

from tests.quality import compare, score
from tests.scripts import loadtest_script
from tinyserve.cli.models import build_models
from tinyserve.config import EngineConfig
from tinyserve.engine.model.kv_cache import KVCacheSpec
from tinyserve.llm import LLM
from tinyserve.messages import SamplingParams
from tinyserve.models import STORIES260K

REF = json.loads((STORIES260K / "reference.json").read_text())
REF_IDS = REF["prompt_token_ids"] + REF["greedy_new_token_ids"]


@pytest.fixture(scope="module")
def fp32():
    return LLM(num_kv_blocks=64)


@pytest.fixture(scope="module")
def int8_kv():
    return LLM(num_kv_blocks=64, kv_cache_dtype="int8")


def test_int8_kv_agrees_with_fp32_on_the_reference_text(fp32, int8_kv):
    a = compare([score(fp32, REF_IDS)], [score(int8_kv, REF_IDS)])
    assert a.positions == len(REF_IDS) - 1
    assert a.agreement >= 0.98, a
    assert 0 < a.mean_abs_dlogprob < 0.05, a  # quantized for real, and close


def test_int8_kv_greedy_decode_matches_the_reference(int8_kv):
    """Decode reads the int8 cache through the split-KV kernel and the decode buckets: the 48
    greedy tokens transformers wrote are reproduced, alone and batched."""
    outs = int8_kv.generate([REF["prompt_token_ids"]] * 3, SamplingParams(max_tokens=48,
                                                                          temperature=0.0))
    for out in outs:
        assert list(out.token_ids) == REF["greedy_new_token_ids"]


def test_int8_kv_cache_holds_int8_codes_and_scales(int8_kv):
    layer = int8_kv.engine.runner.kv_cache[0]
    assert layer.k.dtype == layer.v.dtype == torch.int8
    assert layer.k_scale.dtype == layer.v_scale.dtype == torch.float16
    assert layer.k_scale.shape == layer.k.shape[:3]
    assert int8_kv.info.kv_cache_dtype == "int8"


def test_bytes_per_token_halved_against_fp16_and_quartered_against_fp32():
    def per_token(dtype, quantized, head_dim):  # Llama-3-8B: 32 layers, 8 KV heads
        return KVCacheSpec(1, 16, 32, 8, head_dim, dtype, quantized).bytes_per_token

    assert per_token(torch.float16, False, 128) == 2 * 32 * 8 * 128 * 2
    assert per_token(torch.float16, True, 128) == 2 * 32 * 8 * (128 + 2)  # + fp16 scales
    assert per_token(torch.float16, True, 128) / per_token(torch.float16, False, 128) < 0.51
    assert per_token(torch.float32, True, 128) / per_token(torch.float32, False, 128) < 0.26
    # stories260k's head_dim 8: a 2-byte scale per 8 values costs more (10 bytes vs 16)
    assert per_token(torch.float16, True, 8) / per_token(torch.float16, False, 8) == 10 / 16


def test_same_kv_cache_memory_gives_more_blocks(caplog):
    import logging

    budget = 1 << 20
    with caplog.at_level(logging.INFO, logger="tinyserve.engine.device_engine"):
        auto = LLM(kv_cache_memory=budget, max_model_len=128)
        int8 = LLM(kv_cache_memory=budget, max_model_len=128, kv_cache_dtype="int8")
    # stories260k fp32: 1280 bytes per token; int8: 400
    assert auto.info.num_kv_blocks == budget // (16 * 1280)
    assert int8.info.num_kv_blocks == budget // (16 * 400)
    assert int8.core.kv.pool.num_blocks == int8.info.num_kv_blocks
    assert "KV cache (int8 + fp16 scales, 400 B/token): 163 blocks" in caplog.text


def test_int8_runs_at_least_1_9x_the_sequences_of_fp16_without_preemption(tmp_path):
    """The capacity benchmark at a small size: a head_dim-128 model, one 512 KiB budget."""
    capacity = loadtest_script("bench_kv_capacity")
    measure, write_model = capacity.measure, capacity.write_model

    model = write_model(tmp_path)
    rows = [measure(model, d, 512 << 10, 16, 16, one_more=False) for d in ("auto", "int8")]
    for row in rows:
        assert row["at_capacity"]["preemptions"] == 0
        assert row["at_capacity"]["peak_running"] == row["fits"]  # all decoding together
    fp16, int8 = (r["sequences_without_preemption"] for r in rows)
    assert fp16 == 16 and int8 >= 1.9 * fp16


def test_config_and_model_options():
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="fp8")
    specs = build_models(EngineConfig(), ["a=stories260k,kv_cache_dtype=int8", "b=stories260k"])
    assert [s.engine.kv_cache_dtype for s in specs] == ["int8", "auto"]
