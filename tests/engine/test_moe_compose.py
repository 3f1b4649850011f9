"""A mixture-of-experts model beside the features its forward pass touches (issue 37): n-gram
and draft-model speculation (lossless: the same tokens as without), the int8 KV cache with
int8 experts, n > 1 with seeds, and grammars. The model: Qwen2-MoE with a shared expert and
q/k/v bias (tests/engine/moe_families.py's ``qwen2moe_shared``), fp32."""

import re

import pytest

pytest.importorskip("transformers")

from tests.engine.moe_families import build  # noqa: E402
from tests.engine.test_families import prompt  # noqa: E402
from tests.engine.test_speculation import draft, tokens  # noqa: E402
from tinyserve import LLM, SamplingParams  # noqa: E402
from tinyserve.config import SpeculativeConfig  # noqa: E402
from tinyserve.sampling_params import GrammarSpec  # noqa: E402

NAME = "qwen2moe_shared"
# A random model repeats nothing: a prompt that holds a run twice gives the n-gram proposer
# something to propose (mostly rejected: rollbacks are what is tested)
PROMPTS = [prompt(30, 20), prompt(31, 7) * 3, [256, 100]]
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp(NAME)
    build(NAME, path)
    return str(path)


@pytest.fixture(scope="module")
def plain(model):
    return LLM(model, dtype="float32")


def test_speculation_is_lossless_on_int8_experts_and_kv(model):
    """Both proposers verify on int8 experts over the int8 KV cache (the float path's verify
    rows are the same kernels: tests/engine/test_speculation*.py on the dense models)."""
    options = {"kv_cache_dtype": "int8", "quantization": "int8"}
    base = LLM(model, dtype="float32", **options)
    want = tokens(base, PROMPTS, GREEDY)
    for sp in (SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1), draft(model)):
        llm = LLM(model, dtype="float32", speculative=sp, **options)
        assert tokens(llm, PROMPTS, GREEDY) == want, sp.method
        s = llm.core.scheduler.spec
        assert s.num_verifies, sp.method
        if sp.method == "draft_model":  # an int8 copy of itself: int8 experts propose
            assert s.num_accepted, sp.method


def test_int8_kv_and_experts_alone_equal_in_a_batch(model):
    llm = LLM(model, dtype="float32", kv_cache_dtype="int8", quantization="int8")
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2)
    prompts = [prompt(40 + i, 4 + 5 * i) for i in range(8)]
    together = llm.generate(prompts, params)
    for i in (0, 7):
        [alone] = llm.generate([prompts[i]], params)
        assert alone.token_ids == together[i].token_ids and alone.logprobs == together[i].logprobs


def test_n_seeded_choices_each_equal_the_request_alone(plain):
    params = [SamplingParams(max_tokens=5, temperature=0.9, seed=s) for s in (1, 2, 3)]
    together = tokens(plain, [PROMPTS[0]] * 3, params)
    assert len(set(together)) > 1  # different seeds, different draws
    for p, want in zip(params, together, strict=True):
        assert tokens(plain, [PROMPTS[0]], p) == [want]


@pytest.mark.parametrize("spec,pattern", [
    (GrammarSpec(kind="regex", value="[a-e]{3}-[0-9]{2}"), r"[a-e]{3}-[0-9]{2}"),
    (GrammarSpec(kind="choice", value='["alpha", "beta"]'), r"alpha|beta"),
])
def test_grammars_hold_on_experts(plain, spec, pattern):
    pytest.importorskip("llguidance")
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=4, guided=spec)
    outs = plain.generate([PROMPTS[0], PROMPTS[2]], params)
    for out in outs:
        assert re.fullmatch(pattern, out.text), out.text


def test_expert_load_counts_real_rows_only(model):
    """The per-layer counters add top_k per computed token (prefill and decode rows) and
    nothing for a decode bucket's padding (3 sequences ride a bucket of 4); the runner hands
    them to the step's result when they are due."""
    from tinyserve.engine.running import runner as runner_module

    llm = LLM(model, dtype="float32")
    load = llm.engine.runner.model.expert_load
    assert load is not None and load.layers == (0, 1) and load.counts.shape == (2, 6)
    before = load.counts.clone()
    prompts = [prompt(50, 9), prompt(51, 17), prompt(52, 4)]
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    llm.generate(prompts, params)
    rows = sum(len(p) + 5 - 1 for p in prompts)  # the last token drawn is never fed back
    assert (load.counts - before).sum(dim=1).tolist() == [2 * rows] * 2  # top 2
    # the counters ride a step's readback (every step here): StepResult.expert_load
    seen = []
    process = llm.core.process

    def spy(plan, result):
        seen.append(result.expert_load)
        return process(plan, result)
    llm.core.process = spy
    old = runner_module.EXPERT_LOAD_EVERY_S
    runner_module.EXPERT_LOAD_EVERY_S = 0.0
    try:
        llm.generate([prompts[0]], params)
    finally:
        runner_module.EXPERT_LOAD_EVERY_S = old
    got = [x for x in seen if x is not None]
    assert got and got[-1] == tuple(zip(load.layers, map(tuple, load.counts.tolist())))
