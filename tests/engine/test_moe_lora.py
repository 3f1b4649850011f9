"""LoRA adapters on a mixture-of-experts base (issue 37): on attention they equal PEFT; on
experts they are refused by name (tests/engine/test_lora.py has the dense cases)."""

import pytest

from tests.engine.test_lora import check_against, run
from tests.lora_models import qwen3moe_config, write_base_and_adapters
from tinyserve import LLM
from tinyserve.core.adapters import read_adapter

transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")

MOE_ADAPTERS = {  # attention only; the last one's gate_proj makes PEFT target the experts
    "m_qv": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    "m_all": dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    "m_o": dict(r=16, lora_alpha=8, target_modules=["o_proj"], use_rslora=True),
    "m_experts": dict(r=8, lora_alpha=16, target_modules=["q_proj", "gate_proj", "up_proj"]),
}


def test_adapters_on_an_moe_base_equal_peft(tmp_path):
    """A Qwen3-MoE base (sparse layers 0 and 2, a dense layer 1): adapters on its attention
    projections, in one mixed batch with base rows, equal to PEFT. PEFT puts an adapter that
    targets gate / up / down on the experts themselves (target_parameters): refused by name,
    as is a tensor for a sparse layer's feed-forward in an adapter file."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    paths = write_base_and_adapters(tmp_path, qwen3moe_config(transformers),
                                    adapters=MOE_ADAPTERS)
    llm = LLM(str(paths["base"]), dtype="float32", max_loras=3, max_lora_rank=16,
              max_num_seqs=8)
    base_hf = transformers.AutoModelForCausalLM.from_pretrained(paths["base"]).eval()
    names = ["m_qv", "m_all", "m_o"]
    check_against(base_hf, run(llm, paths, names), paths, names)
    dims = llm.engine.info.lora_dims
    assert dims.sparse_layers == frozenset({0, 2})
    experts = paths["m_experts"]
    assert json.loads((experts / "adapter_config.json").read_text())["target_parameters"]
    with pytest.raises(ValueError, match="adapters on expert weights are not supported"):
        read_adapter(experts, dims, 16)
    bad = tmp_path / "bad"  # m_all's layer-0 q_proj tensors renamed to a sparse gate_proj
    shutil.copytree(paths["m_all"], bad)
    tensors = load_file(bad / "adapter_model.safetensors")
    q = "base_model.model.model.layers.0.self_attn.q_proj"
    for ab in "AB":
        tensors[f"base_model.model.model.layers.0.mlp.gate_proj.lora_{ab}.weight"] = \
            tensors.pop(f"{q}.lora_{ab}.weight")
    save_file(tensors, bad / "adapter_model.safetensors")
    with pytest.raises(ValueError, match="layer 0's feed-forward is a mixture of experts"):
        read_adapter(bad, dims, 16)
