"""Sampling kernel: greedy, logprobs, top-N, top-k / top-p sets, seeded Gumbel draws."""

import pytest
import torch

from tinyserve.kernels import sample


def params(B, device, temperature=0.0, top_k=0, top_p=1.0, seeds=None):
    t = torch.full((B,), float(temperature), device=device)
    k = torch.full((B,), int(top_k), dtype=torch.int32, device=device)
    p = torch.full((B,), float(top_p), device=device)
    s = torch.arange(B, dtype=torch.int64, device=device) * 7919 + 1 if seeds is None else seeds
    return t, k, p, s


@pytest.mark.parametrize("B,V", [(1, 512), (5, 1000), (33, 37)])
def test_greedy_logprobs_and_top_logprobs(device, B, V):
    g = torch.Generator().manual_seed(B * V)
    logits = torch.randn(B, V, generator=g).to(device) * 3
    logits[0, 3] = logits[0, 7] = logits[0].max() + 1  # a tie: the first index wins
    tokens, lp, top_ids, top_lp = sample(logits, *params(B, device), num_top_logprobs=5,
                                         all_greedy=True)
    assert torch.equal(tokens, logits.argmax(-1))
    assert tokens[0] == 3
    ref_lp = logits.log_softmax(-1)
    torch.testing.assert_close(lp, ref_lp.gather(1, tokens[:, None])[:, 0], atol=1e-5, rtol=1e-5)
    ref_top = ref_lp.topk(5, dim=-1)
    torch.testing.assert_close(top_lp, ref_top.values, atol=1e-5, rtol=1e-5)
    assert top_ids[0, :2].tolist() == [3, 7]  # ties ordered by index
    assert torch.equal(top_ids[1:], ref_top.indices[1:])


def test_top_k_one_is_greedy_at_any_temperature(device):
    B, V = 16, 300
    logits = torch.randn(B, V, generator=torch.Generator().manual_seed(1)).to(device)
    tokens, *_ = sample(logits, *params(B, device, temperature=5.0, top_k=1))
    assert torch.equal(tokens, logits.argmax(-1))


def ref_kept(logits, temperature, top_k, top_p):
    """HF/vLLM semantics: temperature, then top-k, then top-p on the renormalised probs."""
    z = logits / temperature
    if top_k > 0:
        kth = z.topk(top_k, dim=-1).values[:, -1:]
        z = z.masked_fill(z < kth, float("-inf"))
    probs = z.softmax(-1)
    sorted_p, order = probs.sort(dim=-1, descending=True)
    above = sorted_p.cumsum(-1) - sorted_p  # mass strictly ranked above each token
    keep_sorted = (above < top_p) & (sorted_p > 0)
    keep = torch.zeros_like(keep_sorted)
    keep.scatter_(1, order, keep_sorted)
    return keep, probs


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 5, 1.0), (0.7, 0, 0.6),
                                                     (1.3, 20, 0.8), (1.0, 0, 1.0)])
def test_sampled_tokens_stay_in_the_allowed_set(device, temperature, top_k, top_p):
    B, V = 256, 100
    row = torch.randn(1, V, generator=torch.Generator().manual_seed(4)) * 2
    logits = row.repeat(B, 1).to(device)
    tokens, *_ = sample(logits, *params(B, device, temperature, top_k, top_p),
                        any_top_k=top_k > 0, any_top_p=top_p < 1.0)
    keep, _ = ref_kept(row.to(device), temperature, top_k, top_p)
    allowed = set(torch.nonzero(keep[0]).flatten().tolist())
    drawn = set(tokens.tolist())
    assert drawn <= allowed
    assert len(drawn) > 1  # 256 different seeds do not all land on one token


def test_draws_follow_the_distribution(device):
    """4096 seeded draws from a 6-way distribution: frequencies within 4 sigma of the probs."""
    B = 4096
    row = torch.tensor([[2.0, 1.5, 1.0, 0.0, -1.0, -3.0]])
    logits = row.repeat(B, 1).to(device)
    tokens, *_ = sample(logits, *params(B, device, temperature=0.8, top_p=0.9),
                        any_top_k=False)
    keep, probs = ref_kept(row.to(device), 0.8, 0, 0.9)
    p = torch.where(keep, probs, 0.0)[0]
    p = p / p.sum()
    freq = torch.bincount(tokens, minlength=6).float() / B
    sigma = (p * (1 - p) / B).sqrt()
    assert torch.all((freq - p).abs() <= 4 * sigma + 1e-6), (freq, p)


