"""``python -m tinyserve``: the command line -> configs -> the server (``serve``)."""

from __future__ import annotations

import logging
import sys

from tinyserve.cli.flags import build_parser
from tinyserve.cli.models import build_models
from tinyserve.cli.tenants import load_tenants
from tinyserve.cli.values import (
    parse_fallback,
    parse_lora_module,
    parse_route,
    parse_speculative_config,
)
from tinyserve.config import EngineConfig, ServerConfig
from tinyserve.core.routing import Router


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if args.demo and args.model:
            raise ValueError("--demo and --model are exclusive: give one")
        engine_cfg = EngineConfig(
            random_demo=args.demo, dtype=args.dtype, quantization=args.quantization,
            dequantize=args.dequantize,
            kv_cache_dtype=args.kv_cache_dtype,
            device=args.device, block_size=args.block_size, num_kv_blocks=args.num_kv_blocks,
            kv_cache_memory=args.kv_cache_memory, max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
            enable_prefix_caching=not args.no_prefix_caching, enforce_eager=args.enforce_eager,
            grammar_cache_bytes=args.grammar_cache_memory,
            grammar_tenant_cache_bytes=args.grammar_tenant_cache_memory,
            grammar_max_bytes=args.grammar_max_memory,
            max_loras=args.max_loras if args.max_loras is not None else int(
                args.enable_lora or bool(args.lora_modules)),
            max_lora_rank=args.max_lora_rank, max_cpu_loras=args.max_cpu_loras,
            speculative=None if args.speculative_config is None else parse_speculative_config(
                args.speculative_config))
        models = build_models(engine_cfg, args.model or [], args.served_model_name)
        tenants = load_tenants(args.tenants) if args.tenants else ()
        server_cfg = ServerConfig(
            routes=tuple(parse_route(r) for r in args.route),
            fallbacks=tuple(parse_fallback(f) for f in args.fallback),
            tenants=tenants, slo_ttft_ms=args.slo_ttft_ms, slo_itl_ms=args.slo_itl_ms,
            host=args.host, port=args.port,
            api_key=args.api_key, max_waiting=args.max_waiting,
            batch_timeout_ms=args.batch_timeout_ms, overlap=not args.no_overlap,
            stream_interval=args.stream_interval, stream_write_rate=args.stream_write_rate,
            drain_timeout_s=args.drain_timeout,
            step_timeout_s=args.step_timeout, max_failed_steps=args.max_failed_steps,
            max_body_bytes=args.max_body_size, log_level=args.log_level,
            access_log=args.access_log, metrics_namespace=args.metrics_namespace,
            tool_call_parser=args.tool_call_parser, responses_store_max=args.responses_store,
            special_tokens_in_content=args.special_tokens_in_content,
            responses_store_max_bytes=args.responses_store_size,
            lora_modules=tuple(parse_lora_module(m) for m in args.lora_modules))
        Router([m.name for m in models], server_cfg.routes, server_cfg.fallbacks,
               adapters=[name for name, _, _ in server_cfg.lora_modules])  # checks
    except (ValueError, OSError) as e:  # OSError: an unreadable tenants file
        sys.stderr.write(f"error: {e}\n")
        return 2
    from tinyserve.server import serve

    listener = None
    if server_cfg.access_log:
        from tinyserve.api import access_log

        listener = access_log.configure()
    try:
        try:
            import uvloop
        except ImportError:  # pragma: no cover - uvloop is a dependency; Windows lacks it
            import asyncio

            return asyncio.run(serve(server_cfg, models))
        return uvloop.run(serve(server_cfg, models))
    finally:
        if listener is not None:
            listener.stop()  # writes out the lines still queued
