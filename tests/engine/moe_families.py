"""Mixture-of-experts families against transformers, on random-weight checkpoints built here
(the tests, run per family by tests/engine/test_moe_*.py):
Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE and gpt-oss (kernels/moe.py's fused path). Two configs per
family with awkward sizes (6, 10 or 60 experts; top 1, 2, 4 or 8; a shared expert; dense layers
among sparse ones; GQA; windows), compared in fp32 as the dense families are (test_families.py):

- the runner's logits over a chunked prefill and decode steps vs transformers' full-sequence
  logits, relative L2 < 1e-4 and every logprob within 2e-4;
- int8 and int4 weights (``--quantization``, experts included): the same bounds against
  transformers holding the codes' dequantized values (the router stays float);
- ``LLM.generate`` (one config per family, the richer one): greedy 32 tokens equal to
  ``transformers.generate`` with chunked prefill, a prefix-cache hit and a preemption in the
  same run, logprobs and the top 5 as transformers'; batch invariance: a prompt's tokens and
  logprobs alone equal those inside a batch of 16.
"""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tests.engine.test_families import build as build_dense  # noqa: E402
from tests.engine.test_families import check_logits, check_logprobs, hf_greedy, prompt  # noqa: E402
from tinyserve.llm import LLM  # noqa: E402
from tinyserve.messages import SamplingParams  # noqa: E402

BLOCK = 16
COMMON = dict(vocab_size=300, num_hidden_layers=2, max_position_embeddings=128,
              initializer_range=0.15, bos_token_id=256, eos_token_id=257, pad_token_id=258,
              rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
CONFIGS = {
    # 6 experts, top 2 (renormalised, always, in Mixtral), GQA 2:1, F not a power of two
    "mixtral_e6_top2": ("MixtralForCausalLM", dict(
        hidden_size=64, intermediate_size=40, num_attention_heads=4, num_key_value_heads=2,
        num_local_experts=6, num_experts_per_tok=2, sliding_window=None)),
    # 8 experts, top 1 (its weight is 1), a window of 24 on every layer, 3 layers
    "mixtral_top1_window": ("MixtralForCausalLM", dict(
        hidden_size=48, intermediate_size=72, num_hidden_layers=3, num_attention_heads=6,
        num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=1, sliding_window=24)),
    # 60 experts, top 4 not renormalised, a dense layer among sparse ones (mlp_only_layers),
    # q/k norm, head_dim 16, GQA 3:1
    "qwen3moe_e60_dense": ("Qwen3MoeForCausalLM", dict(
        hidden_size=48, intermediate_size=96, num_hidden_layers=3, num_attention_heads=6,
        num_key_value_heads=2, head_dim=16, num_experts=60, num_experts_per_tok=4,
        moe_intermediate_size=40, norm_topk_prob=False, mlp_only_layers=[1])),
    # 10 experts, top 8 renormalised, every other layer sparse (decoder_sparse_step 2)
    "qwen3moe_top8_step2": ("Qwen3MoeForCausalLM", dict(
        hidden_size=64, intermediate_size=80, num_attention_heads=4, num_key_value_heads=4,
        head_dim=24, num_experts=10, num_experts_per_tok=8, moe_intermediate_size=24,
        norm_topk_prob=True, decoder_sparse_step=2)),
    # a shared expert (its sigmoid gate) beside 6 routed ones, top 2, q/k/v bias
    "qwen2moe_shared": ("Qwen2MoeForCausalLM", dict(
        hidden_size=48, intermediate_size=96, num_attention_heads=6, num_key_value_heads=2,
        num_experts=6, num_experts_per_tok=2, moe_intermediate_size=40,
        shared_expert_intermediate_size=56, norm_topk_prob=False)),
    # 60 experts top 4 renormalised, every other layer sparse, a window from layer 1 on
    "qwen2moe_step2_window": ("Qwen2MoeForCausalLM", dict(
        hidden_size=64, intermediate_size=80, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=4, num_experts=60, num_experts_per_tok=4, moe_intermediate_size=24,
        shared_expert_intermediate_size=24, norm_topk_prob=True, decoder_sparse_step=2,
        use_sliding_window=True, sliding_window=24, max_window_layers=1)),
    # q/k norm over the whole projection, 6 experts top 2, GQA 2:1
    "olmoe_e6_top2": ("OlmoeForCausalLM", dict(
        hidden_size=64, intermediate_size=40, num_attention_heads=4, num_key_value_heads=2,
        num_experts=6, num_experts_per_tok=2, norm_topk_prob=False)),
    # 60 experts top 8 renormalised, head_dim 16 (hidden / heads), 3 layers
    "olmoe_top8_renorm": ("OlmoeForCausalLM", dict(
        hidden_size=48, intermediate_size=24, num_hidden_layers=3, num_attention_heads=3,
        num_key_value_heads=3, num_experts=60, num_experts_per_tok=8, norm_topk_prob=True)),
    # gpt-oss: sinks, biases everywhere, 6 experts top 2 (softmax over the two), a window of 24
    # on alternate layers, YaRN without truncation (gpt-oss's own rope), GQA 2:1; hidden and
    # expert sizes in MXFP4's groups of 32 (test_moe_gptoss.py writes it as MXFP4)
    "gptoss_e6_top2_yarn": ("GptOssForCausalLM", dict(
        hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, num_local_experts=6, num_experts_per_tok=2, sliding_window=24,
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0,
                         "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": 32})),
    # 60 experts top 4, 3 layers (sliding, full, sliding), a window of 16, head_dim 8, GQA 3:1
    "gptoss_e60_top4": ("GptOssForCausalLM", dict(
        hidden_size=48, intermediate_size=24, num_hidden_layers=3, num_attention_heads=6,
        num_key_value_heads=2, head_dim=8, num_local_experts=60, num_experts_per_tok=4,
        sliding_window=16)),
}


