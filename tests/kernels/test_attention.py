"""Paged attention (prefill and decode) against a float32 torch reference on contiguous K/V.

Caches are filled at random physical blocks, so every test also checks the block-table walk.
"""

import math

import pytest
import torch

from tests.kernels.dtypes import bf16
from tinyserve.kernels import context_attention_paged, token_attention_paged

# (dtype, atol, rtol): outputs are averages of values ~1; fp16 / bf16 round q K^T's inputs, P
# and the output (bf16 ~8x fp16's step). bf16 q K^T and P V are bf16 tl.dots: GPU only.
DTYPES = [(torch.float32, 2e-5, 1e-4), (torch.float16, 3e-3, 3e-3), bf16(2.5e-2, 2.5e-2, math=True)]


def make_paged(seq_lens, Hk, Dh, block_size, dtype, device, seed):
    """Random K/V for each sequence, scattered over shuffled physical blocks."""
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    perm = torch.randperm(num_blocks, generator=g).tolist()
    k_cache = torch.randn(num_blocks, block_size, Hk, Dh, generator=g).to(device, dtype)
    v_cache = torch.randn(num_blocks, block_size, Hk, Dh, generator=g).to(device, dtype)
    max_blocks = max(blocks_per_seq) + 1  # one spare column: tables are wider than needed
    tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    dense = []
    for b, nb in enumerate(blocks_per_seq):
        ids = [perm.pop() for _ in range(nb)]
        tables[b, :nb] = torch.tensor(ids, dtype=torch.int32)
        n = seq_lens[b]
        dense.append((k_cache[ids].reshape(-1, Hk, Dh)[:n], v_cache[ids].reshape(-1, Hk, Dh)[:n]))
    return k_cache, v_cache, tables.to(device), dense


def ref_attention(q, k, v, q_pos):
    """q: [Tq, Hq, Dh] at absolute positions q_pos; k, v: [N, Hk, Dh]. Causal, fp32."""
    group = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(group, dim=1)
    v = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,nhd->hqn", q.float(), k) / math.sqrt(q.shape[-1])
    causal = torch.arange(k.shape[0], device=q.device)[None, :] <= q_pos[:, None]
    scores = scores.masked_fill(~causal[None], float("-inf"))
    return torch.einsum("hqn,nhd->qhd", scores.softmax(-1), v)


CASES = [
    # (q_lens, ctx_lens, Hq, Hk, Dh, block_size)
    ([5], [0], 8, 4, 8, 16),                     # stories260k shape
    ([1, 17, 33], [0, 15, 16], 4, 4, 16, 16),    # GQA 1, prefix crossing a block edge
    ([40, 3, 70], [9, 100, 0], 8, 4, 64, 16),    # GQA 2
    ([13, 29], [31, 2], 8, 2, 24, 8),            # GQA 4, odd head_dim, small blocks
    ([130], [5], 4, 1, 32, 16),                  # query tile split across programs
]


@pytest.mark.parametrize("dtype,atol,rtol", DTYPES)
@pytest.mark.parametrize("q_lens,ctx_lens,Hq,Hk,Dh,block_size", CASES)
@pytest.mark.parametrize("block_n", [None, 16])
def test_context_attention_paged(device, dtype, atol, rtol, q_lens, ctx_lens, Hq, Hk, Dh,
                                 block_size, block_n):
    seq_lens = [q + c for q, c in zip(q_lens, ctx_lens)]
    k_cache, v_cache, tables, dense = make_paged(seq_lens, Hk, Dh, block_size, dtype, device,
                                                 seed=sum(seq_lens) + Dh)
    T = sum(q_lens)
    q = torch.randn(T, Hq, Dh, generator=torch.Generator().manual_seed(T)).to(device, dtype)
    q_start = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32,
                           device=device)
    out = context_attention_paged(q, k_cache, v_cache, tables,
                                  torch.tensor(seq_lens, dtype=torch.int32, device=device),
                                  q_start, max(q_lens), block_n=block_n)
    for b, (ql, n) in enumerate(zip(q_lens, seq_lens)):
        s = int(q_start[b])
        pos = torch.arange(n - ql, n, device=device)
        ref = ref_attention(q[s : s + ql], *dense[b], pos)
        torch.testing.assert_close(out[s : s + ql].float(), ref, atol=atol, rtol=rtol)


