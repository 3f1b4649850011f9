"""Fused mixture of experts (route, sort, gate/up, down, combine) against float32 torch
references: routing by torch.softmax / torch.topk, experts as a per-token loop."""

import sys

import pytest
import torch
import torch.nn.functional as F

from tests.kernels.dtypes import bf16
from tinyserve.engine.loading.quantize import quantize_experts_int8
from tinyserve.kernels import (
    Int4Experts,
    fused_moe,
    moe_align,
    moe_combine,
    moe_down,
    moe_gate_up,
    moe_route,
)
from tinyserve.kernels.utils import Recording, recording

moe = sys.modules["tinyserve.kernels.moe"]
routing = sys.modules["tinyserve.kernels.moe_routing"]

# out is O(1) (x ~ N(0, 1), weights ~ N(0, 1/fan_in)); h and y are rounded to the dtype by
# kernel and reference alike, so only summation order (and a GPU's exp) differs: a few units
# in the last place. bf16 goes through a bf16 tl.dot: GPU only.
DTYPES = [(torch.float32, 2e-5, 1e-5), (torch.float16, 1e-2, 1e-2),
          bf16(6e-2, 5e-2, math=True)]
MODES = [(True, True), (True, False), (False, False)]  # (softmax_first, renormalize)


def route_ref(logits, k, softmax_first, renormalize):
    if softmax_first:  # Qwen2/3-MoE, OLMoE (Mixtral: renormalized)
        w, ids = torch.topk(torch.softmax(logits, dim=-1), k, dim=-1)
        if renormalize:
            w = w / w.sum(dim=-1, keepdim=True)
        return w, ids
    v, ids = torch.topk(logits, k, dim=-1)  # gpt-oss
    return torch.softmax(v, dim=-1), ids


def moe_ref(x, logits, w13, w2, k, softmax_first, renormalize, activation, b13=None, b2=None,
            alpha=1.702, limit=7.0):
    """Token by token, expert by expert, in fp32; h and y rounded to x's dtype where the kernels
    store them."""
    dt = x.dtype
    w, ids = route_ref(logits.float(), k, softmax_first, renormalize)
    x, w13, w2 = x.float(), w13.float(), w2.float()
    n_ff = w13.shape[1] // 2
    out = torch.zeros(x.shape[0], w2.shape[1], device=x.device)
    for t in range(x.shape[0]):
        for j in range(k):
            e = int(ids[t, j])
            gu = w13[e] @ x[t] + (0 if b13 is None else b13[e].float())
            if activation == "swiglu_oai":  # transformers' GptOssExperts._apply_gate
                gate, up = gu[0::2].clamp(max=limit), gu[1::2].clamp(-limit, limit)
                h = (up + 1) * gate * torch.sigmoid(gate * alpha)
            elif activation == "gelu_tanh":
                h = F.gelu(gu[:n_ff], approximate="tanh") * gu[n_ff:]
            else:
                h = F.silu(gu[:n_ff]) * gu[n_ff:]
            y = w2[e] @ h.to(dt).float() + (0 if b2 is None else b2[e].float())
            out[t] += (w[t, j] * y).to(dt).float()
    return out.to(dt)


def make_moe(T, E, D, n_ff, g, device, dtype, bias=False, gate_scale=1.0):
    x = torch.randn(T, D, generator=g)
    logits = torch.randn(T, E, generator=g) * 2
    w13 = torch.randn(E, 2 * n_ff, D, generator=g) * gate_scale / D ** 0.5
    w2 = torch.randn(E, D, n_ff, generator=g) / n_ff ** 0.5
    b13 = torch.randn(E, 2 * n_ff, generator=g) * 0.5 if bias else None
    b2 = torch.randn(E, D, generator=g) * 0.5 if bias else None
    to = lambda t: None if t is None else t.to(device, dtype)  # noqa: E731
    return to(x), logits.to(device), to(w13), to(w2), to(b13), to(b2)


# ---------------------------------------------------------------------------------- routing

