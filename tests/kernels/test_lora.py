"""lora_shrink / lora_expand (multi-LoRA over a ragged batch) against float32 torch references."""

import sys

import pytest
import torch

from tests.kernels.dtypes import bf16
from tinyserve.kernels.lora import lora_expand, lora_shrink
from tinyserve.kernels.utils import Recording, recording

lora = sys.modules["tinyserve.kernels.lora"]

# shrink: y is fp32 from x and A in the dtype, an fp32 accumulator like the reference's: only
# the summation order differs (|y| ~ 1-4). bf16 x goes through a bf16 tl.dot: GPU only.
SHRINK_DTYPES = [(torch.float32, 1e-4, 1e-5), (torch.float16, 2e-4, 1e-4),
                 bf16(2e-4, 1e-4, math=True)]
# expand: out in the dtype (|out| up to ~10), rounded once by kernel and reference alike; a
# GPU's other order (tf32x3 for 16-bit outputs) may round one step the other way. The kernel
# only loads, converts and computes in fp32, so bf16 runs on the CPU too.
EXPAND_DTYPES = [(torch.float32, 1e-4, 1e-5), (torch.float16, 2e-2, 2e-3), bf16(5e-2, 1.6e-2)]
ROWS = [1, 3, 17, 69]
RANKS = [1, 8, 16, 64]  # the largest resident rank: the others are padded to it
K_FOR = {1: 100, 3: 300, 17: 130, 69: 513}  # never a multiple of the block
N_FOR = {1: 64, 3: 200, 17: 1000, 69: 70}
S = 4  # resident slots


