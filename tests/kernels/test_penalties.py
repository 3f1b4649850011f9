"""Penalties, logit_bias, min_tokens bans and the grammar mask against a plain-torch reference
written the way vLLM computes them (dense bincounts over the vocabulary)."""

import math
import random

import numpy as np
import pytest
import torch

from tinyserve.engine.running.logits_processing import penalty_lists
from tinyserve.kernels import apply_penalties, sample
from tinyserve.messages import PLACEHOLDER, SamplingParams, ScheduledSeq


def scheduled(params, output, prompt, banned=()):
    return ScheduledSeq(seq_id=0, token_ids=(1,), start_pos=0, new_blocks=(), sample=True,
                        params=params, seed=1, output_ids=tuple(output),
                        prompt_ids=tuple(prompt) if params.repetition_penalty != 1 else None,
                        banned=tuple(banned))


def reference(logits, rows):
    """vLLM v1: logit_bias and min_tokens (logits processors), then repetition (prompt or
    output seen), then frequency and presence (output only)."""
    out = logits.clone()
    B, V = logits.shape
    for r, (params, output, prompt, banned) in enumerate(rows):
        x = out[r]
        for t, b in params.logit_bias:
            x[t] = -math.inf if b <= -100 else x[t] + b
        for t in banned:
            x[t] = -math.inf
        counts = torch.bincount(torch.tensor(output, dtype=torch.int64), minlength=V).float()
        out_mask = counts > 0
        prompt_mask = torch.zeros(V, dtype=torch.bool)
        if params.repetition_penalty != 1:
            prompt_mask[list(prompt)] = True
        rep = torch.where(prompt_mask | out_mask, params.repetition_penalty, 1.0)
        x *= torch.where(x > 0, 1.0 / rep, rep)
        x -= params.frequency_penalty * counts
        x -= params.presence_penalty * out_mask.float()
    return out


def random_rows(B, V, seed):
    rng = random.Random(seed)
    rows = []
    for r in range(B):
        if r % 4 == 3:  # a row that asks for nothing, between ones that do
            rows.append((SamplingParams(), [], [], ()))
            continue
        bias = {rng.randrange(V): rng.choice([-100.0, -3.5, 0.25, 7.0, 100.0])
                for _ in range(rng.randrange(0, 6))}
        params = SamplingParams(
            presence_penalty=rng.choice([0.0, 0.5, -1.25, 2.0]),
            frequency_penalty=rng.choice([0.0, 0.3, -0.7, 1.9]),
            repetition_penalty=rng.choice([1.0, 1.3, 0.8, 2.0]),
            logit_bias=bias, max_tokens=64, min_tokens=rng.choice([0, 5]))
        output = [rng.randrange(V) for _ in range(rng.randrange(0, 40))]
        prompt = [rng.randrange(V) for _ in range(rng.randrange(1, 30))]
        banned = sorted({rng.randrange(V) for _ in range(2)}) if params.min_tokens else ()
        rows.append((params, output, prompt, banned))
    return rows


def processed_logits(logits, rows, device):
    seqs = [scheduled(*row) for row in rows]
    lists = penalty_lists(seqs)
    out = logits.clone()
    put = lambda a: torch.from_numpy(a).to(device)  # noqa: E731
    apply_penalties(out, put(lists.tokens), put(lists.counts), put(lists.in_prompt),
                    put(lists.bias), put(lists.rep), put(lists.freq), put(lists.pres))
    return out


@pytest.mark.parametrize("B,V,seed", [(1, 512, 0), (7, 301, 1), (13, 37, 2), (33, 1000, 3)])
def test_penalties_match_the_torch_reference(device, B, V, seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, V, generator=g) * 4  # both signs: the repetition rule differs
    rows = random_rows(B, V, seed)
    got = processed_logits(logits.to(device), rows, device).cpu()
    want = reference(logits, rows)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    finite = ~torch.isinf(want)
    torch.testing.assert_close(got[finite], want[finite], atol=1e-5, rtol=1e-5)
    for r, row in enumerate(rows):  # rows that ask for nothing are untouched, bit for bit
        if not row[0].penalized:
            assert torch.equal(got[r], logits[r])


def test_no_processing_lists_nothing():
    assert penalty_lists([scheduled(SamplingParams(), [3, 4], [1])]) is None


def test_a_placeholder_left_in_the_history_is_not_counted():
    p = SamplingParams(frequency_penalty=1.0)
    lists = penalty_lists([scheduled(p, [5, 5, PLACEHOLDER], [])])
    assert lists.tokens[0].tolist() == [5] and lists.counts[0].tolist() == [2]


def test_greedy_and_sampling_choose_from_processed_logits_report_raw_logprobs(device):
    B, V = 6, 257
    g = torch.Generator().manual_seed(9)
    logits = (torch.randn(B, V, generator=g) * 2).to(device)
    rows = [(SamplingParams(logit_bias={int(logits[r].argmin()): 100.0}), [], [], ())
            for r in range(B)]
    proc = processed_logits(logits, rows, device)
    t = torch.zeros(B, device=device)
    k = torch.zeros(B, dtype=torch.int32, device=device)
    p = torch.ones(B, device=device)
    s = torch.arange(B, dtype=torch.int64, device=device) + 11
    tokens, lp, _, _ = sample(logits, t, k, p, s, all_greedy=True, processed=proc)
    assert torch.equal(tokens, logits.argmin(-1))  # the +100 bias wins
    raw_lp = logits.log_softmax(-1).gather(1, tokens[:, None])[:, 0]
    torch.testing.assert_close(lp, raw_lp, atol=1e-5, rtol=1e-5)
    # sampled: a +100 bias makes the draw certain as well
    tokens, *_ = sample(logits, t + 1.0, k, p, s, processed=proc)
    assert torch.equal(tokens, logits.argmin(-1))


