"""The sampling-side kernels at the vocabularies real models have: SmolLM2's 49,152, Llama 3's
128,256, Qwen's 151,936 and Gemma 3's 262,144 (none a power of two but the first's chunks).
Greedy and top-k / top-p draws with top logprobs, prompt logprobs over many rows (a tile once
asked for 64 x 65,536 elements, over Triton's 2^20), penalties on the last ids, and a grammar
mask whose allowed tokens sit in the last chunk."""

import pytest
import torch

from tinyserve.kernels import apply_penalties, sample, target_logprobs

VOCABS = [49152, 128256, 151936, 262144]


def _logits(B: int, V: int, seed: int) -> torch.Tensor:
    return torch.randn(B, V, generator=torch.Generator().manual_seed(seed)) * 4


@pytest.mark.parametrize("V", VOCABS)
def test_greedy_top_p_and_top_logprobs(device, V):
    B = 3
    logits = _logits(B, V, V)
    logits[1, V - 1] = logits[1].max() + 2  # the best token is the vocabulary's last
    t = torch.tensor([0.0, 0.0, 0.9], device=device)
    k = torch.tensor([0, 0, 50], dtype=torch.int32, device=device)
    p = torch.tensor([1.0, 1.0, 0.8], device=device)
    seeds = torch.tensor([1, 2, 3], device=device)
    tokens, lp, top_ids, top_lp = sample(logits.to(device), t, k, p, seeds, 4)
    ref = logits.log_softmax(-1)
    assert tokens[:2].tolist() == logits[:2].argmax(-1).tolist() and tokens[1] == V - 1
    assert int(tokens[2]) in set(logits[2].topk(50).indices.tolist())
    torch.testing.assert_close(lp.cpu(), ref.gather(1, tokens.cpu()[:, None])[:, 0],
                               atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(top_lp.cpu(), ref.topk(4, -1).values, atol=1e-4, rtol=1e-5)
    assert torch.equal(top_ids.cpu(), ref.topk(4, -1).indices)


@pytest.mark.parametrize("V", VOCABS)
def test_prompt_logprobs_over_many_rows(device, V):
    R = 70  # more rows than one 2^20-element tile holds at 65,536 a row
    logits = _logits(R, V, V + 1)
    targets = torch.randint(0, V, (R,), generator=torch.Generator().manual_seed(V))
    targets[-1] = V - 1
    lp, rank, top_ids, top_lp = target_logprobs(logits.to(device), targets.to(device), 2)
    ref = logits.log_softmax(-1)
    torch.testing.assert_close(lp.cpu(), ref.gather(1, targets[:, None])[:, 0], atol=1e-4,
                               rtol=1e-5)
    want_rank = (logits > logits.gather(1, targets[:, None])).sum(-1) + 1
    assert torch.equal(rank.cpu(), want_rank)
    torch.testing.assert_close(top_lp.cpu(), ref.topk(2, -1).values, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("V", VOCABS)
def test_penalties_and_a_grammar_mask_at_the_vocabulary_end(device, V):
    B = 2
    logits = _logits(B, V, V + 2)
    ids = torch.tensor([[V - 1, V - 2, 5], [0, V - 1, V - 3]], dtype=torch.int32)
    counts = torch.tensor([[2, 1, 1], [1, 3, 0]], dtype=torch.int32)
    in_prompt = torch.tensor([[0, 1, 0], [1, 0, 1]], dtype=torch.int32)
    bias = torch.tensor([[0.0, 5.0, -float("inf")], [1.0, 0.0, 0.0]])  # (-inf: the host's ban)
    rep = torch.tensor([1.3, 0.8])
    freq = torch.tensor([0.5, 0.0])
    pres = torch.tensor([0.25, 1.0])
    out = logits.clone().to(device)
    apply_penalties(out, *(x.to(device) for x in (ids, counts, in_prompt, bias, rep, freq, pres)))
    ref = logits.clone()
    for r in range(B):
        for j, t in enumerate(ids[r].tolist()):
            x = ref[r, t]
            x = x + float(bias[r, j])
            if counts[r, j] or in_prompt[r, j]:
                x = x / rep[r] if x > 0 else x * rep[r]
            x = x - freq[r] * counts[r, j] - pres[r] * (counts[r, j] > 0)
            ref[r, t] = x
    torch.testing.assert_close(out.cpu(), ref, atol=1e-5, rtol=1e-5)
    allowed = [V - 1, V - 40, V - 1000]  # all in the last 65,536-wide chunk
    words = torch.zeros(B, -(-V // 32), dtype=torch.int64)
    for t in allowed:
        words[:, t // 32] |= 1 << (t % 32)
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    z = torch.zeros(B, device=device)
    tokens, lp, *_ = sample(out, z, torch.zeros(B, dtype=torch.int32, device=device), z + 1,
                            torch.tensor([5, 6], device=device), all_greedy=True,
                            allowed=words.to(device))
    masked = torch.full_like(ref, -float("inf"))
    masked[:, allowed] = ref[:, allowed]
    assert tokens.tolist() == masked.argmax(-1).tolist()
    within = ref[:, allowed].log_softmax(-1)  # (logprobs of the logits given, over the mask)
    torch.testing.assert_close(lp.cpu(), within.gather(
        1, torch.tensor([[allowed.index(int(t))] for t in tokens]))[:, 0], atol=1e-4, rtol=1e-5)
