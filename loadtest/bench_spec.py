"""Speculative decoding (issue 24): accepted tokens per verify step and target forward passes
per generated token, n-gram and an int4 self-draft against plain decoding, on a copy/edit
workload (where the n-gram shines) and free generation, greedy, one request at a time (batch
1: a forward pass per step is then the request's own). Every speculative output is checked
token for token against plain decoding's; a mismatch exits 1.

    python loadtest/bench_spec.py [--model stories260k|smollm2|DIR] [--prompts 4]
        [--max-tokens 32] [--k 4]

Prints one JSON line per (workload, method): tokens, target passes per token, verify steps,
accepted drafts per verify, tokens per verify (accepted + the bonus), draft passes, wall time
on this machine (through Triton's CPU interpreter: a verify's K + 1 rows cost far more here
than on a GPU, so wall time says little about a GPU's ITL).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

# (appended: an installed package - Hugging Face's `kernels` - keeps its name over our kernels/)
sys.path.append(str(Path(__file__).resolve().parents[1]))

from tinyserve import LLM, SamplingParams  # noqa: E402
from tinyserve.config import SpeculativeConfig  # noqa: E402

PASSAGES = [
    "Lily went to the park with her mom. She saw a big red ball under a tree and ran to get it.",
    "Tom had a little dog named Max. Every day they walked to the river and played in the sun.",
    "The cat sat on the mat and looked at the bird. The bird sang a happy song and flew away.",
    "Sue liked to bake cakes with her dad. They put in milk, eggs and sugar, and it smelled good.",
]
FREE = ["One day", "Once upon a time", "The little boy", "Sam and Anna"]


def workloads(chat: bool, n: int):
    """(name, prompts): a text to copy or edit, and free generation."""
    if chat:  # an instruct model: asked to repeat or fix a text
        copy = [f"Repeat this text exactly, nothing else: {p}" for p in PASSAGES[:n]]
        free = ["Write a short story about a dragon.", "Why is the sky blue?",
                "Give me three ideas for a birthday party.", "What is a good breakfast?"][:n]
        return [("copy/edit", copy), ("free", free)]
    # a story model: the passage, then its first half again (continuing means copying)
    copy = [p + " " + p[:len(p) // 2] for p in PASSAGES[:n]]
    return [("copy/edit", copy), ("free", FREE[:n])]


def run(llm: LLM, prompts: list, max_tokens: int, chat: bool):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    outs, steps, t0 = [], 0, time.perf_counter()
    for p in prompts:
        ids = llm.tokenizer.encode(llm.tokenizer.apply_chat_template(
            [{"role": "user", "content": p}])) if chat else p
        before = llm.core.scheduler._step_id
        outs.append(llm.generate([ids], params)[0].token_ids)
        steps += llm.core.scheduler._step_id - before
    return outs, steps, time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="stories260k")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    args = ap.parse_args()
    path, chat = args.model, False
    if args.model == "smollm2":
        from tinyserve.models.smollm2 import smollm2_path
        path, chat = str(smollm2_path()), True
    elif args.model == "stories260k":
        from tests.conftest import STORIES_DIR
        path = str(STORIES_DIR)
    methods = {
        "plain": None,
        "ngram": SpeculativeConfig(num_speculative_tokens=args.k, prompt_lookup_min=2),
        "int4 self-draft": SpeculativeConfig(method="draft_model", model=path,
                                             quantization="int4",
                                             num_speculative_tokens=args.k),
    }
    if chat:  # its file is 4-bit already: an int4 copy of it would be the model itself
        del methods["int4 self-draft"]
    kw = dict(dtype="float32", max_model_len=512, num_kv_blocks=96)
    failed = False
    for wname, prompts in workloads(chat, args.prompts):
        want = None
        for mname, sp in methods.items():
            llm = LLM(path, speculative=sp, **kw)
            outs, steps, wall = run(llm, prompts, args.max_tokens, chat)
            tokens = sum(len(o) for o in outs)
            row = {"model": args.model, "workload": wname, "method": mname, "tokens": tokens,
                   "passes_per_token": round(steps / tokens, 3), "wall_s": round(wall, 1)}
            if want is None:
                want = outs
            else:
                s = llm.core.scheduler.spec
                draft = llm.engine.runner.draft
                row |= {"identical": outs == want, "verifies": s.num_verifies,
                        "accepted_per_verify": round(s.num_accepted / max(s.num_verifies, 1), 2),
                        "tokens_per_verify": round(1 + s.num_accepted / max(s.num_verifies, 1),
                                                   2),
                        "acceptance": round(s.num_accepted / max(s.num_draft_tokens, 1), 3),
                        "draft_passes": draft.num_forwards if draft is not None else 0}
                failed |= outs != want
            print(json.dumps(row), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
