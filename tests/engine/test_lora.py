"""Multi-LoRA on the engine (issue 23), against PEFT: three adapters of different ranks and
targets on a random GQA Llama and a Qwen3, in one batch mixed with base-model rows; full-
vocabulary logprobs and greedy tokens equal to PEFT's model for each; the same over int8
base weights against PEFT on the weights they dequantize to; more adapters than slots; what
a directory may not hold is refused by name."""

import json

import pytest
import torch

from tests.lora_models import (
    ADAPTERS,
    llama_config,
    peft_model,
    qwen3_config,
    reference_greedy,
    reference_logprobs,
    write_base_and_adapters,
)
from tinyserve import LLM, LoRARequest, SamplingParams
from tinyserve.core.adapters import ModelDims, read_adapter

transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")

N_NEW = 32
ATOL = 1e-4  # fp32 logprobs


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def family(request, tmp_path_factory):
    config = (llama_config if request.param == "llama" else qwen3_config)(transformers)
    root = tmp_path_factory.mktemp(f"lora_{request.param}")
    return request.param, write_base_and_adapters(root, config)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return write_base_and_adapters(tmp_path_factory.mktemp("lora_llama"), llama_config(transformers))


def prompts_for(vocab: int = 300) -> list[list[int]]:
    g = torch.Generator().manual_seed(4)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (5, 17, 9, 12)]


def requests(paths, names=None) -> list:
    """The base (None) and three adapters, one per prompt of ``prompts_for``."""
    return [None] + [LoRARequest(name, i + 1, str(paths[name]))
                     for i, name in enumerate(names or ADAPTERS)]


def run(llm: LLM, paths, names=None):
    params = SamplingParams(max_tokens=N_NEW, temperature=0.0, ignore_eos=True,
                            prompt_logprobs=-1)
    return llm.generate(prompts_for(), params, lora_request=requests(paths, names))


def check_against(base_hf, outs, paths, names=None) -> None:
    for prompt, lora, out in zip(prompts_for(), requests(paths, names), outs, strict=True):
        ref = peft_model(base_hf, None if lora is None else paths[lora.lora_name])
        want = reference_logprobs(ref, prompt)
        got = torch.tensor([[row[t] for t in range(want.shape[1])]
                            for row in out.prompt_logprobs[1:]])
        err = (got - want[:-1]).abs().max().item()
        name = "base" if lora is None else lora.lora_name
        assert err < ATOL, (name, err)
        assert list(out.token_ids) == reference_greedy(ref, prompt, N_NEW), name
        if lora is not None:  # the adapter changes the model: the check is not vacuous
            plain = reference_logprobs(base_hf, prompt)
            assert (plain - want).abs().max().item() > 100 * ATOL, name


def test_adapters_in_one_mixed_batch_equal_peft(family):
    name, paths = family
    llm = LLM(str(paths["base"]), dtype="float32", max_loras=3, max_lora_rank=16,
              max_num_seqs=8)
    outs = run(llm, paths)
    base_hf = transformers.AutoModelForCausalLM.from_pretrained(paths["base"]).eval()
    check_against(base_hf, outs, paths)
    assert llm.core.scheduler.lora_slots.num_loads == 3  # each loaded once, none swapped
    assert llm.core.kv.pool.usage == 0.0
    llm.core.scheduler.lora_slots.check_integrity()


def test_int8_base_weights_with_adapters_equal_peft_on_the_dequantized_base(family):
    from tests.server.test_families_serving import dequantized

    name, paths = family
    llm = LLM(str(paths["base"]), dtype="float32", quantization="int8", max_loras=3,
              max_lora_rank=16, max_num_seqs=8)
    outs = run(llm, paths)
    base_hf = transformers.AutoModelForCausalLM.from_pretrained(paths["base"]).eval()
    check_against(dequantized(base_hf, llm.engine.runner.model), outs, paths)