def bitmask(allowed_sets, V):
    words = np.zeros((len(allowed_sets), -(-V // 32)), np.uint32)
    for r, allowed in enumerate(allowed_sets):
        for t in allowed:
            words[r, t // 32] |= np.uint32(1 << (t % 32))
    return torch.from_numpy(words.view(np.int32))


@pytest.mark.parametrize("V", [97, 512, 1000])
def test_grammar_mask_constrains_every_path(device, V):
    B = 24
    rng = random.Random(V)
    g = torch.Generator().manual_seed(V)
    logits = (torch.randn(B, V, generator=g) * 3).to(device)
    allowed = [set(rng.sample(range(V), rng.randrange(1, 6))) | {V - 1} for _ in range(B)]
    mask = bitmask(allowed, V).to(device)
    dense = torch.full((B, V), -math.inf)
    for r, a in enumerate(allowed):
        dense[r, sorted(a)] = 0.0
    masked = logits.cpu() + dense
    zeros = torch.zeros(B, device=device)
    k = torch.zeros(B, dtype=torch.int32, device=device)
    p = torch.ones(B, device=device)
    seeds = torch.arange(B, dtype=torch.int64, device=device) * 31 + 7
    tokens, lp, top_ids, top_lp = sample(logits, zeros, k, p, seeds, 3, all_greedy=True,
                                         allowed=mask)
    assert torch.equal(tokens.cpu(), masked.argmax(-1))
    ref_lp = masked.log_softmax(-1)  # logprobs renormalised over the allowed set, as vLLM's
    torch.testing.assert_close(lp.cpu(), ref_lp.gather(1, tokens.cpu()[:, None])[:, 0],
                               atol=1e-5, rtol=1e-5)
    for r in range(B):  # top entries are allowed tokens (a -inf tail past the allowed ones)
        n_ok = min(3, len(allowed[r]))
        assert set(top_ids[r, :n_ok].tolist()) <= allowed[r]
    for temperature, top_k, top_p in ((1.0, 0, 1.0), (0.8, 2, 1.0), (1.5, 0, 0.5)):
        for trial in range(3):
            tokens, *_ = sample(logits, zeros + temperature, k + top_k, p * top_p,
                                seeds + trial * 1000, allowed=mask)
            assert all(t in allowed[r] for r, t in enumerate(tokens.tolist()))


def test_kept_histories_count_only_new_tokens_and_survive_a_dropped_step():
    from tinyserve.engine.running.logits_processing import History

    p = SamplingParams(frequency_penalty=1.0, repetition_penalty=1.5)
    kept: dict = {}

    def counts(output):
        lists = penalty_lists([scheduled(p, output, [9, 9, 4])], kept)
        row = {t: (c, i) for t, c, i in zip(lists.tokens[0].tolist(), lists.counts[0].tolist(),
                                             lists.in_prompt[0].tolist()) if t >= 0}
        fresh = penalty_lists([scheduled(p, output, [9, 9, 4])])  # built afresh: the same
        assert fresh.tokens.tolist() == lists.tokens.tolist()
        assert fresh.counts.tolist() == lists.counts.tolist()
        return row

    assert counts([5, 5]) == {4: (0, 1), 5: (2, 0), 9: (0, 1)}
    assert counts([5, 5, 7, PLACEHOLDER]) == {4: (0, 1), 5: (2, 0), 7: (1, 0), 9: (0, 1)}
    assert counts([5, 5, 7, 9]) == {4: (0, 1), 5: (2, 0), 7: (1, 0), 9: (1, 1)}
    assert counts([5, 5, 8]) == {4: (0, 1), 5: (2, 0), 8: (1, 0), 9: (0, 1)}  # dropped, redrawn
    assert isinstance(kept[0], History) and kept[0].n == 3


def test_a_first_vocabulary_chunk_the_mask_forbids_whole_keeps_logprobs_finite(device):
    # The vocabulary is scanned in chunks (65536 under the interpreter, 2048 on a GPU): a row
    # whose allowed tokens all lie past the first chunk must not turn its logsumexp into NaN.
    B, V = 2, 65536 + 300
    logits = (torch.randn(B, V, generator=torch.Generator().manual_seed(3))).to(device)
    allowed = [{65536 + 7, 65536 + 100}, {65536 + 299}]
    mask = bitmask(allowed, V).to(device)
    z = torch.zeros(B, device=device)
    k = torch.zeros(B, dtype=torch.int32, device=device)
    tokens, lp, _, _ = sample(logits, z, k, z + 1, torch.arange(B, device=device), 0,
                              all_greedy=True, allowed=mask)
    dense = torch.full((B, V), -math.inf)
    for r, a in enumerate(allowed):
        dense[r, sorted(a)] = 0.0
    ref = (logits.cpu() + dense).log_softmax(-1)
    assert all(t in a for t, a in zip(tokens.tolist(), allowed))
    torch.testing.assert_close(lp.cpu(), ref.gather(1, tokens.cpu()[:, None])[:, 0])
