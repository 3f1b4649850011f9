"""Every family the model description covers, against transformers, on random-weight
checkpoints built here (no hub): Qwen2, Qwen3, Mistral, Gemma 2, Gemma 3 (text), Phi-3. Llama
has its own file (test_model_vs_transformers.py).

Two configs per family with awkward sizes (odd head counts, GQA 3:1 and 1:1, head_dims that
are not 64 or 128, head_dim 256, windows shorter than the prompt, soft-caps on, each rope
scaling). Per config, in fp32:

- the runner's logits over a prefill and decode steps vs transformers' full-sequence logits,
  relative L2 < 1e-4 (the Llama tests' bound) and every logprob within 2e-4;
- ``LLM.generate``: greedy 32 tokens equal to ``transformers.generate``, with chunked
  prefill, a prefix-cache hit and a preemption in the same run; the chosen tokens' logprobs
  and the top 5 equal to transformers' log-softmax over the whole vocabulary;
- the same through the HTTP server (batched prompts and a stream).

dynamic and longrope ropes depend on the sequence length in transformers (rope.py): their
full-sequence logits are compared within the original length, and generation (one token a
step in both) past it; Phi-3's ``generate`` re-prefills when crossing (see REPREFILLS).
"""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tests.test_model_vs_transformers import rel_l2, run_chunk  # noqa: E402
from tinyserve.engine.demo import write_tokenizer  # noqa: E402
from tinyserve.llm import LLM  # noqa: E402
from tinyserve.messages import SamplingParams  # noqa: E402

BLOCK = 16
COMMON = dict(vocab_size=300, num_hidden_layers=2, max_position_embeddings=128,
              initializer_range=0.15,
              # the demo tokenizer's specials, so min_tokens bans the same EOS in both
              bos_token_id=256, eos_token_id=257, pad_token_id=258)
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
        "rope_theta": 10000.0}