def slot_ranks(r_max: int) -> list[int]:
    return [r_max, max(1, r_max // 2), 1, r_max]


def make_slots(T: int, g: torch.Generator, device) -> torch.Tensor:
    """Mixed slots: a run of one adapter (a prefill chunk), then decode-like rows with repeats
    and -1 (base model) rows; T == 1 has an adapter."""
    slots = torch.randint(-1, S, (T,), generator=g)
    if T >= 3:
        slots[: T // 2] = 2  # a run
        slots[T // 2] = -1
        slots[-1] = 2  # 2 again, away from its run
    else:
        slots[:] = 1
    return slots.to(device, torch.int32)


def make_a(R: int, K: int, ranks: list[int], g, device, dtype) -> torch.Tensor:
    """[S, R, K]: each slot's rank rows (~1/sqrt(K), as LoRA's init), zero rows past it."""
    a = torch.zeros(S, R, K)
    for s, rank in enumerate(ranks):
        a[s, :rank] = torch.randn(rank, K, generator=g) / K ** 0.5
    return a.to(device, dtype)


def make_b(N: int, r: int, ranks: list[int], g, device, dtype) -> torch.Tensor:
    """[S, N, r]: each slot's rank columns, zero columns past it."""
    b = torch.zeros(S, N, r)
    for s, rank in enumerate(ranks):
        b[s, :, :rank] = torch.randn(N, rank, generator=g) * 0.5
    return b.to(device, dtype)


def shrink_ref(x, a, slots):
    y = torch.zeros(x.shape[0], a.shape[1], device=x.device)
    live = slots >= 0
    y[live] = torch.einsum("tk,trk->tr", x[live].float(), a[slots[live].long()].float())
    return y


def expand_ref(out, y, b, slots, scales, y_off=0, out_off=0):
    ref = out.clone()
    live = slots >= 0
    s = slots[live].long()
    N, r = b.shape[1:]
    delta = torch.einsum("tj,tnj->tn", y[live, y_off:y_off + r], b[s].float()) * scales[s, None]
    ref[live, out_off:out_off + N] = (out[live, out_off:out_off + N].float() + delta).to(out.dtype)
    return ref


@pytest.mark.parametrize("dtype,atol,rtol", SHRINK_DTYPES)
@pytest.mark.parametrize("r_max", RANKS)
@pytest.mark.parametrize("T", ROWS)
def test_shrink(device, dtype, atol, rtol, T, r_max):
    g = torch.Generator().manual_seed(T * 100 + r_max)
    K = K_FOR[T]
    x = torch.randn(T, K, generator=g).to(device, dtype)
    a = make_a(r_max, K, slot_ranks(r_max), g, device, dtype)
    slots = make_slots(T, g, device)
    y = lora_shrink(x, a, slots)
    assert y.dtype == torch.float32 and y.shape == (T, r_max)
    torch.testing.assert_close(y, shrink_ref(x, a, slots), atol=atol, rtol=rtol)
    assert not y[slots < 0].any(), "rows without an adapter are zeros"


@pytest.mark.parametrize("dtype,atol,rtol", EXPAND_DTYPES)
@pytest.mark.parametrize("r_max", RANKS)
@pytest.mark.parametrize("T", ROWS)
def test_expand(device, dtype, atol, rtol, T, r_max):
    """A slice of out (columns offset by 5, 3 spare after) from a slice of y (offset by 2)."""
    g = torch.Generator().manual_seed(T * 10 + r_max)
    N = N_FOR[T]
    y = torch.randn(T, r_max + 3, generator=g).to(device)
    b = make_b(N, r_max, slot_ranks(r_max), g, device, dtype)
    scales = (torch.rand(S, generator=g) * 2).to(device)
    slots = make_slots(T, g, device)
    out = torch.randn(T, N + 8, generator=g).to(device, dtype)
    ref = expand_ref(out, y, b, slots, scales, 2, 5)
    lora_expand(y, b, slots, scales, out, y_offset=2, out_offset=5)
    torch.testing.assert_close(out, ref, atol=atol, rtol=rtol)
    base = slots < 0
    assert torch.equal(out[base], ref[base]) and torch.equal(out[:, :5], ref[:, :5])
    assert torch.equal(out[:, 5 + N:], ref[:, 5 + N:])


@pytest.mark.parametrize("dtype,atol,rtol", [(torch.float32, 1e-4, 1e-5),
                                             (torch.float16, 2e-2, 2e-3)])
@pytest.mark.parametrize("T,r_max", [(17, 8), (69, 16)])
def test_fused_slices_one_shrink_then_an_expand_per_slice(device, dtype, atol, rtol, T, r_max):
    """q | k | v: their A stacked along R (R = 3 * r_max) for one shrink; each slice's B
    expanded from its y columns into its columns of the fused projection's output."""
    g = torch.Generator().manual_seed(T + r_max)
    K, widths = 96, (80, 24, 24)
    x = torch.randn(T, K, generator=g).to(device, dtype)
    a_parts = [make_a(r_max, K, slot_ranks(r_max), g, device, dtype) for _ in widths]
    bs = [make_b(n, r_max, slot_ranks(r_max), g, device, dtype) for n in widths]
    scales = (torch.rand(S, generator=g) + 0.5).to(device)
    slots = make_slots(T, g, device)
    out = torch.randn(T, sum(widths), generator=g).to(device, dtype)
    y = lora_shrink(x, torch.cat(a_parts, dim=1), slots)
    ref, col = out.clone(), 0
    for i, (a_i, b_i) in enumerate(zip(a_parts, bs, strict=True)):
        y_i = shrink_ref(x, a_i, slots)
        torch.testing.assert_close(y[:, i * r_max:(i + 1) * r_max], y_i, atol=1e-4, rtol=1e-4)
        ref = expand_ref(ref, y_i, b_i, slots, scales, 0, col)
        lora_expand(y, b_i, slots, scales, out, y_offset=i * r_max, out_offset=col)
        col += b_i.shape[1]
    torch.testing.assert_close(out, ref, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_base_rows_keep_their_bits(device, dtype):
    """Rows without an adapter (-1, or a slot past S) are never read or written: -0.0, NaN,
    inf and subnormals in them come back bit for bit, next to adapter rows; an all-base batch
    leaves out as it was and gives zero y."""
    g = torch.Generator().manual_seed(3)
    T, K, N, r = 12, 40, 50, 8
    specials = torch.tensor([-0.0, float("nan"), float("inf"), -float("inf"), 1e-40, 3.0])
    x_dtype = torch.float16 if dtype == torch.bfloat16 else dtype  # bf16 shrink: GPU only
    x = torch.randn(T, K, generator=g).to(device, x_dtype)
    a = make_a(r, K, [r] * S, g, device, x_dtype)
    b = make_b(N, r, [r] * S, g, device, dtype)
    scales = torch.ones(S, device=device)
    slots = torch.tensor([0, -1, 1, -1, 3, S, -1, 0, 1000, -1, 2, -1], dtype=torch.int32)
    slots = slots.to(device)
    out = torch.randn(T, N, generator=g).to(dtype)
    out[1::2] = specials.repeat(N // len(specials) + 1)[:N].to(dtype)
    out = out.to(device)
    before = out.clone()
    y = lora_shrink(x, a, slots, out=torch.full((T, r), float("nan"), device=device))
    lora_expand(y, b, slots, scales, out)
    base = (slots < 0) | (slots >= S)
    assert torch.equal(y[base].view(torch.int32), torch.zeros_like(y[base]).view(torch.int32))
    assert torch.equal(out[base].view(torch.int16 if dtype != torch.float32 else torch.int32),
                       before[base].view(torch.int16 if dtype != torch.float32 else torch.int32))
    assert not torch.equal(out[~base], before[~base])
    none = torch.full((T,), -1, dtype=torch.int32, device=device)
    y = lora_shrink(x, a, none, out=torch.full((T, r), float("nan"), device=device))
    out = before.clone()
    lora_expand(y, b, none, scales, out)
    assert not y.any() and torch.equal(out.view(torch.uint8), before.view(torch.uint8))


def _gpu_tiles(monkeypatch, enabled: bool) -> dict:
    """The GPU's tiles (16-row tiles, split-K chunks) run through the interpreter: split-K
    given, since the default asks the GPU for its SM count."""
    if enabled:
        monkeypatch.setattr(lora, "INTERPRET", False)
        return dict(split_k=2, split_grid=True)
    return {}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("gpu_tiles", [False, True], ids=["interpreter-tiles", "gpu-tiles"])
def test_rows_are_batch_invariant(device, monkeypatch, dtype, gpu_tiles):
    """A row's y and out are the same bits alone, in a slice of the batch and in the whole
    mixed batch (other rows' adapters, tile sizes that depend on T on the CPU, tiles holding
    one or several adapters)."""
    # pins: fixed tiles per shape, each slot's sum from zero, rows selected never summed
    split = _gpu_tiles(monkeypatch, gpu_tiles)
    g = torch.Generator().manual_seed(11)
    T, K, N, R = 69, 300, 70, 16
    x = torch.randn(T, K, generator=g).to(device, dtype)
    a = make_a(R, K, slot_ranks(R), g, device, dtype)
    b = make_b(N, R, slot_ranks(R), g, device, dtype)
    scales = torch.rand(S, generator=g).to(device)
    slots = make_slots(T, g, device)
    base = torch.randn(T, N, generator=g).to(device, dtype)

    def run(rows):
        y = lora_shrink(x[rows], a, slots[rows], **split)
        out = base[rows].clone()
        lora_expand(y, b, slots[rows], scales, out)
        return y, out

    y_all, out_all = run(slice(0, T))
    for rows in (slice(3, 4), slice(40, 41), slice(T - 1, T), slice(60, T), slice(17, 50)):
        y, out = run(rows)
        assert torch.equal(y, y_all[rows]) and torch.equal(out, out_all[rows]), rows
    torch.testing.assert_close(y_all, shrink_ref(x, a, slots), atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("gpu_tiles", [False, True], ids=["interpreter-tiles", "gpu-tiles"])
def test_split_k_gives_the_same_bits_in_one_program_or_many(device, monkeypatch, gpu_tiles):
    """K chunks (whole tiles each) summed in order: in separate programs plus the sum kernel,
    or one after another in each program, the same fp32 operations; close to the reference."""
    _gpu_tiles(monkeypatch, gpu_tiles)
    g = torch.Generator().manual_seed(5)
    T, K, R = 37, 700, 24
    x = torch.randn(T, K, generator=g).to(device, torch.float16)
    a = make_a(R, K, [24, 5, 1, 24], g, device, torch.float16)
    slots = make_slots(T, g, device)
    ref = shrink_ref(x, a, slots)
    for split in (2, 3):
        apart = lora_shrink(x, a, slots, split_k=split, split_grid=True)
        inside = lora_shrink(x, a, slots, split_k=split, split_grid=False)
        assert torch.equal(apart, inside)
        torch.testing.assert_close(apart, ref, atol=2e-4, rtol=1e-4)


def test_a_recorded_step_replays_with_the_buffers_slots_and_weights(device):
    """Decode buckets record the launches once (also with no adapter rows: both launches are
    in the recording) and replay them: the results follow whatever the static slot, weight
    and scale buffers hold at replay."""
    g = torch.Generator().manual_seed(8)
    T, K, N, R = 9, 64, 48, 8
    x = torch.randn(T, K, generator=g).to(device)
    a = make_a(R, K, [R] * S, g, device, torch.float32)
    b = make_b(N, R, [R] * S, g, device, torch.float32)
    scales = torch.ones(S, device=device)
    slots = torch.full((T,), -1, dtype=torch.int32, device=device)
    base = torch.randn(T, N, generator=g).to(device)
    out = base.clone()
    rec = Recording(capacity=16)
    with recording(rec):
        y = lora_shrink(x, a, slots)
        lora_expand(y, b, slots, scales, out)
    assert len(rec.launches) == 2 and torch.equal(out, base)
    slots.copy_(make_slots(T, g, device))
    a.copy_(make_a(R, K, [R, 3, 1, R], g, device, torch.float32))
    scales.copy_(torch.rand(S, generator=g).to(device))
    out.copy_(base)
    rec.replay()
    y_ref = shrink_ref(x, a, slots)
    torch.testing.assert_close(y, y_ref, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(out, expand_ref(base, y_ref, b, slots, scales), atol=1e-4,
                               rtol=1e-5)


def test_bad_arguments_are_refused(device):
    x = torch.randn(3, 16, device=device)
    a = torch.randn(S, 8, 16, device=device)
    slots = torch.zeros(3, dtype=torch.int32, device=device)
    y = torch.zeros(3, 8, device=device)
    b, scales, out = torch.randn(S, 10, 4, device=device), torch.ones(S, device=device), \
        torch.zeros(3, 10, device=device)
    with pytest.raises(ValueError, match="inner sizes"):
        lora_shrink(x, a[:, :, :15], slots)
    with pytest.raises(ValueError, match="dtype"):
        lora_shrink(x, a.half(), slots)
    with pytest.raises(ValueError, match="int32"):
        lora_shrink(x, a, slots.long())
    with pytest.raises(ValueError, match="y columns"):
        lora_expand(y, b, slots, scales, out, y_offset=5)
    with pytest.raises(ValueError, match="out columns"):
        lora_expand(y, b, slots, scales, out, out_offset=1)
    with pytest.raises(ValueError, match="scales"):
        lora_expand(y, b, slots, scales[:2], out)
    with pytest.raises(ValueError, match="fp32"):
        lora_expand(y.half(), b, slots, scales, out)