def test_chunked_prefill_equals_whole_prefill(device):
    """Chunks of a prompt attending to their cached earlier chunks give the same numbers."""
    # pins: a query row ignores its tile's other rows and its place there (fixed tiles, order-stable dot)
    n, Hq, Hk, Dh = 77, 8, 4, 8
    k_cache, v_cache, tables, _ = make_paged([n], Hk, Dh, 16, torch.float32, device, seed=1)
    q = torch.randn(n, Hq, Dh, generator=torch.Generator().manual_seed(2)).to(device)
    whole = context_attention_paged(
        q, k_cache, v_cache, tables, torch.tensor([n], device=device),
        torch.tensor([0, n], device=device), n)
    for lo, hi in [(0, 20), (20, 21), (21, 77)]:
        part = context_attention_paged(
            q[lo:hi], k_cache, v_cache, tables, torch.tensor([hi], device=device),
            torch.tensor([0, hi - lo], device=device), hi - lo)
        assert torch.equal(part, whole[lo:hi])


@pytest.mark.parametrize("dtype,atol,rtol", DTYPES)
@pytest.mark.parametrize("seq_lens,Hq,Hk,Dh,block_size", [
    ([5], 8, 4, 8, 16),
    ([1, 16, 17, 100], 4, 4, 16, 16),
    ([33, 250, 7], 8, 2, 64, 16),
    ([64, 3], 6, 2, 24, 8),
])
@pytest.mark.parametrize("split", [None, (32, 16)])
def test_token_attention_paged(device, dtype, atol, rtol, seq_lens, Hq, Hk, Dh, block_size, split):
    split_size, block_n = split or (None, None)
    k_cache, v_cache, tables, dense = make_paged(seq_lens, Hk, Dh, block_size, dtype, device,
                                                 seed=sum(seq_lens) * 3 + Dh)
    B = len(seq_lens)
    q = torch.randn(B, Hq, Dh, generator=torch.Generator().manual_seed(B)).to(device, dtype)
    out = token_attention_paged(q, k_cache, v_cache, tables,
                                torch.tensor(seq_lens, dtype=torch.int32, device=device),
                                max(seq_lens), split_size=split_size, block_n=block_n)
    for b, n in enumerate(seq_lens):
        ref = ref_attention(q[b : b + 1], *dense[b], torch.tensor([n - 1], device=device))
        torch.testing.assert_close(out[b : b + 1].float(), ref, atol=atol, rtol=rtol)


def test_decode_single_split_rows_are_batch_invariant(device):
    """A short sequence gives bit-identical output alone or next to one that needs splitting."""
    # pins: a sequence's splits and reduction order follow its own length, not the batch's longest
    k_cache, v_cache, tables, _ = make_paged([20, 200], 4, 8, 16, torch.float32, device, seed=5)
    q = torch.randn(2, 8, 8, generator=torch.Generator().manual_seed(6)).to(device)
    lens = torch.tensor([20, 200], device=device)
    both = token_attention_paged(q, k_cache, v_cache, tables, lens, 200, split_size=64, block_n=16)
    alone = token_attention_paged(q[:1], k_cache, v_cache, tables[:1], lens[:1], 20,
                                  split_size=64, block_n=16)
    assert torch.equal(both[0], alone[0])


def test_decode_equals_last_row_of_prefill(device):
    n, Hq, Hk, Dh = 45, 8, 4, 8
    k_cache, v_cache, tables, _ = make_paged([n], Hk, Dh, 16, torch.float32, device, seed=9)
    q = torch.randn(n, Hq, Dh, generator=torch.Generator().manual_seed(3)).to(device)
    lens = torch.tensor([n], device=device)
    pre = context_attention_paged(q, k_cache, v_cache, tables, lens,
                                  torch.tensor([0, n], device=device), n)
    dec = token_attention_paged(q[-1:], k_cache, v_cache, tables, lens, n)
    torch.testing.assert_close(dec[0], pre[-1], atol=1e-6, rtol=1e-6)


