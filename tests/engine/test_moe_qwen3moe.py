"""Qwen3-MoE against transformers: tests/engine/moe_families.py's tests on its two configs."""

import pytest

pytest.importorskip("transformers")

from tests.engine.moe_families import (  # noqa: E402, F401 (the tests this file runs)
    families,
    test_a_prompt_alone_equals_it_in_a_batch_of_sixteen,
    test_greedy_generation_and_logprobs_through_llm,
    test_logits_match_transformers_over_prefill_and_decode,
    test_quantized_experts_equal_their_dequantized_weights,
    test_stacked_and_per_expert_checkpoints_load_the_same,
    test_the_config_says_which_layers_are_sparse,
)

family, whole_run = families("qwen3moe", "qwen3moe_e60_dense")