def test_more_adapters_than_slots_are_swapped_in_and_answer_the_same(llama):
    paths = llama
    wide = LLM(str(paths["base"]), dtype="float32", max_loras=3, max_lora_rank=16)
    one = LLM(str(paths["base"]), dtype="float32", max_loras=1, max_lora_rank=16,
              max_cpu_loras=1)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = prompts_for() * 2
    loras = (requests(paths) * 2)[::-1]
    want = [o.token_ids for o in wide.generate(prompts, params, lora_request=loras)]
    got = [o.token_ids for o in one.generate(prompts, params, lora_request=loras)]
    assert got == want
    slots = one.core.scheduler.lora_slots
    assert slots.num_loads >= 3 and one.engine.runner.host_adapters.num_reads >= 3
    slots.check_integrity()
    assert slots.held == set()  # every sequence gave its slot back


def _dims() -> ModelDims:
    return ModelDims(num_layers=2, hidden=64, q_out=128, kv_out=32, intermediate=96)


@pytest.mark.parametrize("change, match", [
    (lambda c: c.update(use_dora=True), "use_dora"),
    (lambda c: c.update(peft_type="PREFIX_TUNING"), "peft_type"),
    (lambda c: c.update(modules_to_save=["lm_head"]), "modules_to_save"),
    (lambda c: c.update(bias="all"), "bias"),
    (lambda c: c.update(rank_pattern={"q_proj": 2}), "rank_pattern"),
    (lambda c: c.update(r=32, lora_alpha=32), "max-lora-rank"),
])
def test_what_an_adapter_may_not_ask_for_is_refused_by_name(llama, tmp_path, change, match):
    import shutil
    paths = llama
    d = tmp_path / "bad"
    shutil.copytree(paths["a_qv"], d)
    cfg = json.loads((d / "adapter_config.json").read_text())
    change(cfg)
    (d / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=match):
        read_adapter(d, _dims(), max_rank=16)


def test_an_adapter_for_another_model_or_of_the_embedding_is_refused(llama, tmp_path):
    import peft
    paths = llama
    assert read_adapter(paths["a_all"], _dims(), 16).modules == tuple(sorted(
        ADAPTERS["a_all"]["target_modules"]))
    with pytest.raises(ValueError, match="shape"):  # the Llama adapter on other dimensions
        read_adapter(paths["a_all"], ModelDims(2, 64, 128, 64, 96), 16)
    m = transformers.AutoModelForCausalLM.from_pretrained(paths["base"])
    emb = peft.get_peft_model(m, peft.LoraConfig(r=4, target_modules=["embed_tokens", "q_proj"]))
    emb.save_pretrained(tmp_path / "emb")
    with pytest.raises(ValueError, match="embed_tokens"):
        read_adapter(tmp_path / "emb", _dims(), 16)


@pytest.mark.parametrize("kv", ["auto", "int8"])
def test_adapters_compose_with_chunked_prefill_preemption_and_the_int8_kv_cache(llama, kv):
    """The same adapters' tokens whether prompts are prefilled whole or in 7-token chunks in a
    pool so small that sequences are preempted and recomputed (over the int8 KV cache too)."""
    paths = llama
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (19, 23, 13, 21)]
    loras = requests(paths)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    plain = LLM(str(paths["base"]), dtype="float32", max_loras=2, max_lora_rank=16,
                kv_cache_dtype=kv)
    want = [o.token_ids for o in plain.generate(prompts, params, lora_request=loras)]
    tight = LLM(str(paths["base"]), dtype="float32", max_loras=2, max_lora_rank=16,
                kv_cache_dtype=kv, max_num_batched_tokens=7, num_kv_blocks=5, block_size=8,
                max_model_len=32)
    got = [o.token_ids for o in tight.generate(prompts, params, lora_request=loras)]
    assert got == want
    assert tight.core.scheduler.num_preemptions > 0
    assert tight.core.kv.pool.usage == 0.0 and tight.core.scheduler.lora_slots.held == set()
