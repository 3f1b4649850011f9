"""How close each model family's configs in tests/engine/test_families.py come to transformers.

    python loadtest/bench_families.py          # from the repository root; about 2 minutes

Per config, in fp32 (the test's checkpoints, prompts and steps): the runner's logits over a
two-chunk prefill and three decode steps against transformers' full-sequence logits (relative
L2 and the largest logprob difference), then 32 greedy tokens through ``LLM.generate`` against
transformers' (``generate``; step by step for Phi-3's LongRoPE, see the test) and the largest
difference among every reported logprob (chosen + top 5). Prints a markdown table.

A benchmark: it reports the margins under the test's bounds; the test asserts them.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel is defined (no-op on a GPU box)
# (appended: an installed package - Hugging Face's `kernels` - keeps its name over our kernels/)
sys.path.append(str(Path(__file__).resolve().parents[1]))  # tests/ is not a package on the path


def main() -> None:
    import torch

    import tests.engine.test_families as fam
    from tests.engine.test_model_vs_transformers import rel_l2, run_chunk
    from tinyserve.llm import LLM
    from tinyserve.messages import SamplingParams

    print("| config | logits relative L2 | max \\|Δlogprob\\|, prefill + decode | "
          "max \\|Δlogprob\\|, 32 greedy tokens (top 5) | greedy tokens |")
    print("|---|---|---|---|---|")
    for name in sorted(fam.CONFIGS):
        path = Path(tempfile.mkdtemp(prefix=name))
        hf = fam.build(name, path)
        llm = LLM(str(path), dtype="float32", num_kv_blocks=64, block_size=fam.BLOCK,
                  max_model_len=80)
        ids = fam.prompt(1, min(44, fam.LENGTH_DEPENDENT.get(name, 128)))
        n = len(ids) - 3
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0].double()
        blocks = [7, 2, 9, 4]
        got = [run_chunk(llm.engine, 0, ids[:20], 0, blocks),
               run_chunk(llm.engine, 0, ids[:n], 20, blocks)]
        got += [run_chunk(llm.engine, 0, ids[:p + 1], p, blocks) for p in range(n, len(ids))]
        got = torch.cat(got).double()
        prefill_err = (got.log_softmax(-1) - ref.log_softmax(-1)).abs().max().item()
        prompt = fam.prompt(4, 40)
        tokens, rows = fam.hf_greedy(hf, prompt, 32, loop=name in fam.REPREFILLS)
        [out] = llm.generate([prompt], SamplingParams(max_tokens=32, temperature=0.0,
                                                      min_tokens=32, logprobs=5))
        gen_err = max(abs(lp - float(rows[i][t])) for i, entry in enumerate(out.logprobs)
                      for t, lp in entry.items())
        same = "equal" if list(out.token_ids) == tokens else "DIFFERENT"
        print(f"| {name} | {rel_l2(got, ref):.1e} | {prefill_err:.1e} | {gen_err:.1e} | "
              f"{same} |", flush=True)


if __name__ == "__main__":
    main()
