"""prompt_logprobs=-1 (vLLM's whole vocabulary per prompt position) in the engine: the host
path that lists every token agrees bit for bit with the top-N kernel, computes nothing with
torch, and the engine core refuses more than MAX_PROMPT_LOGPROB_ENTRIES."""

import dataclasses

import pytest

from tests.engine.test_no_torch_compute import ALLOWED, RecordOps
from tinyserve.config import EngineConfig
from tinyserve.core.engine_core import CoreConfig, EngineCore
from tinyserve.engine.device_engine import DeviceEngine
from tinyserve.messages import MAX_PROMPT_LOGPROB_ENTRIES, FieldError, SamplingParams


@pytest.fixture(scope="module")
def core(tmp_path_factory):
    from tinyserve.engine.loading.demo import DEMO_CONFIG, write_random_llama, write_tokenizer

    path = tmp_path_factory.mktemp("demo")
    write_random_llama(path, DEMO_CONFIG)
    write_tokenizer(path)
    cfg = EngineConfig(model=str(path), num_kv_blocks=16, max_model_len=128)
    engine = DeviceEngine(cfg)
    return EngineCore(CoreConfig.from_engine(cfg, engine.info), engine.tokenizer), engine


def test_whole_vocabulary_matches_the_top_n_kernel(core):
    core, engine = core
    prompt = [256, 7, 3, 9, 4]
    core.add_request(1, prompt, SamplingParams(max_tokens=1, temperature=0.0,
                                               prompt_logprobs=-1))
    core.add_request(2, prompt, SamplingParams(max_tokens=1, temperature=0.0,
                                               prompt_logprobs=5))
    with RecordOps() as rec:  # one step: both prefills, -1 and top 5 side by side
        while core.has_unfinished:
            plan = core.schedule()
            core.process(plan, engine.runner.execute(plan))
    assert rec.ops <= ALLOWED, sorted(rec.ops - ALLOWED)
    whole, top5 = core.requests[1].seq.prompt_lps, core.requests[2].seq.prompt_lps
    vocab = core.cfg.vocab_size
    assert len(whole) == len(top5) == len(prompt) - 1
    for token, (lp, rank, entries), (lp5, rank5, five) in zip(prompt[1:], whole, top5,
                                                             strict=True):
        assert (lp, rank) == (lp5, rank5)
        assert len(entries) == vocab and sorted(i for i, _ in entries) == list(range(vocab))
        assert entries[:5] == five  # the same order and the same float32 values
        assert dict(entries)[token] == lp  # the prompt's own token: its logprob, bit for bit
        values = [v for _, v in entries]
        assert values == sorted(values, reverse=True)
    for rid in (1, 2):
        core.release(rid)


def test_the_engine_core_refuses_past_the_bound(core):
    core, _ = core
    big = EngineCore(dataclasses.replace(core.cfg, vocab_size=32_000), core.tokenizer)
    most = MAX_PROMPT_LOGPROB_ENTRIES // 32_000  # scored positions: a prompt's tokens - 1
    big.check([1] * (most + 1), SamplingParams(prompt_logprobs=-1))
    with pytest.raises(FieldError) as e:
        big.check([1] * (most + 2), SamplingParams(prompt_logprobs=-1))
    assert e.value.field == "prompt_logprobs"
    big.check([1] * 100, SamplingParams(prompt_logprobs=20))  # a top N is not bounded so