@pytest.mark.parametrize("softmax_first,renormalize", MODES)
@pytest.mark.parametrize("T,E,k", [(1, 6, 1), (3, 6, 2), (17, 60, 4), (5, 128, 8),
                                   (4, 256, 16), (2, 60, 1)])
def test_route_matches_softmax_topk(device, T, E, k, softmax_first, renormalize):
    g = torch.Generator().manual_seed(T * 1000 + E * 10 + k)
    logits = (torch.randn(T, E, generator=g) * 2).to(device)  # distinct: topk's order is defined
    w, ids = moe_route(logits, k, softmax_first=softmax_first, renormalize=renormalize)
    w_ref, ids_ref = route_ref(logits, k, softmax_first, renormalize)
    assert ids.dtype == torch.int32 and w.dtype == torch.float32
    assert torch.equal(ids.long(), ids_ref)
    torch.testing.assert_close(w, w_ref, atol=1e-6, rtol=1e-5)


def test_route_ties_go_to_the_lower_id_and_minus_inf_is_a_value(device):
    inf = float("inf")
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0, 2.0],
                           [-inf, 2.0, -inf, -inf, 1.0, -inf]], device=device)
    w, ids = moe_route(logits, 3, softmax_first=False, renormalize=False)
    assert ids.tolist() == [[1, 2, 4], [1, 4, 0]]
    torch.testing.assert_close(w[0], torch.full((3,), 1 / 3, device=device))
    e = torch.tensor([1.0, 1 / torch.e, 0.0], device=device)
    torch.testing.assert_close(w[1], e / e.sum())


# ---------------------------------------------------------------------------------- the sort

