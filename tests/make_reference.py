"""Regenerate (or check) a model folder's reference.json with Hugging Face transformers.

    python -m tests.make_reference                          # rewrite stories260k's
    python -m tests.make_reference --check                  # compare, exit 1 on a mismatch
    python -m tests.make_reference --model DIR --prompt "..." --new-tokens 48

The golden tests compare tinyserve's greedy output with this file, so it must come from an
independent implementation: transformers' LlamaForCausalLM on the CPU in float32.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
from pathlib import Path

from tinyserve.models import STORIES260K


def make_reference(model_dir: Path, prompt: str, new_tokens: int) -> dict:
    import safetensors
    import tokenizers
    import torch
    import transformers
    from transformers import AutoTokenizer, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    ids = tok(prompt).input_ids
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False,
                             min_new_tokens=new_tokens, pad_token_id=tok.eos_token_id)
        new = out[0, len(ids):].tolist()
        last = model(torch.tensor([ids])).logits[0, -1]
        full = model(out).logits[0].double()
    top = torch.topk(last, 5)
    return {
        "prompt": prompt,
        "add_bos": bool(ids and ids[0] == tok.bos_token_id),
        "prompt_token_ids": ids,
        "prompt_tokens": tok.convert_ids_to_tokens(ids),
        "greedy_new_token_ids": new,
        "greedy_text": tok.decode(new, skip_special_tokens=True),
        "full_text": tok.decode(out[0], skip_special_tokens=True),
        "last_prompt_position_top5": {
            "token_ids": top.indices.tolist(),
            "tokens": tok.convert_ids_to_tokens(top.indices.tolist()),
            "logits": top.values.tolist()},
        "full_sequence_logits": {
            "sequence": "prompt_token_ids + greedy_new_token_ids, one forward pass",
            "shape": list(full.shape), "sum": full.sum().item(), "max_abs": full.abs().max().item()},
        "settings": {"dtype": "float32", "device": "cpu", "do_sample": False,
                     "max_new_tokens": new_tokens, "eos_token_id": model.config.eos_token_id,
                     "stopped_early": len(new) < new_tokens},
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "tokenizers": tokenizers.__version__, "safetensors": safetensors.__version__,
                     "python": platform.python_version()},
    }


def differences(old: dict, new: dict) -> list[str]:
    """What a check compares: ids and texts exactly, logits to float32 rounding."""
    diffs = [k for k in ("prompt_token_ids", "greedy_new_token_ids", "greedy_text")
             if old.get(k) != new[k]]
    o, n = old.get("last_prompt_position_top5", {}), new["last_prompt_position_top5"]
    if o.get("token_ids") != n["token_ids"] or not all(
            math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-4) for a, b in zip(o["logits"], n["logits"])):
        diffs.append("last_prompt_position_top5")
    o, n = old.get("full_sequence_logits", {}), new["full_sequence_logits"]
    if not math.isclose(o.get("sum", math.nan), n["sum"], rel_tol=1e-5):
        diffs.append("full_sequence_logits")
    return diffs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=STORIES260K)
    ap.add_argument("--prompt", default="Once upon a time")
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--check", action="store_true", help="compare with the file, write nothing")
    args = ap.parse_args(argv)
    ref = make_reference(args.model, args.prompt, args.new_tokens)
    path = args.model / "reference.json"
    if args.check:
        diffs = differences(json.loads(path.read_text()), ref)
        print(f"{path}: " + (f"differs in {', '.join(diffs)}" if diffs else "matches"))
        return 1 if diffs else 0
    path.write_text(json.dumps(ref, indent=2, ensure_ascii=False) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