def sharpen(name: str, param) -> None:
    """Routers and experts drawn wider than transformers' init: routing decisions that matter;
    gpt-oss's expert biases (zeros at init) and sinks (from below to above the scores)."""
    if name.endswith(("gate.weight", "router.weight", "experts.gate_up_proj",
                      "experts.down_proj")):
        param.normal_(0.0, 0.15)
    elif name.endswith(("gate_up_proj_bias", "down_proj_bias")):
        param.normal_(0.0, 0.3)
    elif name.endswith("self_attn.sinks"):
        param.normal_(0.0, 1.5)


def build(name: str, path):
    return build_dense(name, path, CONFIGS, COMMON, sharpen)


def families(prefix: str, run_through: str):
    """(``family``, ``whole_run``): module-scoped fixtures over the configs named ``prefix...``
    and over the one of them (``run_through``) that also runs the generation and batch tests
    (the slow ones: one config per family pays for them). One test file per family, so its
    checkpoints are built once and the files spread over the workers."""
    names = sorted(n for n in CONFIGS if n.startswith(prefix))
    assert run_through in names

    @pytest.fixture(scope="module", params=names)
    def family(request, tmp_path_factory):
        path = tmp_path_factory.mktemp(request.param)
        return request.param, build(request.param, path), path

    @pytest.fixture(scope="module")
    def whole_run(tmp_path_factory):
        path = tmp_path_factory.mktemp(run_through)
        return run_through, build(run_through, path), path
    return family, whole_run


