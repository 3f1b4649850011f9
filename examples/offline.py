"""Offline batch generation with the LLM API (no server): many prompts, one batched run.

    python examples/offline.py              # the bundled stories260k; or give a model directory
"""

import sys

from tinyserve import LLM, SamplingParams

model = sys.argv[1] if len(sys.argv) > 1 else None  # None: the bundled stories260k
llm = LLM(model)
prompts = ["Once upon a time", "The little dog", "Lily and Ben went to the park"]
outputs = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0))
for prompt, out in zip(prompts, outputs):
    print(f"{prompt!r} -> {out.text!r} ({len(out.token_ids)} tokens, {out.finish_reason})")

# Seeded sampling with per-token logprobs, and int8 weights
llm8 = LLM(model, quantization="int8")
print(f"int8 weights: {llm8.info.weight_bytes_unquantized / 1e6:.2f} MB -> "
      f"{llm8.info.weight_bytes / 1e6:.2f} MB")
[out] = llm8.generate("Once upon a time", SamplingParams(max_tokens=8, temperature=0.8, seed=42,
                                                          logprobs=2))
print(repr(out.text), out.logprobs[0])