def test_decode_rows_are_batch_invariant_across_sequence_slots(device):
    """A sequence's decode output is bit-identical alone or sharing a program with others."""
    # pins: a sequence ignores the others sharing its program (their slots, masked keys; order-stable dot)
    lens = [37, 5, 130, 64, 1]
    k_cache, v_cache, tables, _ = make_paged(lens, 2, 16, 16, torch.float32, device, seed=11)
    q = torch.randn(len(lens), 8, 16, generator=torch.Generator().manual_seed(12)).to(device)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    together = token_attention_paged(q, k_cache, v_cache, tables, seq_lens, max(lens))
    for b, n in enumerate(lens):
        alone = token_attention_paged(q[b : b + 1], k_cache, v_cache, tables[b : b + 1],
                                      seq_lens[b : b + 1], n)
        assert torch.equal(together[b], alone[0])


def test_attention_rejects_bad_head_ratio(device):
    k_cache = torch.zeros(2, 16, 3, 8, device=device)
    with pytest.raises(ValueError, match="multiple"):
        token_attention_paged(torch.zeros(1, 4, 8, device=device), k_cache, k_cache.clone(),
                              torch.zeros(1, 1, dtype=torch.int32, device=device),
                              torch.ones(1, dtype=torch.int32, device=device), 1)


def test_table_rows_read_a_persistent_table(device):
    """Rows named by table_rows in a wider, shuffled table give bit-identical attention to the
    per-batch table (decode and prefill), int64 lengths included (the decode buckets' statics)."""
    lens = [37, 5, 130]
    k_cache, v_cache, tables, _ = make_paged(lens, 2, 16, 16, torch.float32, device, seed=21)
    persistent = torch.full((7, tables.shape[1]), 10**6, dtype=torch.int32, device=device)
    rows = [5, 0, 3]  # unused rows hold garbage block ids: they must never be read
    persistent[rows] = tables
    table_rows = torch.tensor(rows, dtype=torch.int64, device=device)
    q = torch.randn(len(lens), 8, 16, generator=torch.Generator().manual_seed(22)).to(device)
    seq_lens = torch.tensor(lens, dtype=torch.int64, device=device)
    want = token_attention_paged(q, k_cache, v_cache, tables, seq_lens.int(), max(lens))
    got = token_attention_paged(q, k_cache, v_cache, persistent, seq_lens, max(lens),
                                table_rows=table_rows)
    assert torch.equal(got, want)
    q_lens = [4, 5, 9]
    qp = torch.randn(sum(q_lens), 8, 16, generator=torch.Generator().manual_seed(23)).to(device)
    q_start = torch.tensor([0, 4, 9, 18], dtype=torch.int32, device=device)
    want = context_attention_paged(qp, k_cache, v_cache, tables, seq_lens.int(), q_start, 9)
    got = context_attention_paged(qp, k_cache, v_cache, persistent, seq_lens.int(), q_start, 9,
                                  table_rows=table_rows.int())
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="table_rows"):
        token_attention_paged(q, k_cache, v_cache, persistent, seq_lens, max(lens),
                              table_rows=table_rows[:2])


def test_decode_merges_more_splits_than_one_merge_tile(device):
    """19 and 2 splits of 32 keys: the merge runs over its splits 16 at a time (two iterations
    with a running max for the long row) and still equals the reference."""
    lens = [600, 40]
    k_cache, v_cache, tables, dense = make_paged(lens, 2, 16, 16, torch.float32, device, seed=31)
    q = torch.randn(len(lens), 8, 16, generator=torch.Generator().manual_seed(32)).to(device)
    out = token_attention_paged(q, k_cache, v_cache, tables,
                                torch.tensor(lens, dtype=torch.int32, device=device), max(lens),
                                split_size=32, block_n=16)
    for b, n in enumerate(lens):
        ref = ref_attention(q[b : b + 1], *dense[b], torch.tensor([n - 1], device=device))
        torch.testing.assert_close(out[b : b + 1], ref, atol=2e-5, rtol=1e-4)