def test_the_config_says_which_layers_are_sparse(family):
    from tinyserve.engine.loading.model_config import load_model_config

    name, hf, path = family
    cfg = load_model_config(path)
    c = hf.config
    sparse = [cfg.is_sparse(i) for i in range(cfg.num_layers)]
    if name.startswith("gptoss"):
        assert sparse == [True] * cfg.num_layers and cfg.attn_sinks and cfg.moe_biases
        assert cfg.qkv_bias and cfg.o_bias and not cfg.moe_softmax_first
        assert cfg.moe_activation == "swiglu_oai" and cfg.swiglu_limit == c.swiglu_limit
        assert cfg.layer_types == tuple(c.layer_types) and cfg.sliding_window == c.sliding_window
        assert (cfg.num_experts, cfg.experts_per_token) == (c.num_local_experts,
                                                            c.num_experts_per_tok)
    elif name.startswith("olmoe"):
        assert sparse == [True] * cfg.num_layers and cfg.qk_norm_whole and not cfg.qk_norm
        assert cfg.moe_renormalize == c.norm_topk_prob
    elif name.startswith("mixtral"):
        assert sparse == [True] * cfg.num_layers and cfg.moe_renormalize
        assert (cfg.num_experts, cfg.experts_per_token) == (c.num_local_experts,
                                                            c.num_experts_per_tok)
    else:
        want = [i not in c.mlp_only_layers and (i + 1) % c.decoder_sparse_step == 0
                for i in range(cfg.num_layers)]
        assert sparse == want and cfg.moe_renormalize == c.norm_topk_prob
        assert cfg.qk_norm == name.startswith("qwen3")
        assert cfg.shared_expert_size == getattr(c, "shared_expert_intermediate_size", 0)
        assert (cfg.num_experts, cfg.moe_intermediate_size) == (c.num_experts,
                                                                c.moe_intermediate_size)


def test_logits_match_transformers_over_prefill_and_decode(family):
    name, hf, path = family
    check_logits(name, hf, path, 44)


def _round_trip(w: torch.Tensor, quantization: str) -> torch.Tensor:
    """[E, N, K] float through --quantization's codes and back (rows along K, as served)."""
    from tinyserve.engine.loading.quantize import quantize_experts_int4, quantize_experts_int8

    if quantization == "int8":
        q, scale = quantize_experts_int8(w)
        return q.float() * scale[..., None]
    return quantize_experts_int4(w, torch.float32).dequantized()


def dequantized(hf, quantization: str):
    """A copy of ``hf`` whose weights are what --quantization serves: every projection
    (attention, dense and shared MLPs, each expert) per output row through int8 codes (or
    int4 groups along the input) and back; the routers, the shared expert's gate, biases,
    sinks, embeddings, norms and the LM head as they are. (Quantizing per row, a fused qkv
    is quantized as its parts are.)"""
    import copy

    hf = copy.deepcopy(hf)
    keep = ("mlp.gate.weight", "block_sparse_moe.gate.weight", "shared_expert_gate.weight",
            "router.weight", "bias", "sinks")
    # gpt-oss holds its experts transposed ([E, D, 2F], [E, F, D]): rows are columns there
    transposed = hf.config.model_type == "gpt_oss"
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if not name.startswith("model.layers.") or name.endswith(keep) or param.dim() < 2:
                continue
            w = param.data if param.dim() == 3 else param.data[None]
            flip = transposed and param.dim() == 3
            deq = _round_trip(w.transpose(1, 2) if flip else w, quantization)
            param.data.copy_((deq.transpose(1, 2) if flip else deq).reshape(param.shape))
    return hf


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_quantized_experts_equal_their_dequantized_weights(whole_run, quantization):
    """--quantization int8 / int4 on an MoE model keeps the experts as codes (int8 with a
    scale per row, or int4 in groups of 128 with zero points: kernels/moe.py) and computes
    what the dequantized weights compute (one config per family: the kernels' quantized paths
    have their own tests over awkward shapes)."""
    name, hf, path = whole_run
    from tinyserve.engine.loading.checkpoint import load_weights
    from tinyserve.engine.loading.model_config import load_model_config
    from tinyserve.kernels import Int4Experts

    cfg = load_model_config(path)
    w = load_weights(path, cfg, torch.float32, "cpu", quantization=quantization)
    sparse = [layer.experts for layer in w.layers if layer.experts is not None]
    if quantization == "int8":
        assert sparse and all(e.w13.dtype == e.w2.dtype == torch.int8 for e in sparse)
    else:
        assert sparse and all(isinstance(e.w13, Int4Experts) and isinstance(e.w2, Int4Experts)
                              for e in sparse)
    assert all(e.router.weight.dtype == torch.float32 for e in sparse)
    # (int4 pads each row to whole groups of 128: these configs' rows are 24 to 96 wide)
    assert w.nbytes() < w.nbytes(as_float=torch.float32) / (2 if quantization == "int8" else 1)
    check_logits(name, dequantized(hf, quantization), path, 44, quantization=quantization)


