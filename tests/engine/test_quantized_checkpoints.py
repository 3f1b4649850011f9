"""GPTQ and AWQ 4-bit checkpoints, and --quantization int4, against a float32 reference.

A random-weight Llama (and a Qwen2, a Phi-3 and a Gemma 2) is built with transformers; its
linear layers are quantized here (round to nearest) and packed by packers written in this file
the way AutoGPTQ's QuantLinear.pack and AutoAWQ's WQLinear_GEMM.from_linear pack, independent
of tinyserve's. The reference is the same transformers model with each linear weight replaced
by this file's dequantization, W = (q - z) * s: the full model's logits must agree to relative
L2 < 1e-3.
"""

import copy
import json
import shutil

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from safetensors.torch import load_file, save_file  # noqa: E402

from tests.engine.test_model_vs_transformers import hf_logits, rel_l2, run_chunk  # noqa: E402
from tinyserve.config import EngineConfig  # noqa: E402
from tinyserve.engine.device_engine import DeviceEngine  # noqa: E402
from tinyserve.engine.loading.checkpoint import checkpoint_quantization, load_weights  # noqa: E402
from tinyserve.engine.loading.demo import write_tokenizer  # noqa: E402
from tinyserve.engine.loading.model_config import ModelLoadError, load_model_config  # noqa: E402
from tinyserve.engine.loading.quantize import quantize_int4_linear  # noqa: E402
from tinyserve.engine.loading.quantized_checkpoints import parse_quantization_config, repack  # noqa: E402
from tinyserve.engine.model.weights import Int4Linear  # noqa: E402
from tinyserve.kernels.int4_pack import unpack_int4  # noqa: E402