def align_ref(flat, E, block_m):
    """Each expert's entries ascending, padded with the sentinel; the tiles' experts."""
    N, runs, experts = flat.numel(), [], []
    for e in range(E):
        f = (flat == e).nonzero().flatten()
        if len(f):
            pad = -len(f) % block_m
            runs.append(torch.cat([f, torch.full((pad,), N)]))
            experts += [e] * ((len(f) + pad) // block_m)
    return torch.cat(runs), torch.tensor(experts, dtype=torch.long)


def check_alignment(ids, E, block_m, sorted_ids, expert_of_tile, num_tiles):
    flat = ids.flatten().long().cpu()
    N, S = flat.numel(), sorted_ids.numel()
    assert S == routing.sorted_size(N, E, block_m) and S % block_m == 0
    assert S >= N + min(E, N) * (block_m - 1) and expert_of_tile.numel() == S // block_m
    s, tile_e, used = sorted_ids.long().cpu(), expert_of_tile.long().cpu(), int(num_tiles)
    ref_sorted, ref_experts = align_ref(flat, E, block_m)
    assert used * block_m == ref_sorted.numel()
    assert torch.equal(s[: used * block_m], ref_sorted)
    assert torch.equal(tile_e[:used], ref_experts)
    assert (s[used * block_m:] == N).all() and (tile_e[used:] == -1).all()  # unused: free
    # what the GEMMs rely on, stated directly
    assert torch.equal(s[s < N].sort().values, torch.arange(N))  # each flat entry once
    for i, tile in enumerate(s.view(-1, block_m)[:used]):
        real = tile < N
        assert (flat[tile[real]] == tile_e[i]).all()  # the tile's expert's entries, ascending
        assert torch.equal(tile[real], tile[real].sort().values)
        assert not (real[1:] & ~real[:-1]).any()  # sentinels only after a run's entries


def random_ids(T, k, E, g):
    """k distinct experts per token, as a router picks them."""
    return torch.rand(T, E, generator=g).argsort(dim=1)[:, :k].to(torch.int32)


@pytest.mark.parametrize("T,k,E,block_m", [(1, 1, 6, 16), (3, 2, 60, 16), (17, 8, 128, 16),
                                           (17, 4, 6, 5), (40, 4, 6, 16), (2, 3, 256, 1)])
def test_align_groups_pads_and_tiles(device, T, k, E, block_m):
    ids = random_ids(T, k, E, torch.Generator().manual_seed(T + k + E)).to(device)
    check_alignment(ids, E, block_m, *moe_align(ids, E, block_m))


def test_align_across_chunks(device, monkeypatch):
    """Many counting / placing programs (an expert's entries spread over chunks, each chunk's
    base after the earlier ones') and the offsets program's chunk and tile loops."""
    monkeypatch.setattr(routing, "_align_blocks", lambda N, E: (16, 2, 2))
    ids = random_ids(40, 4, 6, torch.Generator().manual_seed(1)).to(device)  # 10 chunks
    ids[5:30, 0] = 3  # one expert in most chunks (ids still distinct per row: no matter here)
    check_alignment(ids, 6, 16, *moe_align(ids, 6, 16))


def test_an_expert_without_tokens_costs_no_tile(device):
    E, block_m = 8, 16
    ids = random_ids(12, 2, 6, torch.Generator().manual_seed(2))  # experts 6, 7: never
    ids = torch.where(ids == 2, 6, ids).to(device, torch.int32)  # 2 neither, 6 instead
    sorted_ids, expert_of_tile, num_tiles = moe_align(ids, E, block_m)
    counts = torch.bincount(ids.flatten().long().cpu(), minlength=E)
    assert int(num_tiles) == int((-(-counts // block_m)).sum())
    assert not set(expert_of_tile.tolist()) & {2, 7}
    # tiles of expert -1 neither read nor write: nothing changes in out
    x, w13 = torch.randn(12, 32, device=device), torch.randn(E, 64, 32, device=device)
    out = torch.full((24, 32), 7.0, device=device)
    moe_gate_up(x, w13, sorted_ids, torch.full_like(expert_of_tile, -1), 2, out=out)
    assert (out == 7.0).all()


# -------------------------------------------------------------------------- the whole layer

# (T, E, k, D, F, softmax_first, renormalize, activation, biases)
FUSED_CASES = [
    (1, 6, 2, 48, 40, False, False, "silu", False),  # Mixtral-like; one-row tiles
    (3, 60, 4, 64, 96, True, False, "silu", False),  # Qwen2-MoE-like: fewer tokens than experts
    (17, 128, 8, 48, 40, True, True, "silu", False),  # Qwen3-MoE-like
    (5, 6, 1, 64, 96, True, False, "gelu_tanh", True),  # k = 1, biases
    (40, 6, 4, 48, 40, True, True, "silu", False),  # > 16 rows an expert: several tiles each
    (9, 60, 4, 64, 96, False, False, "swiglu_oai", True),  # gpt-oss: interleaved, clamped
]


@pytest.mark.parametrize("dtype,atol,rtol", DTYPES)
@pytest.mark.parametrize("T,E,k,D,n_ff,softmax_first,renormalize,activation,bias", FUSED_CASES)
def test_fused_moe_matches_the_reference(device, dtype, atol, rtol, T, E, k, D, n_ff,
                                         softmax_first, renormalize, activation, bias):
    g = torch.Generator().manual_seed(T * 7 + E + k + D)
    # swiglu_oai: gates and ups well past the limit of 7, both clamps at work
    x, logits, w13, w2, b13, b2 = make_moe(T, E, D, n_ff, g, device, dtype, bias,
                                           gate_scale=4.0 if activation == "swiglu_oai" else 1.0)
    got = fused_moe(x, logits, w13, w2, k, softmax_first=softmax_first,
                    renormalize=renormalize, activation=activation, w13_bias=b13, w2_bias=b2)
    ref = moe_ref(x, logits, w13, w2, k, softmax_first, renormalize, activation, b13, b2)
    assert got.dtype == dtype and got.shape == (T, D)
    torch.testing.assert_close(got, ref, atol=atol, rtol=rtol)


def test_a_token_alone_equals_the_token_in_a_batch(device):
    """Bit for bit: routing, tiles (block_m by E and dtype), K order and the sum are the
    batch's business nowhere. Token 3 picks token 9's experts, so they share tiles."""
    g = torch.Generator().manual_seed(3)
    x, logits, w13, w2, b13, b2 = make_moe(16, 60, 48, 40, g, device, torch.float32, bias=True)
    logits[3] = logits[9] + 0.01 * torch.randn(60, generator=g).to(device)
    run = lambda x, logits: fused_moe(x, logits, w13, w2, 4, softmax_first=True,  # noqa: E731
                                      renormalize=True, w13_bias=b13, w2_bias=b2)
    full = run(x, logits)
    for i in (0, 9, 15):
        assert torch.equal(run(x[i:i + 1], logits[i:i + 1])[0], full[i])


def test_recorded_launches_replay_with_new_inputs(device):
    """A decode bucket records the layer once and replays it on its static buffers: the sort's
    scratch comes from the recording's pool ([1, n] rows) like every other."""
    g = torch.Generator().manual_seed(4)
    x, logits, w13, w2, _, _ = make_moe(5, 6, 48, 40, g, device, torch.float32)
    run = lambda: fused_moe(x, logits, w13, w2, 2, softmax_first=False,  # noqa: E731
                            renormalize=False)
    with recording(Recording(capacity=8)) as rec:
        out = run()
    x2, logits2 = torch.randn_like(x), torch.randn_like(logits)
    x.copy_(x2)
    logits.copy_(logits2)
    rec.replay()
    assert torch.equal(out, run())


def test_the_stages_compose_as_documented(device):
    """h and y rows are flat ids t*k + j; combine sums a token's k rows in j order."""
    g = torch.Generator().manual_seed(5)
    x, logits, w13, w2, _, _ = make_moe(3, 6, 48, 40, g, device, torch.float32)
    weights, ids = moe_route(logits, 2, softmax_first=True, renormalize=True)
    sorted_ids, tiles, _ = moe_align(ids, 6, 16)
    h = moe_gate_up(x, w13, sorted_ids, tiles, 2)
    e = ids.long()
    gu = torch.einsum("tjnd,td->tjn", w13[e], x).reshape(6, 80)
    torch.testing.assert_close(h, F.silu(gu[:, :40]) * gu[:, 40:], atol=2e-5, rtol=1e-5)
    y = moe_down(h, w2, sorted_ids, tiles, weights)
    ref_y = torch.einsum("fdn,fn->fd", w2[e.flatten()], h) * weights.reshape(6, 1)
    torch.testing.assert_close(y, ref_y, atol=2e-5, rtol=1e-5)
    assert torch.equal(moe_combine(y, 2), y[0::2] + y[1::2])


def test_bad_arguments_are_refused(device):
    logits = torch.randn(2, 6, device=device)
    with pytest.raises(ValueError, match="top_k"):
        moe_route(logits, 7, softmax_first=True, renormalize=False)
    with pytest.raises(ValueError, match="experts"):
        moe_route(torch.randn(2, 300, device=device), 2, softmax_first=True, renormalize=False)
    ids = torch.zeros(2, 2, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="ids"):
        moe_align(ids.long(), 6, 16)
    x, w13 = torch.randn(2, 32, device=device), torch.randn(6, 64, 32, device=device)
    sorted_ids, tiles, _ = moe_align(ids, 6, 16)
    with pytest.raises(ValueError, match="activation"):
        moe_gate_up(x, w13, sorted_ids, tiles, 2, "relu")
    with pytest.raises(ValueError, match="block_m"):
        moe_gate_up(x, w13, *moe_align(ids, 6, 12)[:2], 2)
    with pytest.raises(ValueError, match="w13"):
        moe_gate_up(x, w13[:, :, :16], sorted_ids, tiles, 2)


@pytest.mark.parametrize("dtype,atol,rtol", DTYPES[:2])
def test_the_gpu_tiles(device, dtype, atol, rtol, monkeypatch):
    """The GPU's launch policy through the interpreter: block_m 64 for few experts in 16-bit
    (16 otherwise), 32- / 64-wide K steps (D = 200: several, the last partial), several column
    blocks, 8-row routing blocks, the sort's E-sized chunks, one-row combine programs."""
    monkeypatch.setattr(moe, "INTERPRET", False)
    monkeypatch.setattr(routing, "INTERPRET", False)
    g = torch.Generator().manual_seed(6)
    for T, E, k, activation in ((21, 6, 2, "silu"), (9, 60, 4, "swiglu_oai")):
        x, logits, w13, w2, b13, b2 = make_moe(T, E, 200, 72, g, device, dtype, bias=True)
        sf = activation == "silu"
        got = fused_moe(x, logits, w13, w2, k, softmax_first=sf, renormalize=sf,
                        activation=activation, w13_bias=b13, w2_bias=b2)
        ref = moe_ref(x, logits, w13, w2, k, sf, sf, activation, b13, b2)
        torch.testing.assert_close(got, ref, atol=atol, rtol=rtol)


def test_no_tokens(device):
    x, logits, w13, w2, _, _ = make_moe(0, 6, 48, 40, torch.Generator(), device, torch.float32)
    out = fused_moe(x, logits, w13, w2, 2, softmax_first=True, renormalize=True)
    assert out.shape == (0, 48)


@pytest.mark.parametrize("dtype,atol,rtol", DTYPES)
def test_a_shared_expert_is_added_through_its_sigmoid_gate(device, dtype, atol, rtol):
    """Qwen2-MoE: out = routed + sigmoid(x Wg) * shared(x), the shared expert's output and
    gate logits given; the combine adds it in fp32 after the k routed rows."""
    g = torch.Generator().manual_seed(11)
    x, logits, w13, w2, _, _ = make_moe(5, 6, 48, 40, g, device, dtype)
    shared = torch.randn(5, 48, generator=g).to(device, dtype)
    gate = (torch.randn(5, 1, generator=g) * 3).to(device, dtype)
    got = fused_moe(x, logits, w13, w2, 2, softmax_first=True, renormalize=False,
                    shared=shared, shared_gate=gate)
    ref = moe_ref(x, logits, w13, w2, 2, True, False, "silu").float() \
        + torch.sigmoid(gate.float()) * shared.float()
    torch.testing.assert_close(got, ref.to(dtype), atol=atol, rtol=rtol)


# ------------------------------------------------------------------------------ int8 experts

def int8_experts(w13, w2, device):
    q13, s13 = quantize_experts_int8(w13.float().cpu())
    q2, s2 = quantize_experts_int8(w2.float().cpu())
    deq = lambda q, s: (q.float() * s[:, :, None])  # noqa: E731
    return ([t.to(device) for t in (q13, s13, q2, s2)],
            deq(q13, s13).to(device, w13.dtype), deq(q2, s2).to(device, w2.dtype))


@pytest.mark.parametrize("dtype,atol,rtol", DTYPES)
@pytest.mark.parametrize("case", [0, 2, 3, 5])
def test_int8_experts_equal_their_dequantized_weights(device, dtype, atol, rtol, case):
    """Codes and a per-row scale per expert: the same result as the float kernel on the
    dequantized weights, up to where the scale is applied (the accumulator, not each weight)."""
    T, E, k, D, n_ff, softmax_first, renormalize, activation, bias = FUSED_CASES[case]
    g = torch.Generator().manual_seed(20 + case)
    x, logits, w13, w2, b13, b2 = make_moe(T, E, D, n_ff, g, device, dtype, bias,
                                           gate_scale=4.0 if activation == "swiglu_oai" else 1.0)
    (q13, s13, q2, s2), w13_dq, w2_dq = int8_experts(w13, w2, device)
    got = fused_moe(x, logits, q13, q2, k, softmax_first=softmax_first, renormalize=renormalize,
                    activation=activation, w13_bias=b13, w2_bias=b2, w13_scale=s13, w2_scale=s2)
    ref = moe_ref(x, logits, w13_dq, w2_dq, k, softmax_first, renormalize, activation, b13, b2)
    torch.testing.assert_close(got, ref, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype,atol,rtol", DTYPES[:2])
def test_int8_experts_on_the_gpu_tiles(device, dtype, atol, rtol, monkeypatch):
    """The GPU's tiles (several K steps, the last partial; several column blocks) with codes;
    and a token alone equals the token in the batch."""
    monkeypatch.setattr(moe, "INTERPRET", False)
    monkeypatch.setattr(routing, "INTERPRET", False)
    g = torch.Generator().manual_seed(21)
    x, logits, w13, w2, b13, b2 = make_moe(21, 6, 200, 72, g, device, dtype, bias=True)
    (q13, s13, q2, s2), w13_dq, w2_dq = int8_experts(w13, w2, device)
    check_quantized_tiles(x, logits, q13, q2, w13_dq, w2_dq, b13, b2, atol, rtol,
                          w13_scale=s13, w2_scale=s2)


def check_quantized_tiles(x, logits, q13, q2, w13_dq, w2_dq, b13, b2, atol, rtol, **scales):
    """Quantized experts against the float reference on their dequantized weights (top 2,
    renormalised, biases); a token alone equals the token in the batch (bitwise)."""
    run = lambda x, logits: fused_moe(x, logits, q13, q2, 2, softmax_first=True,  # noqa: E731
                                      renormalize=True, w13_bias=b13, w2_bias=b2, **scales)
    got = run(x, logits)
    ref = moe_ref(x, logits, w13_dq, w2_dq, 2, True, True, "silu", b13, b2)
    torch.testing.assert_close(got, ref, atol=atol, rtol=rtol)
    for i in (0, x.shape[0] - 1):
        assert torch.equal(run(x[i:i + 1], logits[i:i + 1])[0], got[i])


def test_int8_experts_refuse_bad_scales(device):
    g = torch.Generator().manual_seed(22)
    x, logits, w13, w2, _, _ = make_moe(3, 6, 48, 40, g, device, torch.float32)
    (q13, s13, q2, s2), _, _ = int8_experts(w13, w2, device)
    kw = dict(softmax_first=True, renormalize=True)
    with pytest.raises(ValueError, match="must be the activations'"):
        fused_moe(x, logits, q13, q2, 2, **kw)  # codes without scales
    with pytest.raises(ValueError, match="scales must be fp32"):
        fused_moe(x, logits, q13, q2, 2, w13_scale=s13[:, :8], w2_scale=s2, **kw)
    with pytest.raises(ValueError, match="must be int8"):
        fused_moe(x, logits, w13, w2, 2, w13_scale=s13, w2_scale=s2, **kw)


# ------------------------------------------------------------------------------ expert load

@pytest.mark.parametrize("T,E,k", [(1, 6, 2), (37, 60, 4), (9, 128, 8), (70, 6, 1)])
def test_route_counts_each_experts_rows_with_a_slot(device, T, E, k, monkeypatch):
    """counts[e] += rows with a KV slot (>= 0) that picked e; padding rows (-1) are not
    counted; the counts accumulate over calls; routing itself is unchanged. The GPU's 8-row
    programs too (several programs adding to one expert)."""
    g = torch.Generator().manual_seed(T + E)
    logits = (torch.randn(T, E, generator=g) * 2).to(device)
    rows = torch.arange(T, dtype=torch.int64, device=device)
    rows[T // 2:][::3] = -1  # padding among the rows
    counts = torch.zeros(E, dtype=torch.int64, device=device)
    want_w, want_ids = moe_route(logits, k, softmax_first=True, renormalize=True)
    for interpret in (True, False):
        monkeypatch.setattr(routing, "INTERPRET", interpret)
        w, ids = moe_route(logits, k, softmax_first=True, renormalize=True, counts=counts,
                           rows=rows)
        assert torch.equal(w, want_w) and torch.equal(ids, want_ids)
    kept = want_ids[rows >= 0].long().flatten()
    assert torch.equal(counts, 2 * torch.bincount(kept, minlength=E))


def test_fused_moe_counts_and_refuses_bad_counters(device):
    g = torch.Generator().manual_seed(23)
    x, logits, w13, w2, _, _ = make_moe(5, 6, 48, 40, g, device, torch.float32)
    counts = torch.zeros(6, dtype=torch.int64, device=device)
    rows = torch.tensor([0, 1, -1, 3, 4], device=device)
    kw = dict(softmax_first=True, renormalize=True)
    out = fused_moe(x, logits, w13, w2, 2, counts=counts, rows=rows, **kw)
    assert torch.equal(out, fused_moe(x, logits, w13, w2, 2, **kw))
    assert int(counts.sum()) == 4 * 2
    with pytest.raises(ValueError, match="counts must be"):
        fused_moe(x, logits, w13, w2, 2, counts=counts.int(), rows=rows, **kw)
    with pytest.raises(ValueError, match="rows must be"):
        fused_moe(x, logits, w13, w2, 2, counts=counts, rows=None, **kw)


# ------------------------------------------------------------------------------ int4 experts

def int4_experts(w13, w2, device):
    """Int4Experts of both stacks (group 128, zero points) and their dequantized weights."""
    from tinyserve.engine.loading.quantize import quantize_experts_int4

    out = []
    for w in (w13, w2):
        q = quantize_experts_int4(w.float().cpu(), w.dtype, device)
        out += [q, q.dequantized().to(w.dtype)]
    return out


@pytest.mark.parametrize("dtype,atol,rtol", DTYPES)
@pytest.mark.parametrize("case", [0, 2, 3, 5])
def test_int4_experts_equal_their_dequantized_weights(device, dtype, atol, rtol, case):
    """Group-wise codes with zero points (K = 48 or 64 in one padded group; F = 40 or 96):
    the float kernel's result on the dequantized weights."""
    T, E, k, D, n_ff, softmax_first, renormalize, activation, bias = FUSED_CASES[case]
    g = torch.Generator().manual_seed(30 + case)
    x, logits, w13, w2, b13, b2 = make_moe(T, E, D, n_ff, g, device, dtype, bias,
                                           gate_scale=4.0 if activation == "swiglu_oai" else 1.0)
    q13, w13_dq, q2, w2_dq = int4_experts(w13, w2, device)
    got = fused_moe(x, logits, q13, q2, k, softmax_first=softmax_first, renormalize=renormalize,
                    activation=activation, w13_bias=b13, w2_bias=b2)
    ref = moe_ref(x, logits, w13_dq, w2_dq, k, softmax_first, renormalize, activation, b13, b2)
    torch.testing.assert_close(got, ref, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype,atol,rtol", DTYPES[:2])
def test_int4_experts_on_the_gpu_tiles(device, dtype, atol, rtol, monkeypatch):
    """Several groups along K (D = 300: two whole groups and a partial third; F = 200), 32- /
    64-wide K steps inside each group, several column blocks; a token alone equals the token
    in the batch."""
    monkeypatch.setattr(moe, "INTERPRET", False)
    monkeypatch.setattr(routing, "INTERPRET", False)
    g = torch.Generator().manual_seed(31)
    x, logits, w13, w2, b13, b2 = make_moe(21, 6, 300, 200, g, device, dtype, bias=True)
    q13, w13_dq, q2, w2_dq = int4_experts(w13, w2, device)
    check_quantized_tiles(x, logits, q13, q2, w13_dq, w2_dq, b13, b2, atol, rtol)


def test_int4_experts_refuse_bad_parts(device):
    g = torch.Generator().manual_seed(32)
    x, logits, w13, w2, _, _ = make_moe(3, 6, 48, 40, g, device, torch.float32)
    q13, _, q2, _ = int4_experts(w13, w2, device)
    kw = dict(softmax_first=True, renormalize=True)
    bad = Int4Experts(q13.qweight, q13.scales, q13.zeros.int(), 128, 48)
    with pytest.raises(ValueError, match="zeros"):
        fused_moe(x, logits, bad, q2, 2, **kw)
    bad = Int4Experts(q13.qweight, q13.scales, q13.zeros, 48, 48)
    with pytest.raises(ValueError, match="power-of-two"):
        fused_moe(x, logits, bad, q2, 2, **kw)
