"""The offline LLM API on stories260k: sampling, logprobs, chunked prefill, prefix cache,
preemption. Every scheduling path must give the same tokens as the plain one (in float32:
"auto" is bf16 on a GPU, where these equalities are not what is tested)."""

import pytest

from tinyserve import LLM, SamplingParams

PROMPTS = ["Once upon a time, there was a big", "The cat sat on the mat and looked at the sun",
           "Tom had a red ball", "One day"]


@pytest.fixture(scope="module")
def llm(stories_dir):
    return LLM(str(stories_dir), dtype="float32")


@pytest.fixture(scope="module")
def baseline(llm):
    return [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(max_tokens=14, temperature=0))]


def test_seeded_sampling_is_reproducible_and_batch_invariant(llm):
    p = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, top_k=40, seed=1234)
    [alone] = llm.generate(PROMPTS[0], p)
    again = llm.generate([PROMPTS[1], PROMPTS[0], PROMPTS[2]],
                         [SamplingParams(max_tokens=5, temperature=0.7), p,
                          SamplingParams(max_tokens=3)])
    assert again[1].token_ids == alone.token_ids
    other = llm.generate(PROMPTS[0], SamplingParams(max_tokens=10, temperature=1.0, seed=99))
    assert other[0].token_ids != alone.token_ids  # (a different seed draws differently)


def test_logprobs_hold_the_top_n_and_the_chosen_token(llm):
    [out] = llm.generate(PROMPTS[2], SamplingParams(max_tokens=4, temperature=1.0, seed=3,
                                                    logprobs=3))
    assert len(out.logprobs) == len(out.token_ids) == 4
    for tok, entry in zip(out.token_ids, out.logprobs):
        assert tok in entry and 3 <= len(entry) <= 4
        assert all(lp <= 0.0 for lp in entry.values())
        ranked = sorted(entry.values(), reverse=True)
        assert ranked[0] == max(entry.values())


def test_chunked_prefill_gives_the_same_tokens(stories_dir, baseline):
    small = LLM(str(stories_dir), dtype="float32", max_num_batched_tokens=7, max_num_seqs=3)
    outs = small.generate(PROMPTS, SamplingParams(max_tokens=14, temperature=0))
    assert [o.token_ids for o in outs] == baseline


def test_tiny_kv_pool_preempts_and_still_gives_the_same_tokens(stories_dir, baseline):
    tiny = LLM(str(stories_dir), dtype="float32", num_kv_blocks=5, block_size=8, max_model_len=40)
    outs = tiny.generate(PROMPTS, SamplingParams(max_tokens=14, temperature=0))
    assert [o.token_ids for o in outs] == baseline
    assert tiny.core.scheduler.num_preemptions > 0
    assert tiny.core.kv.pool.usage == 0.0


def test_prefix_cache_reuses_a_shared_prompt(llm):
    prompt = "Sue and Max built a tall tower of blocks in the garden, and then the wind came"
    [first] = llm.generate(prompt, SamplingParams(max_tokens=3, temperature=0))
    [second] = llm.generate(prompt, SamplingParams(max_tokens=3, temperature=0))
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens >= 16
    assert second.token_ids == first.token_ids


def test_bad_requests_raise_clear_errors(llm):
    with pytest.raises(ValueError, match="vocabulary"):
        llm.generate([[1, 99999]], SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([[1] * 600], SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=1.5)
    assert not llm.core.has_unfinished  # nothing was left behind