CONFIGS = {
    # GQA 3:1, q/k/v bias (always, in Qwen2), rope theta 1e6
    "qwen2_gqa3": ("Qwen2ForCausalLM", dict(
        hidden_size=72, intermediate_size=100, num_attention_heads=6, num_key_value_heads=2,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
    # 1:1, a window on the second layer only (max_window_layers 1), YaRN
    "qwen2_window_yarn": ("Qwen2ForCausalLM", dict(
        hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=4,
        use_sliding_window=True, sliding_window=24, max_window_layers=1, rope_parameters=YARN)),
    # q/k norm, head_dim 24 (not hidden / heads), GQA 3:1
    "qwen3_gqa3": ("Qwen3ForCausalLM", dict(
        hidden_size=64, intermediate_size=96, num_attention_heads=6, num_key_value_heads=2,
        head_dim=24, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    # attention_bias (q/k/v/o), head_dim 40, dynamic NTK past 64 positions
    "qwen3_bias_dynamic": ("Qwen3ForCausalLM", dict(
        hidden_size=64, intermediate_size=80, num_attention_heads=4, num_key_value_heads=4,
        head_dim=40, attention_bias=True, max_position_embeddings=64,
        rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})),
    # every layer windowed (v0.1 style): blocks behind the window are given back
    "mistral_window": ("MistralForCausalLM", dict(
        hidden_size=64, intermediate_size=96, num_attention_heads=8, num_key_value_heads=2,
        sliding_window=24, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    # explicit head_dim (4 x 24 != 64), linear rope, no window
    "mistral_headdim_linear": ("MistralForCausalLM", dict(
        hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=4,
        head_dim=24, sliding_window=None,
        rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0})),
    # alternate sliding layers, both soft-caps, query_pre_attn_scalar != head_dim
    "gemma2_softcap": ("Gemma2ForCausalLM", dict(
        hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, sliding_window=24, query_pre_attn_scalar=24,
        attn_logit_softcapping=5.0, final_logit_softcapping=3.0)),
    # head_dim 256, GQA 2:1
    "gemma2_hd256": ("Gemma2ForCausalLM", dict(
        hidden_size=64, intermediate_size=96, num_attention_heads=2, num_key_value_heads=1,
        head_dim=256, sliding_window=24, query_pre_attn_scalar=256)),
    # local / global layers with their own ropes (global: linear x8), q/k norm
    "gemma3_local_global": ("Gemma3ForCausalLM", dict(
        hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, sliding_window=24,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0,
                                            "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})),
    # the final soft-cap on (an attention soft-cap in the config, which Gemma 3 ignores),
    # GQA 3:1, head_dim 48
    "gemma3_softcap": ("Gemma3ForCausalLM", dict(
        hidden_size=48, intermediate_size=96, num_attention_heads=3, num_key_value_heads=1,
        head_dim=48, sliding_window=24, attn_logit_softcapping=20.0,
        final_logit_softcapping=15.0, layer_types=["full_attention", "sliding_attention"])),
    # fused qkv / gate_up, partial rotary (8 of 16 dims), GQA 2:1
    "phi3_partial": ("Phi3ForCausalLM", dict(
        hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                         "partial_rotary_factor": 0.5})),
    # LongRoPE (long factors from position 48), a window on every layer
    "phi3_longrope_window": ("Phi3ForCausalLM", dict(
        hidden_size=48, intermediate_size=96, num_attention_heads=3, num_key_value_heads=3,
        sliding_window=24, original_max_position_embeddings=48,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                         "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.0, 3.5],
                         "long_factor": [1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0],
                         "original_max_position_embeddings": 48})),
}
# a rope that depends on the sequence length: full-sequence logits only within this length
LENGTH_DEPENDENT = {"qwen3_bias_dynamic": 64, "phi3_longrope_window": 48}


def build(name: str, path) -> "transformers.PreTrainedModel":
    arch, kw = CONFIGS[name]
    cls = getattr(transformers, arch)
    cfg = cls.config_class(**{**COMMON, **kw})
    torch.manual_seed(sum(map(ord, name)))
    hf = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    with torch.no_grad():  # norms away from their zero / one init, so they matter
        for n, p in hf.named_parameters():
            if "norm" in n or n.endswith(".bias"):
                p.add_(0.3 * torch.randn_like(p))
    hf.save_pretrained(path)
    write_tokenizer(path)
    return hf


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def family(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    return request.param, build(request.param, path), path


def prompt(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 256, (n,), generator=g).tolist()  # bytes, no specials


def test_logits_match_transformers_over_prefill_and_decode(family):
    """A prefill in two chunks (the second starting mid-block) and three decode steps."""
    name, hf, path = family
    llm = LLM(str(path), dtype="float32", num_kv_blocks=64, block_size=BLOCK)
    limit = LENGTH_DEPENDENT.get(name, 128)
    ids = prompt(1, min(44, limit))
    n = len(ids) - 3
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    blocks = [7, 2, 9, 4]  # scattered physical blocks
    got = [run_chunk(llm.engine, 0, ids[:20], 0, blocks),
           run_chunk(llm.engine, 0, ids[:n], 20, blocks)]
    for pos in range(n, len(ids)):  # decode steps, one token each
        got.append(run_chunk(llm.engine, 0, ids[:pos + 1], pos, blocks))
    got = torch.cat(got)
    err = rel_l2(got, ref)
    assert err < 1e-4, f"{name}: relative L2 {err:.2e}"
    # and per token: an error in a few rows (a soft-cap applied where it is not) hides in L2
    lp_err = (torch.log_softmax(got.double(), -1) - torch.log_softmax(ref.double(), -1)).abs()
    assert lp_err.max() < 2e-4, f"{name}: logprob error {lp_err.max():.2e}"


# Phi-3's generate drops its cache when a sequence crosses the original length and recomputes
# it with the long factors: a per-request re-prefill this server does not do (rope.py)
REPREFILLS = {"phi3_longrope_window"}


def hf_greedy(hf, ids: list[int], n: int, loop: bool = False) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy tokens (EOS banned, as min_tokens does) and the raw log-softmax
    each was chosen from: ``generate``, or with ``loop`` a prefill and one step at a time on its
    cache, where its rope picks the factors per step as the tables do."""
    with torch.no_grad():
        if not loop:
            out = hf.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n,
                              do_sample=False, pad_token_id=258, output_logits=True,
                              return_dict_in_generate=True)
            rows = torch.stack(out.logits)[:, 0].double()
            return out.sequences[0, len(ids):].tolist(), torch.log_softmax(rows, -1)
        logits, out, cache, step = [], list(ids), None, torch.tensor([ids])
        for _ in range(n):
            res = hf(step, cache=cache, use_cache=True)
            cache, row = res.cache, res.logits[0, -1].double()
            logits.append(row)
            banned = row.clone()
            banned[257] = float("-inf")
            out.append(int(banned.argmax()))
            step = torch.tensor([[out[-1]]])
    return out[len(ids):], torch.log_softmax(torch.stack(logits), -1)


def check_logprobs(name: str, token_ids, logprobs, rows: torch.Tensor, k: int) -> None:
    """Each chosen token's logprob and the top k equal to transformers' full-vocabulary
    log-softmax rows (fp32 sums: a relative term for soft-capped, large logits)."""
    for i, (tok, entry) in enumerate(zip(token_ids, logprobs, strict=True)):
        row = rows[i]
        top = row.topk(k)
        want = {int(t): float(v) for t, v in zip(top.indices, top.values, strict=True)}
        want[tok] = float(row[tok])
        assert set(entry) == set(want), (name, i)
        for t, lp in entry.items():
            assert abs(lp - want[t]) < 2e-4 + 1e-4 * abs(want[t]), (name, i, t, lp, want[t])


def test_greedy_generation_and_logprobs_through_llm(family):
    """Chunked prefill (16-token budget), a prefix-cache hit and a preemption in one run: 5
    blocks of 16 hold one 72-token sequence, not the three batched together (nor, with a
    window of 24 on every layer, three windows' worth)."""
    name, hf, path = family
    llm = LLM(str(path), dtype="float32", num_kv_blocks=5, block_size=BLOCK, max_model_len=80,
              max_num_batched_tokens=16, max_num_seqs=3)
    first = prompt(2, 40)
    shared = first[:32] + prompt(3, 8)  # two full blocks in common with `first`
    params = SamplingParams(max_tokens=32, temperature=0.0, min_tokens=32, logprobs=5)
    [warm] = llm.generate([first], params)  # fills the prefix cache
    outs = llm.generate([shared, prompt(4, 40), first], params)
    assert llm.core.scheduler.num_preemptions > 0, "the run was meant to preempt"
    assert outs[0].num_cached_tokens >= 32, "the shared prefix was meant to hit the cache"
    assert list(outs[2].token_ids) == list(warm.token_ids)
    for ids, out in zip([shared, prompt(4, 40), first], outs, strict=True):
        tokens, rows = hf_greedy(hf, ids, 32, loop=name in REPREFILLS)
        assert list(out.token_ids) == tokens, name
        check_logprobs(name, out.token_ids, out.logprobs, rows, 5)


def test_server_completions_match_transformers(family):
    """The same through the HTTP server (a real DeviceEngine in-process): a batch of two
    token-id prompts in one request, 12 greedy tokens each with their top-5 logprobs (token ids
    as names), the first streamed."""
    from tests.server.helpers import completion, post, run, stream
    from tests.server.inprocess import InProcessServer
    from tinyserve.config import EngineConfig
    from tinyserve.engine.device_engine import DeviceEngine

    name, hf, path = family
    engine = DeviceEngine(EngineConfig(model=str(path), dtype="float32", num_kv_blocks=32,
                                       block_size=BLOCK, max_model_len=80))
    srv = InProcessServer(engine=engine, max_num_seqs=4)
    try:
        prompts = [prompt(5, 30), prompt(6, 17)]
        body = completion(prompts, max_tokens=12, min_tokens=12, logprobs=5,
                          return_tokens_as_token_ids=True)
        status, resp, _ = run(post(srv.url, "/v1/completions", body))
        assert status == 200, resp
        events, done, _ = run(stream(srv.url, "/v1/completions", {**body, "prompt": prompts[0]}))
        assert done
    finally:
        srv.stop()

    def ids(names) -> list[int]:
        return [int(t.removeprefix("token_id:")) for t in names]

    streamed = [t for e in events for c in e["choices"] for t in (c.get("logprobs") or {}).get(
        "tokens") or []]
    for ids_in, choice in zip(prompts, sorted(resp["choices"], key=lambda c: c["index"]),
                              strict=True):
        tokens, rows = hf_greedy(hf, ids_in, 12, loop=name in REPREFILLS)
        lp = choice["logprobs"]
        assert ids(lp["tokens"]) == tokens, name
        entries = [{int(k.removeprefix("token_id:")): v for k, v in top.items()}
                   for top in lp["top_logprobs"]]
        for entry, tok, chosen in zip(entries, tokens, lp["token_logprobs"], strict=True):
            entry[tok] = chosen
        check_logprobs(name, tokens, entries, rows, 5)
        if ids_in is prompts[0]:
            assert ids(streamed) == tokens, name


def test_loader_reads_the_family_switches(family):
    """What the description says for each config (the numbers tests above rest on)."""
    from tinyserve.engine.model_config import load_model_config

    name, hf, path = family
    cfg = load_model_config(path)
    raw = json.loads((path / "config.json").read_text())
    assert cfg.architecture == CONFIGS[name][0]
    assert cfg.head_dim == hf.config.head_dim if hasattr(hf.config, "head_dim") else True
    if name.startswith("gemma"):
        assert cfg.norm_unit_offset and cfg.sandwich_norms and cfg.activation == "gelu_tanh"
        assert cfg.attn_scale == pytest.approx(raw["query_pre_attn_scalar"] ** -0.5)
    if name.startswith("qwen2"):
        assert cfg.qkv_bias and not cfg.o_bias
    if name.startswith("qwen3") or name.startswith("gemma3"):
        assert cfg.qk_norm
    if name == "gemma2_softcap":
        assert (cfg.attn_softcap, cfg.final_softcap) == (5.0, 3.0)
    if name == "gemma3_softcap":  # transformers' Gemma 3 never applies the attention soft-cap
        assert (cfg.attn_softcap, cfg.final_softcap) == (None, 15.0)
    windows = [cfg.window(i) for i in range(cfg.num_layers)]
    hf_windows = [hf.config.sliding_window if t == "sliding_attention" else None
                  for t in (getattr(hf.config, "layer_types", None)
                            or (["sliding_attention"] * cfg.num_layers
                                if getattr(hf.config, "sliding_window", None) else
                                ["full_attention"] * cfg.num_layers))]
    assert windows == hf_windows, name


def dequantized(hf, model):
    """A copy of the transformers model holding the weights our quantized model multiplies
    by (dequantized from its int8 / int4 storage): its reference."""
    import copy

    from tinyserve.engine.loader import Int4Linear
    from tinyserve.kernels.int4_matmul import dequantize_int4

    def w(lin) -> torch.Tensor:
        if isinstance(lin, Int4Linear):
            return dequantize_int4(lin.qweight, lin.scales, lin.zeros, lin.group_size,
                                   lin.in_features)
        return lin.weight.float() * lin.scale[:, None] if lin.scale is not None else lin.weight

    cfg, ref = model.cfg, copy.deepcopy(hf)
    q, kv, inter = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, \
        cfg.intermediate_size
    with torch.no_grad():
        for layer, ours in zip(ref.model.layers, model.w.layers, strict=True):
            att, mlp = layer.self_attn, layer.mlp
            qkv, gate_up = w(ours.qkv), w(ours.gate_up)
            att.q_proj.weight.copy_(qkv[:q])
            att.k_proj.weight.copy_(qkv[q:q + kv])
            att.v_proj.weight.copy_(qkv[q + kv:])
            att.o_proj.weight.copy_(w(ours.o))
            mlp.gate_proj.weight.copy_(gate_up[:inter])
            mlp.up_proj.weight.copy_(gate_up[inter:])
            mlp.down_proj.weight.copy_(w(ours.down))
    return ref


@pytest.mark.parametrize("name", ["qwen3_gqa3", "gemma2_softcap"])
def test_int8_int4_weights_and_int8_kv(name, tmp_path):
    """The quantized paths on a Qwen3 and a Gemma 2 config. int8 and int4 weights: the logits
    equal transformers' on the weights they dequantize to (the error is the format's, none
    ours), and greedy decode runs. The int8 KV cache: teacher-forced over a text the fp32
    model sampled (tinyserve/quality.py), it agrees with fp32 on the top token as it does on
    Llama (bench_quality) and is quantized for real. bench_quality --family reports the
    agreement of every format."""
    from tinyserve.quality import compare, score

    hf = build(name, tmp_path)
    ids = prompt(1, 44)
    for quant in ("int8", "int4"):
        llm = LLM(str(tmp_path), dtype="float32", num_kv_blocks=32, block_size=BLOCK,
                  quantization=quant)
        model = llm.engine.runner.model
        assert model.w.quantization == quant
        with torch.no_grad():
            ref = dequantized(hf, model)(torch.tensor([ids])).logits[0].double()
        got = run_chunk(llm.engine, 0, ids, 0, [3, 1, 2]).double()
        err = (torch.log_softmax(got, -1) - torch.log_softmax(ref, -1)).abs().max()
        assert err < 2e-4, (name, quant, float(err))
        [out] = llm.generate([ids], SamplingParams(max_tokens=8, temperature=0.0,
                                                   ignore_eos=True))
        assert len(out.token_ids) == 8
    fp32 = LLM(str(tmp_path), dtype="float32", num_kv_blocks=32, block_size=BLOCK)
    [sampled] = fp32.generate([prompt(7, 12)], SamplingParams(
        max_tokens=100, temperature=0.8, seed=3, ignore_eos=True))
    text = list(sampled.prompt_token_ids) + list(sampled.token_ids)
    kv8 = LLM(str(tmp_path), dtype="float32", num_kv_blocks=32, block_size=BLOCK,
              kv_cache_dtype="int8")
    a = compare([score(fp32, text)], [score(kv8, text)])
    assert a.agreement >= 0.95 and 0 < a.mean_abs_dlogprob < 0.05, (name, a)


def test_a_window_on_every_layer_keeps_a_long_sequence_in_a_few_blocks(tmp_path):
    """Mistral with a window of 24 on every layer: a 40-token prompt and 80 greedy tokens (120
    positions, 8 blocks of 16 without the window) run in a pool of 5 blocks, equal to
    transformers; while decoding the pool holds at most the window's 3 blocks (24 positions
    straddle at most 3) and the one being written, and it is empty at the end."""
    hf = build("mistral_window", tmp_path)
    llm = LLM(str(tmp_path), dtype="float32", num_kv_blocks=5, block_size=BLOCK,
              max_model_len=128, max_num_batched_tokens=16)
    ids = prompt(9, 40)
    req = llm.core.add_request(0, ids, SamplingParams(max_tokens=80, temperature=0.0,
                                                      min_tokens=80))
    pool, in_use = llm.core.kv.pool, []
    while llm.core.has_unfinished:
        plan = llm.core.schedule()
        llm.core.process(plan, llm.engine.runner.execute(plan))
        in_use.append((req.seq.num_computed_tokens, pool.num_in_use))
    out = llm.core.release(req.request_id)
    assert list(out.seq.output_token_ids) == hf_greedy(hf, ids, 80)[0]
    decoding = [n for computed, n in in_use if computed > len(ids)]
    assert max(decoding) <= 3 + 1, in_use
    assert pool.num_in_use == 0 and llm.core.scheduler.num_preemptions == 0
