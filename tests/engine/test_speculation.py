"""Speculative decoding on the engine (issue 24): the same tokens with and without it, for
both proposers (n-gram, and a draft model: an int8 copy of the target), greedy and seeded
sampling, with stop strings, max_tokens cuts, a preemption, penalties, logprobs and
structured output. test_speculation_compose.py: the KV cache, weights, chunks, n > 1, LoRA,
a GQA model and the sampled distribution."""

import json

import msgspec
import pytest

from tinyserve import LLM, SamplingParams
from tinyserve.config import SpeculativeConfig
from tinyserve.messages import GrammarSpec

STORY = ("Once upon a time, there was a little girl named Lily. She loved to play outside. "
         "Once upon a time, there was a little")
PROMPTS = [STORY, "Tom had a red ball. Tom had a red ball. Tom had a", "One day", "The cat"]


def ngram(**kw) -> SpeculativeConfig:
    return SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=2, **kw)


def draft(model: str, **kw) -> SpeculativeConfig:
    return SpeculativeConfig(method="draft_model", model=model, quantization="int8",
                             num_speculative_tokens=3, **kw)


class Plain:
    """The engine without speculation, its answers kept: each is the reference for both
    proposers (greedy and seeded runs repeat exactly, so the second ask is the first's)."""

    def __init__(self, llm: LLM) -> None:
        self.llm = llm
        self._answers: dict[bytes, list] = {}

    def generate(self, prompts, params):
        key = msgspec.json.encode([prompts, params])
        if key not in self._answers:
            self._answers[key] = self.llm.generate(prompts, params)
        return self._answers[key]


@pytest.fixture(scope="module")
def plain(stories_dir):
    return Plain(LLM(str(stories_dir), dtype="float32"))


@pytest.fixture(scope="module", params=["ngram", "draft_model"])
def spec(request, stories_dir):
    sp = ngram() if request.param == "ngram" else draft(str(stories_dir))
    return LLM(str(stories_dir), dtype="float32", speculative=sp)


def tokens(llm: LLM | Plain, prompts, params) -> list[tuple[int, ...]]:
    return [o.token_ids for o in llm.generate(prompts, params)]


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=24, temperature=0.0),
    SamplingParams(max_tokens=24, temperature=0.9, top_p=0.9, seed=7),
    SamplingParams(max_tokens=13, temperature=0.0, stop=[" the", "."]),  # cut inside a draft
    SamplingParams(max_tokens=16, temperature=0.0, presence_penalty=0.6,
                   repetition_penalty=1.1, logit_bias={300: 2.0}, min_tokens=10),
], ids=["greedy", "sampled", "stop_strings", "penalties"])
def test_the_same_tokens_with_and_without_speculation(plain, spec, params):
    want = plain.generate(PROMPTS, params)
    got = spec.generate(PROMPTS, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.text for o in got] == [o.text for o in want]
    assert [o.finish_reason for o in got] == [o.finish_reason for o in want]
    s = spec.core.scheduler.spec
    assert s.num_verifies and s.num_accepted  # it speculated, and drafts were accepted


def test_logprobs_of_accepted_tokens_are_plain_decodings(plain, spec):
    params = SamplingParams(max_tokens=20, temperature=0.0, logprobs=3)
    want, got = plain.generate(PROMPTS[:2], params), spec.generate(PROMPTS[:2], params)
    for w, g in zip(want, got, strict=True):
        assert g.token_ids == w.token_ids
        for a, b in zip(w.logprobs, g.logprobs, strict=True):
            assert a.keys() == b.keys()
            assert max(abs(a[t] - b[t]) for t in a) < 1e-4


def test_structured_output_with_speculation_always_validates(plain, spec):
    import jsonschema
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                                "ok": {"type": "boolean"}},
              "required": ["name", "ok"], "additionalProperties": False}
    params = [SamplingParams(max_tokens=60, temperature=1.0, seed=i,
                             guided=GrammarSpec("json_schema", json.dumps(schema)))
              for i in range(4)]
    outs = spec.generate([STORY] * 4, params)
    for o in outs:
        assert o.finish_reason == "stop", o
        jsonschema.validate(json.loads(o.text), schema)
    assert [o.token_ids for o in outs] == tokens(plain, [STORY] * 4, params)


def test_a_preemption_and_a_tight_pool_change_nothing(stories_dir, plain):
    params = SamplingParams(max_tokens=20, temperature=0.0)
    want = tokens(plain, PROMPTS, params)
    tight = LLM(str(stories_dir), dtype="float32", speculative=ngram(), num_kv_blocks=9,
                block_size=8, max_model_len=64, max_num_batched_tokens=16)
    assert tokens(tight, PROMPTS, params) == want
    assert tight.core.scheduler.num_preemptions > 0
    assert tight.core.kv.pool.usage == 0.0