G = 128
# Every in_features a multiple of 128 (D, Hq * Dh, I), GQA 2:1; out_features multiples of 8.
CONFIG = dict(vocab_size=300, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=32,
              max_position_embeddings=128, tie_word_embeddings=False,
              rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ's order_map: nibble i holds column ORDER[i]
IDS = torch.randint(0, 300, (21,), generator=torch.Generator().manual_seed(1)).tolist()


# ---- reference quantizer, packers and dequantization ----


def rtn(w: torch.Tensor, sym: bool, scale_dtype: torch.dtype):
    """w: [N, K] -> codes q [N, K], zeros z and scales s [N, K / G]; symmetric as GPTQ's
    Quantizer (zero 8, scale 2 max|w| / 15), asymmetric as AutoAWQ's pseudo_quantize_tensor."""
    N, K = w.shape
    wg = w.float().view(N, K // G, G)
    if sym:
        s, z = wg.abs().amax(-1) * 2 / 15, torch.full((N, K // G), 8.0)
    else:
        lo, hi = wg.amin(-1), wg.amax(-1)
        s = (hi - lo) / 15
        z = (-torch.round(lo / s)).clamp(0, 15)
    s = s.to(scale_dtype)
    q = torch.clamp(torch.round(wg / s.float()[..., None]) + z[..., None], 0, 15)
    return q.view(N, K).long(), z.long(), s


def dequant(q, z, s):
    return (q - z.repeat_interleave(G, 1)).float() * s.float().repeat_interleave(G, 1)


def pack_gptq(q, z, s, v1: bool):
    """As AutoGPTQ's pack (numpy uint32): qweight [K / 8, N] with k = 8 * row + j at bits 4j;
    qzeros [K / G, N / 8] with n = 8 * col + j at bits 4j, holding zero - 1 in v1."""
    intweight = q.t().contiguous().numpy().astype(np.uint32)  # [K, N]
    qweight = np.zeros((intweight.shape[0] // 8, intweight.shape[1]), dtype=np.uint32)
    for row in range(qweight.shape[0]):
        for j in range(8):
            qweight[row] |= intweight[8 * row + j] << np.uint32(4 * j)
    zeros = (z.t() - (1 if v1 else 0)).numpy().astype(np.uint32)  # [K / G, N]
    qzeros = np.zeros((zeros.shape[0], zeros.shape[1] // 8), dtype=np.uint32)
    for col in range(qzeros.shape[1]):
        for j in range(8):
            qzeros[:, col] |= zeros[:, 8 * col + j] << np.uint32(4 * j)
    return {"qweight": torch.from_numpy(qweight.view(np.int32)),
            "qzeros": torch.from_numpy(qzeros.view(np.int32)), "scales": s.t().contiguous().half()}


def pack_awq(q, z, s):
    """As AutoAWQ's WQLinear_GEMM.from_linear (torch int32): along N, interleaved."""
    def pack(cols):  # [R, N] -> [R, N / 8]
        cols = cols.to(torch.int32)
        out = torch.zeros((cols.shape[0], cols.shape[1] // 8), dtype=torch.int32)
        for c in range(out.shape[1]):
            for i in range(8):
                out[:, c] |= cols[:, c * 8 + AWQ_ORDER[i]] << (i * 4)
        return out
    return {"qweight": pack(q.t()), "qzeros": pack(z.t()), "scales": s.t().contiguous().half()}


# ---- checkpoints ----


@pytest.fixture(scope="module")
def float_checkpoint(tmp_path_factory):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(initializer_range=0.15, rms_norm_eps=1e-5, **CONFIG)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    path = tmp_path_factory.mktemp("float")
    hf.save_pretrained(path)
    write_tokenizer(path)
    return hf, path


def write_quantized(hf, src, dst, kind: str, linears: tuple[str, ...] = LINEARS):
    """kind: gptq-sym-v1, gptq-asym-v1, gptq-asym-v2 or awq. Returns the reference model."""
    method, sym, fmt = (kind.split("-") + ["", ""])[:3]
    sym = sym == "sym"
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    ref = copy.deepcopy(hf)
    for name, module in ref.named_modules():
        if not name.endswith(linears):
            continue
        q, z, s = rtn(module.weight.data, sym, torch.float16)
        if method == "gptq":
            assert int(z.min()) >= 1  # (v1's zero - 1 would wrap at 0, as in AutoGPTQ itself)
            packed = pack_gptq(q, z, s, v1=fmt == "v1")
            if fmt == "v1":  # AutoGPTQ writes g_idx; a v2 checkpoint here goes without
                packed["g_idx"] = torch.arange(q.shape[1], dtype=torch.int32) // G
        else:
            packed = pack_awq(q, z, s)
        del tensors[name + ".weight"]
        tensors.update({f"{name}.{k}": v for k, v in packed.items()})
        module.weight.data = dequant(q, z, s)
    save_file(tensors, dst / "model.safetensors")
    qc = ({"quant_method": "gptq", "bits": 4, "group_size": G, "desc_act": False, "sym": sym,
           "checkpoint_format": "gptq" if fmt == "v1" else "gptq_v2"} if method == "gptq" else
          {"quant_method": "awq", "bits": 4, "group_size": G, "zero_point": True, "version": "gemm"})
    edit_config(dst, quantization_config=qc)
    return ref


def edit_config(path, **changes):
    raw = json.loads((path / "config.json").read_text())
    raw.update(changes)
    (path / "config.json").write_text(json.dumps(raw))


def engine_logits(path, **kw):
    engine = DeviceEngine(EngineConfig(model=str(path), num_kv_blocks=64, block_size=16, **kw))
    return engine, run_chunk(engine, 0, IDS, 0, [3, 0])


@pytest.mark.parametrize("kind", ["gptq-sym-v1", "gptq-asym-v1", "gptq-asym-v2", "awq"])
def test_quantized_checkpoint_matches_its_dequantized_weights(float_checkpoint, tmp_path, kind):
    hf, src = float_checkpoint
    ref = write_quantized(hf, src, tmp_path / kind, kind)
    engine, logits = engine_logits(tmp_path / kind)
    assert rel_l2(logits, hf_logits(ref, IDS)) < 1e-3
    method = kind.split("-")[0]
    w = engine.runner.model.w
    assert checkpoint_quantization(tmp_path / kind) == method and w.quantization == method
    qkv = w.layers[0].qkv
    assert isinstance(qkv, Int4Linear) and qkv.qweight.shape == (256, 128 // 8)
    # sym: every zero is 8 (v1 stores 7), so no zero tensor is kept
    assert (qkv.zeros is None) == (kind == "gptq-sym-v1")
    assert rel_l2(hf_logits(hf, IDS), hf_logits(ref, IDS)) > 1e-2  # the 4-bit error is visible
    fp16_scales = 256 * 128 // 2 + 256 * (128 // G) * (2 + (qkv.zeros is not None))
    assert qkv.nbytes == fp16_scales and qkv.numel == 256 * 128


def test_quantization_int4_of_a_float_checkpoint(float_checkpoint):
    """Asymmetric groups of 128, fp32 scales on an fp32 model; weights ~ 0.54 bytes each. The
    reference model gets the loaded codes, zeros and scales unpacked here (the quantizer's
    choices, clip search included, are tests/kernels/test_group_matmul.py's), and those
    weights must be a quantization of the float ones."""
    hf, path = float_checkpoint
    engine, logits = engine_logits(path, quantization="int4")
    ref = copy.deepcopy(hf)
    Hq, Hk, Dh = CONFIG["num_attention_heads"], CONFIG["num_key_value_heads"], CONFIG["head_dim"]
    splits = {"qkv": (("self_attn.q_proj", Hq * Dh), ("self_attn.k_proj", Hk * Dh),
                      ("self_attn.v_proj", Hk * Dh)),
              "o": (("self_attn.o_proj", CONFIG["hidden_size"]),),
              "gate_up": (("mlp.gate_proj", CONFIG["intermediate_size"]),
                          ("mlp.up_proj", CONFIG["intermediate_size"])),
              "down": (("mlp.down_proj", CONFIG["hidden_size"]),)}
    for i, layer in enumerate(engine.runner.model.w.layers):
        for field, parts in splits.items():
            lin = getattr(layer, field)
            shifts = torch.arange(0, 32, 4, dtype=torch.int32)
            q = ((lin.qweight[:, :, None] >> shifts) & 0xF).reshape(lin.qweight.shape[0], -1)
            w = dequant(q.long(), lin.zeros.long(), lin.scales)
            for name, n in parts:
                module = ref.get_submodule(f"model.layers.{i}.{name}")
                rel = (w[:n] - module.weight.data).norm() / module.weight.data.norm()
                assert rel < 0.2, (name, rel)  # 4 bits: about 1/15 of a group's range per step
                module.weight.data = w[:n].clone()
                w = w[n:]
    assert rel_l2(logits, hf_logits(ref, IDS)) < 1e-3
    w = engine.runner.model.w
    assert w.quantization == "int4"
    linears = [lin for layer in w.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    assert all(lin.nbytes == lin.numel * (1 / 2 + 5 / G) for lin in linears)
    fp32 = w.nbytes(torch.float32)
    assert fp32 - w.nbytes() == sum(lin.numel * 4 - lin.nbytes for lin in linears)
    assert w.nbytes() < 0.4 * fp32  # (the float embedding and LM head stay)


def test_int4_linear_counts_real_columns_not_padding():
    lin = quantize_int4_linear(torch.randn(40, 172), torch.float16)
    assert lin.qweight.shape == (40, 256 // 8) and lin.scales.dtype == torch.float16
    assert lin.numel == 40 * 172 and lin.nbytes == 40 * 256 // 2 + 40 * 2 * (2 + 1)


@pytest.mark.parametrize("kind", ["gptq-asym-v1", "awq"])
def test_repack_puts_every_column_in_place(kind):
    """q[n, k] = (n + 3k) % 16, all 16 codes in every word and a different one in each column
    of a word, zeros z[n, g] = (n + g) % 15 + 1: a wrong nibble order or transpose shows."""
    N, K = 24, 256
    n, k = torch.arange(N)[:, None], torch.arange(K)[None, :]
    q, z = (n + 3 * k) % 16, (n + torch.arange(K // G)[None, :]) % 15 + 1
    s = torch.rand(N, K // G) + 0.5
    tensors = pack_gptq(q, z, s, v1=True) if kind != "awq" else pack_awq(q, z, s)
    qc = ({"quant_method": "gptq", "bits": 4, "group_size": G} if kind != "awq" else
          {"quant_method": "awq", "bits": 4, "group_size": G, "version": "gemm"})
    qweight, scales, zeros = repack(parse_quantization_config(qc), tensors)
    assert torch.equal(unpack_int4(qweight), q.to(torch.int32))
    assert torch.equal(zeros.long(), z) and torch.equal(scales, s.half())


@pytest.mark.parametrize("qc,match", [
    (dict(bits=8), "only 4-bit"),
    (dict(desc_act=True), "act-order"),
    (dict(group_size=-1), "positive multiple of 16"),
    (dict(group_size=100), "positive multiple of 16"),
    (dict(checkpoint_format="marlin"), "checkpoint_format 'marlin'"),
    (dict(quant_method="awq", version="gemv"), "gemm only"),
    (dict(quant_method="bitsandbytes"), "quant_method 'bitsandbytes'"),
])
def test_unsupported_quantization_configs_are_refused(stories_dir, tmp_path, qc, match):
    shutil.copy(stories_dir / "config.json", tmp_path / "config.json")
    edit_config(tmp_path, quantization_config={"quant_method": "gptq", "bits": 4,
                                                "group_size": G, **qc})
    with pytest.raises(ModelLoadError, match=match):
        checkpoint_quantization(tmp_path)
    with pytest.raises(ModelLoadError, match=match):  # before any tensor is read
        load_weights(tmp_path, load_model_config(tmp_path), torch.float32, "cpu")


def test_key_spellings_of_autoawq_and_transformers():
    awq = parse_quantization_config({"quant_method": "awq", "w_bit": 4, "q_group_size": 64,
                                     "zero_point": False, "version": "GEMM"})
    assert (awq.method, awq.group_size, awq.zero_offset) == ("awq", 64, 0)
    v2 = parse_quantization_config({"quant_method": "gptq", "bits": 4, "group_size": 128,
                                    "format": "gptq_v2"})
    assert v2.zero_offset == 0
    assert parse_quantization_config({"quant_method": "gptq", "bits": 4,
                                      "group_size": 32}).zero_offset == 1  # v1 by default


def test_act_order_g_idx_already_quantized_and_float_checkpoints(float_checkpoint, tmp_path):
    hf, src = float_checkpoint
    path = tmp_path / "gptq"
    write_quantized(hf, src, path, "gptq-asym-v1")
    cfg = load_model_config(path)
    with pytest.raises(ModelLoadError, match="already quantized"):
        load_weights(path, cfg, torch.float32, "cpu", quantization="int4")
    tensors = load_file(path / "model.safetensors")
    name = "model.layers.1.mlp.down_proj.g_idx"
    tensors[name] = tensors[name].flip(0).contiguous()  # desc_act=false, yet columns reordered
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"mlp.down_proj: g_idx .* act-order"):
        load_weights(path, cfg, torch.float32, "cpu")
    assert checkpoint_quantization(src) is None
    assert load_weights(src, load_model_config(src), torch.float32, "cpu").quantization is None


def test_a_quantized_lm_head_is_refused_not_replaced_by_the_embedding(float_checkpoint, tmp_path):
    """Some GPTQ checkpoints quantize lm_head too: without lm_head.weight the loader would
    otherwise fall back to the tied embedding and serve a different model."""
    hf, src = float_checkpoint
    path = tmp_path / "gptq"
    write_quantized(hf, src, path, "gptq-asym-v1")
    tensors = load_file(path / "model.safetensors")
    tensors["lm_head.qweight"] = torch.zeros(CONFIG["hidden_size"] // 8, CONFIG["vocab_size"],
                                             dtype=torch.int32)
    tensors.pop("lm_head.weight", None)
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(ModelLoadError, match="quantized LM head"):
        load_weights(path, load_model_config(path), torch.float32, "cpu")


# Qwen2 keeps its q/k/v biases dense beside the packed codes; Phi-3 quantizes its fused
# qkv_proj and gate_up_proj whole; Gemma 2 adds sandwich norms and soft-caps around them.
FAMILIES = {
    "qwen2": ("Qwen2ForCausalLM", {}, LINEARS),
    "phi3": ("Phi3ForCausalLM", dict(pad_token_id=0, eos_token_id=2), (  # (its defaults: 32000)
        "self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")),
    "gemma2": ("Gemma2ForCausalLM", dict(query_pre_attn_scalar=32, sliding_window=8,
                                         attn_logit_softcapping=20.0,
                                         final_logit_softcapping=10.0), LINEARS),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("kind", ["gptq-asym-v2", "awq"])
def test_quantized_checkpoints_of_other_families(tmp_path, family, kind):
    arch, extra, linears = FAMILIES[family]
    cls = getattr(transformers, arch)
    torch.manual_seed(0)
    hf = cls(cls.config_class(initializer_range=0.15, rms_norm_eps=1e-5, **CONFIG,
                              **extra)).eval()
    with torch.no_grad():  # biases and norms away from their zero / one init
        for name, p in hf.named_parameters():
            if name.endswith(".bias") or "norm" in name:
                p.add_(0.3 * torch.randn_like(p))
    hf.save_pretrained(tmp_path / "float")
    write_tokenizer(tmp_path / "float")
    ref = write_quantized(hf, tmp_path / "float", tmp_path / kind, kind, linears)
    engine, logits = engine_logits(tmp_path / kind)
    assert engine.runner.model.w.quantization == kind.split("-")[0]
    assert rel_l2(logits, hf_logits(ref, IDS)) < 1e-3, (family, kind)
    assert rel_l2(hf_logits(hf, IDS), hf_logits(ref, IDS)) > 1e-2  # the 4-bit error is visible
    if family == "qwen2":
        assert engine.runner.model.w.layers[0].qkv.bias is not None
