"""gpt-oss against transformers: tests/engine/moe_families.py's tests on its two configs (its
experts are stored stacked only: no per-expert layout to compare)."""

import pytest

pytest.importorskip("transformers")

from tests.engine.moe_families import (  # noqa: E402, F401 (the tests this file runs)
    families,
    test_a_prompt_alone_equals_it_in_a_batch_of_sixteen,
    test_greedy_generation_and_logprobs_through_llm,
    test_logits_match_transformers_over_prefill_and_decode,
    test_quantized_experts_equal_their_dequantized_weights,
    test_the_config_says_which_layers_are_sparse,
)

family, whole_run = families("gptoss", "gptoss_e6_top2_yarn")


def test_mxfp4_dequantizes_bit_exactly_as_transformers():
    import torch
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from tinyserve.engine.loading.mxfp4 import dequantize_mxfp4

    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 10, 4, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(100, 150, (3, 10, 4), generator=g, dtype=torch.uint8)
    scales[0, 0, 0], scales[1, 2, 3] = 0, 130  # the exponent's low end: 2^-127 (subnormals)
    for dtype in (torch.float32, torch.bfloat16):
        ours = dequantize_mxfp4(blocks, scales, "t", dtype)
        assert ours.shape == (3, 10, 128) and ours.dtype == dtype
        theirs = convert_moe_packed_tensors(blocks, scales, dtype=dtype)  # [E, K, N]
        assert torch.equal(ours, theirs.transpose(1, 2)), dtype
    with pytest.raises(ValueError, match="t: MXFP4 blocks"):
        dequantize_mxfp4(blocks[..., :8], scales, "t")
    with pytest.raises(ValueError, match="must be uint8"):
        dequantize_mxfp4(blocks.to(torch.int16), scales, "t")
    scales[2, 9, 0] = 255  # e8m0's NaN: refused, never a weight
    with pytest.raises(ValueError, match="t: MXFP4 scales give non-finite"):
        dequantize_mxfp4(blocks, scales, "t")


def test_an_mxfp4_checkpoint_equals_transformers_on_its_dequantized_experts(tmp_path):
    """gpt-oss's own checkpoint layout: experts as MXFP4 blocks and scales, quantization_config
    naming the modules kept in bf16; the logits equal transformers' with the experts it
    dequantizes itself."""
    import json

    import torch
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from tests.engine.moe_families import build
    from tests.engine.test_families import check_logits

    hf = build("gptoss_e6_top2_yarn", tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for i, layer in enumerate(hf.model.layers):
            x = f"model.layers.{i}.mlp.experts."
            for name, param in (("gate_up_proj", layer.mlp.experts.gate_up_proj),
                                ("down_proj", layer.mlp.experts.down_proj)):
                E, K, N = param.shape  # transformers' [E, in, out]
                blocks = torch.randint(0, 256, (E, N, K // 32, 16), generator=g,
                                       dtype=torch.uint8)
                scales = torch.randint(119, 125, (E, N, K // 32), generator=g, dtype=torch.uint8)
                del tensors[x + name]
                tensors[x + name + "_blocks"], tensors[x + name + "_scales"] = blocks, scales
                param.copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
    save_file(tensors, tmp_path / "model.safetensors")
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    check_logits("gptoss_mxfp4", hf, tmp_path, 30)
