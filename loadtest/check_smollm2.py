"""SmolLM2-135M-Instruct (GGUF, Q4_1) end to end against transformers' GGUF load of the same file,
with what a user sees: everything tests/engine/test_smollm2.py checks, at full length.

    python loadtest/check_smollm2.py [--markdown]     # about 25 minutes on the 2-core CPU
    python loadtest/check_smollm2.py --skip-reference # 5 and 6 only (no transformers load)

1. load time (tinyserve, kept and dequantized; transformers);
2. the tokenizer: ids and decoded text on 500 varied strings (tests/text/test_gguf_tokenizers.py's);
3. full-vocabulary logprobs over a 200-token teacher-forced text, kept and dequantized:
   max |delta logprob| and top-token agreement with transformers;
4. greedy 48 tokens on 4 chat prompts (the file's ChatML template), dequantized and kept, each
   prompt against transformers' generate;
5. decode step time at batch 1 and 8 (the interpreter: no GPU here);
6. through the server with the OpenAI client: a streamed chat, a tool call (hermes parser,
   tool_choice required), and json_schema output: each parsed as a client would.

A check script: it prints what it finds, and exits non-zero when an equality above fails.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")
# (appended: an installed package - Hugging Face's `kernels` - keeps its name over our kernels/)
sys.path.append(str(Path(__file__).resolve().parents[1]))  # tests/ (the 500 strings)

CHATS = ["What is the capital of France?", "Write a haiku about the sea.",
         "Explain in one sentence what a CPU does.", "List three colors."]
TEXT = ("Once upon a time, in a small village by the sea, there lived an old fisherman who went "
        "out every morning before the sun rose. One day he found a bottle in his net. Inside the "
        "bottle was a letter, written in a language he did not know, and a small map of an "
        "island. He showed the letter to the teacher, to the priest and to the baker, but none of "
        "them could read it. So he decided to sail to the island himself. The journey took three "
        "days and three nights, and on the last night a storm came. The waves were as high as "
        "houses, and the wind tore at the sail until it broke. When morning came, the sea was "
        "calm again, and the fisherman saw a white beach and tall green trees in front of him. "
        "He pulled his boat onto the sand and walked along the shore, holding the map in one "
        "hand and a lantern in the other. Behind a large rock he found a cave, and in the cave "
        "there was an old wooden chest covered with shells and seaweed.")


def main(argv: list[str] | None = None) -> int:
    import torch
    import transformers

    from tests.engine.test_model_vs_transformers import run_chunk
    from tests.text.test_gguf_tokenizers import strings
    from tinyserve.llm import LLM
    from tinyserve.messages import SamplingParams
    from tinyserve.models.smollm2 import ensure_smollm2

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--skip-reference", action="store_true",
                    help="skip 1-4 (transformers' load, the equalities): step times and server only")
    args = ap.parse_args(argv)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    path = ensure_smollm2()
    rows, failures = [], []

    def report(what: str, result: str, ok: bool = True) -> None:
        rows.append((what, result))
        print(f"{'ok ' if ok else 'BAD'} {what}: {result}", flush=True)
        if not ok:
            failures.append(what)

    if args.skip_reference:
        llm = LLM(str(path), dtype="float32", num_kv_blocks=64, max_model_len=1024)
        tok = llm.tokenizer
        prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": c}]), False)
                   for c in CHATS]
        _step_times(llm, prompts, report)
        del llm
        _served(path, report)
        return _finish(args, rows, failures)
    t = time.perf_counter()
    hf = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                           dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    report("transformers load (dequantized fp32)", f"{time.perf_counter() - t:.1f} s")
    llms = {}
    for kept in (True, False):
        t = time.perf_counter()
        llms[kept] = LLM(str(path), dtype="float32", num_kv_blocks=64, max_model_len=1024,
                         dequantize=not kept)
        report(f"tinyserve load ({'kept Q4_1 / Q8_0' if kept else 'dequantized'})",
               f"{time.perf_counter() - t:.1f} s")

    texts = strings()
    ours = llms[True].tokenizer
    bad = [s for s in texts if ours.encode(s, False) != tok.encode(s, add_special_tokens=False)]
    report("tokenizer, 500 strings", f"{500 - len(bad)} of 500 equal", not bad)

    ids = tok(TEXT)["input_ids"][:200]
    assert len(ids) == 200, len(ids)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].double().log_softmax(-1)
    for kept, llm in llms.items():
        got = run_chunk(llm.engine, 0, ids, 0, list(range(1, 14))).double().log_softmax(-1)
        err = (got - ref).abs().max().item()
        agree = (got.argmax(-1) == ref.argmax(-1)).double().mean().item()
        report(f"logprobs, 200-token text ({'kept' if kept else 'dequantized'})",
               f"max |dlogprob| {err:.1e} over {len(ids)} x {ref.shape[1]}; top token "
               f"{agree:.1%} equal", err < 2e-4)

    prompts = [tok.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True,
                                       tokenize=True) for c in CHATS]
    prompts = [p if isinstance(p, list) else p["input_ids"] for p in prompts]
    want = []
    with torch.no_grad():
        for p in prompts:
            out = hf.generate(torch.tensor([p]), max_new_tokens=48, do_sample=False,
                              pad_token_id=tok.pad_token_id)
            want.append(out[0, len(p):].tolist())
    for kept, llm in llms.items():
        t = time.perf_counter()
        outs = llm.generate(prompts, SamplingParams(max_tokens=48, temperature=0.0))
        same = sum(list(o.token_ids) == w[:len(o.token_ids)] for o, w in zip(outs, want, strict=True))
        report(f"greedy 48 tokens, 4 chats batched ({'kept' if kept else 'dequantized'})",
               f"{same} of 4 equal to transformers' generate ({time.perf_counter() - t:.0f} s); "
               f"first: {outs[0].text!r}", same == 4 or kept)
    _step_times(llms[True], prompts, report)
    del llms
    _served(path, report)
    return _finish(args, rows, failures)


def _finish(args, rows, failures) -> int:
    if args.markdown:
        print("\n| check | result |\n|---|---|")
        for what, result in rows:
            print(f"| {what} | {result} |")
    return 1 if failures else 0


def _step_times(llm, prompts, report) -> None:
    from tinyserve.messages import SamplingParams

    for batch in (1, 8):
        ps = [prompts[i % 4] for i in range(batch)]
        llm.generate(ps, SamplingParams(max_tokens=1))  # prefill and warm the cache
        t = time.perf_counter()
        llm.generate(ps, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
        step = (time.perf_counter() - t) / 6
        report(f"decode step, batch {batch} (interpreter, kept)", f"{step:.2f} s")


def _served(path: Path, report) -> None:
    """A streamed chat, a required tool call and a json_schema answer through the OpenAI client."""
    import openai

    from tests.server.conftest import ServerProcess

    log = Path(os.environ.get("TMPDIR", "/tmp")) / "check_smollm2_server.log"
    srv = ServerProcess("--num-kv-blocks", "128", "--max-model-len", "1024", log_path=log,
                        model=path)
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused")
        name = client.models.list().data[0].id
        t = time.perf_counter()
        stream = client.chat.completions.create(
            model=name, messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=12, temperature=0, stream=True)
        text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        report("server: streamed chat", f"{text!r} ({time.perf_counter() - t:.0f} s)",
               "Paris" in text)
        tools = [{"type": "function", "function": {
            "name": "get_weather", "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                           "required": ["city"]}}}]
        t = time.perf_counter()
        r = client.chat.completions.create(
            model=name, messages=[{"role": "user", "content": "What is the weather in Paris?"}],
            tools=tools, tool_choice="required", parallel_tool_calls=False, max_tokens=64,
            temperature=0)
        calls = r.choices[0].message.tool_calls or []
        if not calls:
            print(f"    (no call: content {r.choices[0].message.content!r}, finish "
                  f"{r.choices[0].finish_reason})", flush=True)
        args = json.loads(calls[0].function.arguments) if calls else None
        report("server: tool_choice required (hermes)",
               f"{calls[0].function.name if calls else None}({args}) "
               f"({time.perf_counter() - t:.0f} s)", bool(calls) and "city" in (args or {}))
        schema = {"type": "object", "properties": {"answer": {"type": "string"},
                                                   "confidence": {"type": "integer"}},
                  "required": ["answer", "confidence"], "additionalProperties": False}
        t = time.perf_counter()
        r = client.chat.completions.create(
            model=name, messages=[{"role": "user", "content": "What is 2 + 2? Answer in JSON."}],
            response_format={"type": "json_schema",
                             "json_schema": {"name": "a", "schema": schema}},
            max_tokens=40, temperature=0)
        content = r.choices[0].message.content
        try:
            parsed = json.loads(content)
            ok = set(parsed) == {"answer", "confidence"} and isinstance(parsed["confidence"], int)
        except ValueError:
            ok = False
        report("server: json_schema output", f"{content!r} ({time.perf_counter() - t:.0f} s)", ok)
    finally:
        srv.stop()


if __name__ == "__main__":
    sys.exit(main())
