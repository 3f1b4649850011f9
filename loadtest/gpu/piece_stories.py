"""(b) stories260k (the bundled model) against its transformers reference.json: greedy 48
tokens identical in fp32; in fp16 and bf16, token agreement (free-running greedy, and the top
token at each position of the reference text, teacher-forced).

Through DeviceEngine: the free-running tokens by EngineCore's step loop (checklib.
engine_generate, which is LLM.generate's loop), the teacher-forced ones by decode steps of
ModelRunner.execute that feed the reference's own tokens.
"""

from __future__ import annotations

import gc
import json
import time

import checklib as L

# Teacher-forced top-1 agreement with fp32's reference tokens that fp16 / bf16 must reach.
AGREEMENT = {"float16": 0.9, "bfloat16": 0.8}
BF16_ON_CPU = ("the CPU interpreter computes bf16 arithmetic on raw bits "
               "(tests/kernels/dtypes.py) and DeviceEngine refuses bf16 on the CPU")


def teacher_forced(engine, prompt: list[int], tokens: list[int]) -> list[int]:
    """The greedy token after the prompt and after each reference token (decode steps that feed
    ``tokens``, not the model's own choices): len(tokens) predictions."""
    from tinyserve.messages import SamplingParams, ScheduledSeq, StepPlan

    runner, bs = engine.runner, engine.info.block_size
    blocks = tuple(range(-(-(len(prompt) + len(tokens)) // bs)))
    greedy = SamplingParams(max_tokens=1, temperature=0.0)
    sid = 10**6
    res = runner.execute(StepPlan(1, (ScheduledSeq(sid, tuple(prompt), 0, blocks, True, greedy, 0),)))
    preds = [res.outputs[0].token_id]
    for i, tok in enumerate(tokens[:-1]):
        seq = ScheduledSeq(sid, (tok,), len(prompt) + i, (), True, greedy, 0,
                           first_block=len(blocks))
        preds.append(runner.execute(StepPlan(2 + i, (seq,))).outputs[0].token_id)
    runner.execute(StepPlan(10**5, (), freed=(sid,)))
    return preds


def run(piece: L.Piece, P: dict, ctx) -> None:
    from tinyserve.engine.device import select_device

    dev = select_device(ctx.device)
    import torch

    from tinyserve.config import EngineConfig
    from tinyserve.engine.device_engine import DeviceEngine
    from tinyserve.models import STORIES260K

    ref = json.loads((STORIES260K / "reference.json").read_text())
    n = P["tokens"]
    prompt, want = ref["prompt_token_ids"], ref["greedy_new_token_ids"][:n]
    t = piece.table(f"stories260k, {n} tokens after {ref['prompt']!r}",
                    ["dtype", "greedy tokens equal to reference", "first difference at",
                     "teacher-forced top-1 agreement", "seconds"])
    for dt in ("float32", "float16", "bfloat16"):
        short = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}[dt]
        if dt not in P["dtypes"]:
            piece.check(f"{short} token agreement", skipped=BF16_ON_CPU if dt == "bfloat16"
                        else "not in this run")
            continue
        if ctx.deadline.over(5):
            piece.check(f"{short} token agreement", skipped="out of the piece's budget")
            continue
        t0 = time.perf_counter()
        cfg = EngineConfig(model=str(STORIES260K), dtype=dt, device=dev, max_num_seqs=1,
                           num_kv_blocks=16, max_model_len=256)
        engine = DeviceEngine(cfg)
        tf = teacher_forced(engine, prompt, want)
        [out] = L.engine_generate(engine, cfg, [prompt], n, ignore_eos=False)
        out = list(out)
        same = sum(a == b for a, b in zip(out, want))
        first = next((i for i, (a, b) in enumerate(zip(out, want)) if a != b), None)
        agree = sum(a == b for a, b in zip(tf, want)) / len(want)
        piece.row(t, [short, f"{same}/{len(want)}", first, round(agree, 4),
                      round(time.perf_counter() - t0, 1)])
        if dt == "float32":
            piece.check(f"fp32 greedy {n} tokens == reference.json", out == want,
                        value=f"{same}/{len(want)} equal")
            piece.check("fp32 teacher-forced top-1 == reference.json", tf == want,
                        value=f"{agree:.1%}")
            text = engine.tokenizer.decode(prompt + out)
            if n == len(ref["greedy_new_token_ids"]):
                piece.check("fp32 text == reference.json full_text", text == ref["full_text"],
                            value=text[-60:])
            else:
                piece.check("fp32 text is a prefix of reference.json full_text",
                            ref["full_text"].startswith(text), value=text[-60:])
        else:
            piece.check(f"{short} teacher-forced top-1 agreement with fp32's reference", agree >=
                        AGREEMENT[dt], value=round(agree, 4), limit=f">= {AGREEMENT[dt]}")
        del engine
        gc.collect()
        if dev == "cuda":
            torch.cuda.empty_cache()