def test_seeds_make_draws_reproducible_and_rows_independent(device):
    B, V = 8, 50
    logits = torch.zeros(B, V, device=device)  # uniform: the draw is all seed
    seeds = torch.tensor([11, 11, 12, 13, 14, 15, 16, 17], dtype=torch.int64, device=device)
    a, *_ = sample(logits, *params(B, device, 1.0, seeds=seeds), any_top_k=False, any_top_p=False)
    b, *_ = sample(logits, *params(B, device, 1.0, seeds=seeds), any_top_k=False, any_top_p=False)
    assert torch.equal(a, b)
    assert a[0] == a[1]
    assert len(set(a[2:].tolist())) > 1


def test_mixed_greedy_and_sampled_rows(device):
    B, V = 6, 64
    logits = torch.randn(B, V, generator=torch.Generator().manual_seed(8)).to(device)
    t, k, p, s = params(B, device)
    t[1::2] = 1.0
    k[1::2] = 3
    tokens, lp, *_ = sample(logits, t, k, p, s)
    assert torch.equal(tokens[0::2], logits[0::2].argmax(-1))
    top3 = logits[1::2].topk(3, dim=-1).indices
    assert all(int(tok) in top3[i].tolist() for i, tok in enumerate(tokens[1::2]))
    ref_lp = logits.log_softmax(-1).gather(1, tokens[:, None])[:, 0]
    torch.testing.assert_close(lp, ref_lp, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("values,top_k,top_p,expected", [
    # A tie at the k-th value is kept (as HF's top-k does).
    ([-0.5, -0.9, -0.9, -1.2, -7.0, -9.0, -8.0, -30.0], 2, 1.0, {0, 1, 2}),
    # probs ~ .360 .242 .219 .179 ...: mass ranked above tokens 1, 2, 3 = .360, .602, .820
    ([-0.5, -0.9, -1.0, -1.2, -7.0, -9.0, -8.0, -30.0], 0, 0.5, {0, 1}),
    ([-0.5, -0.9, -1.0, -1.2, -7.0, -9.0, -8.0, -30.0], 0, 0.65, {0, 1, 2}),
    ([-0.5, -0.9, -1.0, -1.2, -7.0, -9.0, -8.0, -30.0], 0, 0.3, {0}),
    ([-0.5, -0.9, -1.0, -1.2, -7.0, -9.0, -8.0, -30.0], 5, 0.999, {0, 1, 2, 3}),
])
def test_kept_set_is_exact_with_ties_and_negative_logits(device, values, top_k, top_p, expected):
    B = 512
    row = torch.tensor([values])
    logits = row.repeat(B, 1).to(device)
    tokens, *_ = sample(logits, *params(B, device, 1.0, top_k, top_p),
                        any_top_k=top_k > 0, any_top_p=top_p < 1.0)
    keep, _ = ref_kept(row.to(device), 1.0, top_k, top_p)
    assert set(torch.nonzero(keep[0]).flatten().tolist()) == expected
    assert set(tokens.tolist()) == expected  # 512 draws reach every kept token, nothing else


@pytest.mark.parametrize("R,V", [(1, 512), (7, 301), (40, 37)])
def test_target_logprobs_ranks_and_top_entries(device, R, V):
    from tinyserve.kernels import target_logprobs

    g = torch.Generator().manual_seed(R * V)
    logits = torch.randn(R, V, generator=g) * 3
    targets = torch.randint(0, V, (R,), generator=g)
    targets[0] = logits[0].argmax()  # a target that is the top entry
    lp, rank, top_ids, top_lp = target_logprobs(logits.to(device), targets.to(device), 3)
    ref = logits.log_softmax(-1)
    torch.testing.assert_close(lp.cpu(), ref.gather(1, targets[:, None])[:, 0],
                               atol=1e-5, rtol=1e-5)
    want_rank = (logits > logits.gather(1, targets[:, None])).sum(-1) + 1
    assert torch.equal(rank.cpu(), want_rank)
    torch.testing.assert_close(top_lp.cpu(), ref.topk(3, -1).values, atol=1e-5, rtol=1e-5)
    assert top_ids[0, 0] == targets[0] and top_lp[0, 0].item() == lp[0].item()  # bit for bit