def test_greedy_generation_and_logprobs_through_llm(whole_run):
    """Chunked prefill, a prefix-cache hit and a preemption in one run (test_families.py)."""
    name, hf, path = whole_run
    llm = LLM(str(path), dtype="float32", num_kv_blocks=5, block_size=BLOCK, max_model_len=80,
              max_num_batched_tokens=16, max_num_seqs=3)
    first = prompt(2, 40)
    shared = first[:32] + prompt(3, 8)
    params = SamplingParams(max_tokens=32, temperature=0.0, min_tokens=32, logprobs=5)
    llm.generate([first], SamplingParams(max_tokens=1))
    outs = llm.generate([shared, first], params)
    assert llm.core.scheduler.num_preemptions > 0, "the run was meant to preempt"
    assert outs[0].num_cached_tokens >= 32, "the shared prefix was meant to hit the cache"
    for ids, out in zip([shared, first], outs, strict=True):
        tokens, rows = hf_greedy(hf, ids, 32)
        assert list(out.token_ids) == tokens, name
        check_logprobs(name, out.token_ids, out.logprobs, rows, 5)


def test_a_prompt_alone_equals_it_in_a_batch_of_sixteen(whole_run):
    """Bitwise: the experts' tiles, the sort and the combine never mix tokens."""
    name, hf, path = whole_run
    llm = LLM(str(path), dtype="float32", num_kv_blocks=128, block_size=BLOCK)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=3)
    prompts = [prompt(10 + i, 5 + 3 * i) for i in range(16)]
    together = llm.generate(prompts, params)
    for i in (0, 15):
        [alone] = llm.generate([prompts[i]], params)
        assert alone.token_ids == together[i].token_ids, (name, i)
        assert alone.logprobs == together[i].logprobs, (name, i)


def test_stacked_and_per_expert_checkpoints_load_the_same(family, tmp_path):
    """transformers 5 writes one module per expert; its in-memory layout (and checkpoints
    saved that way) stacks them: experts.gate_up_proj [E, 2F, D], experts.down_proj [E, D, F]."""
    import shutil

    from safetensors.torch import load_file, save_file

    from tinyserve.engine.loading.checkpoint import load_weights
    from tinyserve.engine.loading.model_config import load_model_config

    name, hf, path = family
    stacked = tmp_path / "stacked"
    shutil.copytree(path, stacked)
    tensors = load_file(stacked / "model.safetensors")
    cfg = load_model_config(path)
    names = ("w1", "w3", "w2") if name.startswith("mixtral") else \
        ("gate_proj", "up_proj", "down_proj")
    for i in range(cfg.num_layers):
        if not cfg.is_sparse(i):
            continue
        moe = f"model.layers.{i}.mlp."
        if moe + "experts.0.w1.weight" not in tensors and name.startswith("mixtral"):
            moe = f"model.layers.{i}.block_sparse_moe."
        per = [[tensors.pop(f"{moe}experts.{e}.{n}.weight") for n in names]
               for e in range(cfg.num_experts)]
        tensors[moe + "experts.gate_up_proj"] = torch.stack([torch.cat(p[:2]) for p in per])
        tensors[moe + "experts.down_proj"] = torch.stack([p[2] for p in per])
    save_file(tensors, stacked / "model.safetensors")
    a = load_weights(path, cfg, torch.float32, "cpu")
    b = load_weights(stacked, cfg, torch.float32, "cpu")
    for la, lb in zip(a.layers, b.layers, strict=True):
        assert (la.experts is None) == (lb.experts is None)
        if la.experts is not None:
            assert torch.equal(la.experts.w13, lb.experts.w13)
            assert torch.equal(la.experts.w2, lb.experts.w2)
            assert torch.equal(la.experts.router.weight, lb.experts.router.weight)