def ref_attention_ext(q, k, v, q_pos, window=None, softcap=None, scale=None, sinks=None):
    """ref_attention with transformers' sliding-window mask (p - window < n <= p), Gemma 2's
    soft-capped scores, an explicit scale (query_pre_attn_scalar ** -0.5) and gpt-oss's sinks
    (transformers' eager_attention_forward: a column of the head's sink logit in the softmax,
    dropped after it)."""
    group = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(group, dim=1)
    v = v.float().repeat_interleave(group, dim=1)
    scale = scale if scale is not None else q.shape[-1] ** -0.5
    scores = torch.einsum("qhd,nhd->hqn", q.float(), k) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    n = torch.arange(k.shape[0], device=q.device)[None, :]
    keep = n <= q_pos[:, None]
    if window is not None:
        keep = keep & (n > q_pos[:, None] - window)
    scores = scores.masked_fill(~keep[None], float("-inf"))
    if sinks is not None:
        sink = sinks.float()[:, None, None].expand(-1, scores.shape[1], 1)
        probs = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
        return torch.einsum("hqn,nhd->qhd", probs, v)
    return torch.einsum("hqn,nhd->qhd", scores.softmax(-1), v)


WINDOW_CASES = [
    # (q_lens, ctx_lens, Hq, Hk, Dh, block_size, window, softcap, scale)
    ([5], [40], 8, 4, 8, 16, 7, None, None),              # window shorter than the chunk's context
    ([70, 3], [90, 0], 6, 2, 64, 16, 33, 50.0, 0.2),      # GQA 3, both, an odd window
    ([17], [0], 4, 4, 256, 16, 16, None, None),           # head_dim 256 (Gemma), window = a block
    ([1, 40], [300, 5], 8, 8, 24, 8, 100, 5.0, None),     # GQA 1, a low cap that bites
]


