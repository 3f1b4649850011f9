"""The families of tests/engine/test_families.py served: through the HTTP server, with int8 / int4
weights and the int8 KV cache, and with a window on every layer over a long sequence (split
from that file so the two run on different workers)."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tests.engine.test_families import (  # noqa: E402
    BLOCK,
    CONFIGS,
    REPREFILLS,
    build,
    check_logprobs,
    hf_greedy,
    prompt,
)
from tests.engine.test_model_vs_transformers import run_chunk  # noqa: E402
from tinyserve.llm import LLM  # noqa: E402
from tinyserve.messages import SamplingParams  # noqa: E402


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def family(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    return request.param, build(request.param, path), path


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


def dequantized(hf, model):
    """A copy of the transformers model holding the weights our quantized model multiplies
    by (dequantized from its int8 / int4 storage): its reference."""
    import copy

    from tinyserve.engine.model.weights import Int4Linear
    from tinyserve.kernels.int4_pack import dequantize_int4

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
    model sampled (tests/quality.py), it agrees with fp32 on the top token as it does on
    Llama (bench_quality) and is quantized for real. bench_quality --family reports the
    agreement of every format."""
    from tests.quality import compare, score

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
