"""GGUF's block formats as tinyserve holds them (engine/gguf_quants.py) against gguf-py's own
dequantization of the same bytes, bit for bit in fp32; the file reader on what gguf-py writes
(metadata of every type, split files, refusals); and each kept form through its kernel."""

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from tests.gguf_writer import pack_q4_k, pack_q6_k  # noqa: E402
from tinyserve.engine.loading.gguf_quants import Quantized, decode  # noqa: E402
from tinyserve.formats.gguf import GGUFError, GGUFFile  # noqa: E402

Q = gguf.GGMLQuantizationType
ROWS, K = 6, 512


def _random_bytes(qtype, rows, k, g):
    """Valid blocks of any content: random bytes with finite fp16 scales where they sit."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = g.integers(0, 256, (rows, k // block, size), dtype=np.uint8)
    halves = {Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}[qtype]
    for at in halves:
        raw[..., at:at + 2] = (g.standard_normal((rows, k // block)) * 0.01).astype(
            np.float16).view(np.uint8).reshape(rows, k // block, 2)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1])
def test_quantized_by_gguf_py_decodes_as_gguf_py_dequantizes(qtype):
    g = np.random.default_rng(int(qtype))
    w = (g.standard_normal((ROWS, K)) * g.uniform(0.01, 1, (ROWS, 1))).astype(np.float32)
    raw = gguf.quants.quantize(w, qtype)
    ours = decode(qtype.name, raw.reshape(-1), ROWS, K)
    assert isinstance(ours, Quantized)
    np.testing.assert_array_equal(ours.dequantize(), gguf.quants.dequantize(raw, qtype))


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q5_K, Q.Q6_K])
def test_k_quants_of_any_content_decode_as_gguf_py_dequantizes(qtype):
    """Random blocks exercise every code, scale and bit position of the super-block layouts."""
    g = np.random.default_rng(int(qtype))
    raw = _random_bytes(qtype, ROWS, K, g)
    ours = decode(qtype.name, raw.reshape(-1), ROWS, K)
    np.testing.assert_array_equal(ours.dequantize(), gguf.quants.dequantize(raw, qtype))


@pytest.mark.parametrize("pack,qtype", [(pack_q4_k, Q.Q4_K), (pack_q6_k, Q.Q6_K)])
def test_the_test_packers_write_what_gguf_py_reads(pack, qtype):
    """The tests' own K-quant packers (gguf-py cannot quantize these) against gguf-py's reader:
    close to the weights they pack (round to nearest), so files written with them mean what
    they should."""
    g = np.random.default_rng(3)
    w = (g.standard_normal((ROWS, K)) * 0.05).astype(np.float32)
    back = gguf.quants.dequantize(pack(w), qtype)
    err = np.abs(back - w).mean() / np.abs(w).mean()
    assert err < (0.12 if qtype == Q.Q4_K else 0.03), err  # 4 bits: ~1/15 of a range


@pytest.mark.parametrize("dtype", ["F16", "BF16", "F32"])
def test_float_types(dtype):
    g = np.random.default_rng(0)
    w = g.standard_normal((3, 64)).astype(np.float32)
    if dtype == "F16":
        raw, want = w.astype(np.float16).view(np.uint8), w.astype(np.float16).astype(np.float32)
    elif dtype == "BF16":
        bits = (w.view(np.uint32) >> 16).astype(np.uint16)
        raw, want = bits.view(np.uint8), (bits.astype(np.uint32) << 16).view(np.float32)
    else:
        raw, want = w.view(np.uint8), w
    np.testing.assert_array_equal(decode(dtype, raw.reshape(-1), 3, 64), want)


def test_unsupported_types_are_refused_by_name():
    with pytest.raises(ValueError, match="Q2_K is not supported"):
        decode("Q2_K", np.zeros(84, np.uint8), 1, 256)


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q8_0, Q.Q5_1, Q.Q6_K])
def test_each_kept_form_through_its_kernel(device, qtype):
    """Packed for the kernels as the loader packs them (gguf_weights.py): x @ W.T equals x @ the
    dequantized W within fp32 rounding."""
    from tinyserve.engine.loading.gguf_weights import _pack_int4
    from tinyserve.kernels import int4_matmul, int8_group_matmul

    g = np.random.default_rng(int(qtype) + 10)
    N = 40
    w = (g.standard_normal((N, K)) * 0.05).astype(np.float32)
    raw = {Q.Q4_K: pack_q4_k, Q.Q6_K: pack_q6_k}.get(qtype, lambda a: gguf.quants.quantize(a, qtype))(w)
    form = decode(qtype.name, raw.reshape(-1), N, K)
    x = torch.from_numpy(g.standard_normal((3, K)).astype(np.float32)).to(device)
    mins = None if form.mins is None else torch.from_numpy(form.mins.astype(np.float32)).to(device)
    scales = torch.from_numpy(form.scales.astype(np.float32)).to(device)
    if form.bits == 4:
        y = int4_matmul(x, torch.from_numpy(_pack_int4(form.codes)).to(device), scales, None,
                        form.group, mins=mins)
    else:
        y = int8_group_matmul(x, torch.from_numpy(form.codes).to(device), scales, form.group,
                              mins=mins)
    ref = x.cpu() @ torch.from_numpy(form.dequantize()).T
    torch.testing.assert_close(y.cpu(), ref, atol=1e-4, rtol=1e-5)


def _write(path, tensors=(), **meta):
    w = gguf.GGUFWriter(str(path), "llama")
    for k, v in meta.items():
        w.add_key_value(k, v[0], v[1])
    for name, arr in tensors:
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_the_reader_reads_every_metadata_type_and_tensor(tmp_path):
    V = gguf.GGUFValueType
    path = tmp_path / "m.gguf"
    a = np.arange(24, dtype=np.float32).reshape(4, 6)
    _write(path, [("a.weight", a), ("b", np.arange(5, dtype=np.float32))],
           **{"x.u8": (7, V.UINT8), "x.i32": (-3, V.INT32), "x.f32": (0.5, V.FLOAT32),
              "x.bool": (True, V.BOOL), "x.s": ("héllo", V.STRING),
              "x.arr": ([1, 2, 3], V.ARRAY), "x.sarr": (["a", "b"], V.ARRAY),
              "x.u64": (2**40, V.UINT64), "x.f64": (0.25, V.FLOAT64)})
    f = GGUFFile(path)
    m = f.metadata
    assert (m["x.u8"], m["x.i32"], m["x.f32"], m["x.bool"], m["x.s"]) == (7, -3, 0.5, True, "héllo")
    assert (m["x.arr"], m["x.sarr"], m["x.u64"], m["x.f64"]) == ([1, 2, 3], ["a", "b"], 2**40, 0.25)
    assert f.architecture == "llama"
    t = f.tensors["a.weight"]
    assert t.shape == (4, 6) and t.type_name == "F32"
    np.testing.assert_array_equal(f.data("a.weight").view(np.float32).reshape(4, 6), a)
    np.testing.assert_array_equal(f.data("b").view(np.float32), np.arange(5))


def test_split_files_read_as_one(tmp_path):
    a, b = np.ones((2, 32), np.float32), np.full((3, 32), 2.0, np.float32)
    first = tmp_path / "m-00001-of-00002.gguf"
    _write(first, [("a", a)])
    _write(tmp_path / "m-00002-of-00002.gguf", [("b", b)])
    f = GGUFFile(tmp_path / "m-00002-of-00002.gguf")  # any part names the whole
    assert set(f.tensors) == {"a", "b"} and f.path == first
    np.testing.assert_array_equal(f.data("b").view(np.float32).reshape(3, 32), b)
    (tmp_path / "m-00002-of-00002.gguf").unlink()
    with pytest.raises(GGUFError, match="without its part"):
        GGUFFile(first)


@pytest.mark.parametrize("content,match", [
    (b"", "empty"), (b"GGML" + bytes(20), "no GGUF magic"),
    (b"GGUF" + (99).to_bytes(4, "little") + bytes(16), "version 99"),
    (b"GGUF" + (3).to_bytes(4, "little") + (1).to_bytes(8, "little") + bytes(8), "truncated"),
])
def test_bad_files_are_refused_with_their_reason(tmp_path, content, match):
    path = tmp_path / "bad.gguf"
    path.write_bytes(content)
    with pytest.raises(GGUFError, match=match):
        GGUFFile(path)


def test_fused_parts_of_mixed_types_are_held_exactly(device):
    """q / k / v in Q8_0, Q4_1 and Q6_K (groups of 32, 32 and 16; minimums in one): held as
    int8 codes at groups of 16, with minimums for all; x @ W.T equals x @ the three dequantized
    parts stacked."""
    from tinyserve.engine.loading.gguf_weights import _Reader
    from tinyserve.engine.model.linear import linear
    from tinyserve.engine.model.weights import Int8GroupLinear

    g = np.random.default_rng(5)
    parts = []
    for qtype, rows in ((Q.Q8_0, 24), (Q.Q4_1, 16), (Q.Q6_K, 8)):
        w = (g.standard_normal((rows, K)) * 0.05).astype(np.float32)
        raw = pack_q6_k(w) if qtype == Q.Q6_K else gguf.quants.quantize(w, qtype)
        parts.append(decode(qtype.name, raw.reshape(-1), rows, K))
    r = _Reader.__new__(_Reader)
    r.dtype, r.device, r.dequantize, r.mixed = torch.float32, device, False, set()
    lin = r._fuse(parts, K, None, "blk.0.attn_q.weight")
    assert isinstance(lin, Int8GroupLinear) and lin.group_size == 16 and lin.mins is not None
    x = torch.from_numpy(g.standard_normal((3, K)).astype(np.float32)).to(device)
    want = x.cpu() @ torch.from_numpy(np.concatenate([p.dequantize() for p in parts])).T
    torch.testing.assert_close(linear(x, lin).cpu(), want, atol=1e-4, rtol=1e-5)