@pytest.mark.parametrize("dtype,atol,rtol", DTYPES)
@pytest.mark.parametrize("q_lens,ctx_lens,Hq,Hk,Dh,block_size,window,softcap,scale", WINDOW_CASES)
def test_context_attention_with_window_softcap_and_scale(device, dtype, atol, rtol, q_lens, ctx_lens,
                                                         Hq, Hk, Dh, block_size, window, softcap,
                                                         scale):
    seq_lens = [q + c for q, c in zip(q_lens, ctx_lens)]
    k_cache, v_cache, tables, dense = make_paged(seq_lens, Hk, Dh, block_size, dtype, device,
                                                 seed=sum(seq_lens) + window)
    dense = [(k.clone(), v.clone()) for k, v in dense]
    first_q = [c for c in ctx_lens]
    for b, c in enumerate(first_q):  # blocks before the earliest query's window: poisoned
        for i in range(max(0, c - window + 1) // block_size):
            k_cache[int(tables[b, i])] = float("nan")
            v_cache[int(tables[b, i])] = float("nan")
    T = sum(q_lens)
    q = torch.randn(T, Hq, Dh, generator=torch.Generator().manual_seed(T + 1)).to(device, dtype)
    q_start = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32,
                           device=device)
    out = context_attention_paged(q, k_cache, v_cache, tables,
                                  torch.tensor(seq_lens, dtype=torch.int32, device=device),
                                  q_start, max(q_lens), sm_scale=scale, window=window,
                                  softcap=softcap)
    for b, (ql, n) in enumerate(zip(q_lens, seq_lens)):
        s = int(q_start[b])
        pos = torch.arange(n - ql, n, device=device)
        ref = ref_attention_ext(q[s:s + ql], *dense[b], pos, window, softcap, scale)
        torch.testing.assert_close(out[s:s + ql].float(), ref, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype,atol,rtol", DTYPES)
@pytest.mark.parametrize("seq_lens,Hq,Hk,Dh,block_size,window,softcap", [
    ([45], 8, 4, 8, 16, 7, None),
    ([1, 16, 100, 250], 6, 2, 64, 16, 33, 50.0),
    ([300, 20], 4, 4, 256, 8, 64, 5.0),
])
@pytest.mark.parametrize("split", [None, (32, 16)])
def test_token_attention_with_window_and_softcap(device, dtype, atol, rtol, seq_lens, Hq, Hk, Dh,
                                                 block_size, window, softcap, split):
    """Split-KV decode: splits wholly before a window are skipped in both stages (their
    partials are never written nor merged); out-of-window blocks are never read."""
    split_size, block_n = split or (None, None)
    k_cache, v_cache, tables, dense = make_paged(seq_lens, Hk, Dh, block_size, dtype, device,
                                                 seed=sum(seq_lens) + window)
    dense = [(k.clone(), v.clone()) for k, v in dense]
    for b, n in enumerate(seq_lens):
        for i in range(max(0, n - window) // block_size):
            k_cache[int(tables[b, i])] = float("nan")
            v_cache[int(tables[b, i])] = float("nan")
    B = len(seq_lens)
    q = torch.randn(B, Hq, Dh, generator=torch.Generator().manual_seed(B + 7)).to(device, dtype)
    out = token_attention_paged(q, k_cache, v_cache, tables,
                                torch.tensor(seq_lens, dtype=torch.int32, device=device),
                                max(seq_lens), split_size=split_size, block_n=block_n,
                                window=window, softcap=softcap)
    for b, n in enumerate(seq_lens):
        ref = ref_attention_ext(q[b:b + 1], *dense[b], torch.tensor([n - 1], device=device),
                                window, softcap)
        torch.testing.assert_close(out[b:b + 1].float(), ref, atol=atol, rtol=rtol)


def test_windowed_rows_are_batch_invariant(device):
    """A window moves where each program's tile loop starts; a row's numbers must not move."""
    k_cache, v_cache, tables, _ = make_paged([30, 200], 4, 8, 16, torch.float32, device, seed=8)
    q = torch.randn(2, 8, 8, generator=torch.Generator().manual_seed(9)).to(device)
    lens = torch.tensor([30, 200], device=device)
    both = token_attention_paged(q, k_cache, v_cache, tables, lens, 200, split_size=64,
                                 block_n=16, window=40)
    for b in range(2):
        alone = token_attention_paged(q[b:b + 1], k_cache, v_cache, tables[b:b + 1],
                                      lens[b:b + 1], int(lens[b]), split_size=64, block_n=16,
                                      window=40)
        assert torch.equal(both[b], alone[0])
    n = 77
    qp = torch.randn(n, 8, 8, generator=torch.Generator().manual_seed(2)).to(device)
    kc, vc, tb, _ = make_paged([n], 4, 8, 16, torch.float32, device, seed=3)
    whole = context_attention_paged(qp, kc, vc, tb, torch.tensor([n], device=device),
                                    torch.tensor([0, n], device=device), n, window=20)
    for lo, hi in [(0, 20), (20, 21), (21, 77)]:
        part = context_attention_paged(qp[lo:hi], kc, vc, tb, torch.tensor([hi], device=device),
                                       torch.tensor([0, hi - lo], device=device), hi - lo,
                                       window=20)
        assert torch.equal(part, whole[lo:hi])


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_a_sequence_whose_kv_overflows_never_reaches_the_sequences_beside_it(device, bad):
    """Decode programs share a key tile among sequences and weigh the others' V rows by exact
    zeros: a non-finite V would make them NaN (0 * inf). The cache write stores such values as
    0, so a poisoned sequence's neighbours answer as alone (bit for bit)."""
    from tinyserve.kernels import write_kv_cache

    lens = [37, 5, 130, 64, 1]
    k_cache, v_cache, tables, _ = make_paged(lens, 2, 16, 16, torch.float32, device, seed=11)
    q = torch.randn(len(lens), 8, 16, generator=torch.Generator().manual_seed(12)).to(device)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    alone = [token_attention_paged(q[b:b + 1], k_cache, v_cache, tables[b:b + 1],
                                   seq_lens[b:b + 1], n) for b, n in enumerate(lens)]
    block = int(tables[1, 0])
    slots = torch.arange(block * 16, block * 16 + 5, device=device)
    poison = torch.full((5, 2, 16), bad, device=device)
    write_kv_cache(poison, poison, k_cache, v_cache, slots)
    assert torch.count_nonzero(v_cache[block, :5]) == 0  # stored as zeros
    together = token_attention_paged(q, k_cache, v_cache, tables, seq_lens, max(lens))
    for b in (0, 2, 3, 4):
        assert torch.equal(together[b], alone[b][0]), b


SINK_CASES = [
    # (q_lens, ctx_lens, Hq, Hk, Dh, block_size, window): gpt-oss has GQA 8, head_dim 64,
    # windows of 128 on alternate layers
    ([5, 40], [0, 9], 8, 2, 64, 16, None),
    ([70, 3], [90, 0], 6, 2, 24, 16, 33),  # a window: the sink beside fewer keys
    ([1], [0], 4, 4, 16, 16, None),  # one key: the sink takes its share
]


def _sinks(Hq, device, seed):
    """Sink logits from well below to well above the scores' range (one per head)."""
    return (torch.randn(Hq, generator=torch.Generator().manual_seed(seed)) * 3).to(device)


@pytest.mark.parametrize("dtype,atol,rtol", DTYPES)
@pytest.mark.parametrize("q_lens,ctx_lens,Hq,Hk,Dh,block_size,window", SINK_CASES)
def test_context_attention_with_sinks(device, dtype, atol, rtol, q_lens, ctx_lens, Hq, Hk, Dh,
                                      block_size, window):
    seq_lens = [q + c for q, c in zip(q_lens, ctx_lens)]
    k_cache, v_cache, tables, dense = make_paged(seq_lens, Hk, Dh, block_size, dtype, device,
                                                 seed=sum(seq_lens) + 5)
    T = sum(q_lens)
    q = torch.randn(T, Hq, Dh, generator=torch.Generator().manual_seed(T + 2)).to(device, dtype)
    sinks = _sinks(Hq, device, T)
    q_start = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32,
                           device=device)
    out = context_attention_paged(q, k_cache, v_cache, tables,
                                  torch.tensor(seq_lens, dtype=torch.int32, device=device),
                                  q_start, max(q_lens), window=window, sinks=sinks)
    for b, (ql, n) in enumerate(zip(q_lens, seq_lens)):
        s = int(q_start[b])
        pos = torch.arange(n - ql, n, device=device)
        ref = ref_attention_ext(q[s:s + ql], *dense[b], pos, window, sinks=sinks)
        torch.testing.assert_close(out[s:s + ql].float(), ref, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype,atol,rtol", DTYPES)
@pytest.mark.parametrize("seq_lens,Hq,Hk,Dh,block_size,window", [
    ([1, 45], 8, 2, 64, 16, None), ([16, 100, 250], 6, 2, 24, 16, 33)])
@pytest.mark.parametrize("split", [None, (32, 16)])
def test_token_attention_with_sinks(device, dtype, atol, rtol, seq_lens, Hq, Hk, Dh,
                                    block_size, window, split):
    """One split: the sink joins in stage 1; several: once, in the merge (not per split)."""
    split_size, block_n = split or (None, None)
    k_cache, v_cache, tables, dense = make_paged(seq_lens, Hk, Dh, block_size, dtype, device,
                                                 seed=sum(seq_lens) + 6)
    B = len(seq_lens)
    q = torch.randn(B, Hq, Dh, generator=torch.Generator().manual_seed(B + 9)).to(device, dtype)
    sinks = _sinks(Hq, device, B)
    out = token_attention_paged(q, k_cache, v_cache, tables,
                                torch.tensor(seq_lens, dtype=torch.int32, device=device),
                                max(seq_lens), split_size=split_size, block_n=block_n,
                                window=window, sinks=sinks)
    for b, n in enumerate(seq_lens):
        ref = ref_attention_ext(q[b:b + 1], *dense[b], torch.tensor([n - 1], device=device),
                                window, sinks=sinks)
        torch.testing.assert_close(out[b:b + 1].float(), ref, atol=atol, rtol=rtol)


def test_sinks_are_checked(device):
    k_cache, v_cache, tables, _ = make_paged([4], 2, 16, 16, torch.float32, device, seed=1)
    q = torch.randn(1, 4, 16, device=device)
    lens = torch.tensor([4], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="sinks must be"):
        token_attention_paged(q, k_cache, v_cache, tables, lens, 4,
                              sinks=torch.zeros(2, device=device))
