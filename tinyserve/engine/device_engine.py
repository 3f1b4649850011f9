"""DeviceEngine: a loaded model, its KV cache and its tokenizer, built from an EngineConfig.

The data plane's entry point, built in named steps, in this order:

    device      the device, and the Triton interpreter off a GPU (before any kernel import)
    checkpoint  the model directory or GGUF file (the bundled demo, SmolLM2 fetched once)
    config      ModelConfig from config.json (or the GGUF's metadata), the dtype
    weights     safetensors or GGUF tensors, quantized as asked
    tokenizer   tokenizer.json (or the GGUF's), with the model's EOS ids
    adapters    LoRA slots and the host cache (before the KV cache: sized from what is left)
    draft       speculation's draft model (its KV paged by the target's blocks)
    kv          the KV cache's blocks: given, from a memory budget, or from free memory
    runner      the model over its kernels, and the ModelRunner that owns the device state
    grammars    the structured-output compiler over this tokenizer

Everything that imports torch or the kernels does so inside a step, after ``device``.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import Any

from tinyserve.config import EngineConfig
from tinyserve.core.adapters import AdapterSpec, ModelDims
from tinyserve.core.engines import EngineInfo
from tinyserve.core.kv_manager import min_kv_blocks
from tinyserve.engine.device import select_device
from tinyserve.formats.gguf import is_gguf
from tinyserve.models import SMOLLM2

log = logging.getLogger(__name__)

CPU_KV_BUDGET = 2 << 30  # bytes: the interpreter copies KV storages per launch; keep them modest


class DeviceEngine:
    """A core.engines.Engine: ``info``, ``tokenizer``, ``runner``, ``grammars``, ``warm_up``."""

    def __init__(self, cfg: EngineConfig) -> None:
        from tinyserve.engine.loading.model_config import load_model_config

        t0 = time.perf_counter()
        self.device = select_device(cfg.device)
        model_dir = _checkpoint(cfg)
        mcfg = self.model_config = load_model_config(model_dir)
        dtype = _resolve_dtype(cfg.dtype, self.device, mcfg.torch_dtype)
        weights = _weights(cfg, model_dir, mcfg, dtype, self.device)
        self.tokenizer = _tokenizer(model_dir, mcfg)
        max_model_len = cfg.max_model_len or mcfg.max_position_embeddings
        if max_model_len > mcfg.max_position_embeddings:
            log.warning("max_model_len %d exceeds the model's max_position_embeddings %d",
                        max_model_len, mcfg.max_position_embeddings)
        lora = _adapters(cfg, mcfg, dtype, self.device)
        draft = _draft(cfg, mcfg, self.tokenizer, dtype, self.device)
        kv_spec = self._kv(cfg, mcfg, dtype, max_model_len, draft)
        self.runner = _runner(cfg, mcfg, weights, kv_spec, max_model_len, lora, draft,
                              self.device)
        self.info = EngineInfo(
            model_path=str(model_dir), device=self.device, dtype=str(dtype).removeprefix("torch."),
            quantization=weights.quantization, kv_cache_dtype=cfg.kv_cache_dtype,
            vocab_size=mcfg.vocab_size, max_model_len=max_model_len,
            block_size=cfg.block_size, num_kv_blocks=kv_spec.num_blocks,
            kv_cache_bytes=kv_spec.total_bytes, weight_bytes=weights.nbytes(),
            weight_bytes_unquantized=weights.nbytes(dtype),
            eos_token_ids=self.tokenizer.eos_token_ids, random_weights=cfg.random_demo,
            architecture=mcfg.architecture,
            kv_window=mcfg.sliding_window if mcfg.every_layer_windowed else None,
            max_loras=cfg.max_loras, max_lora_rank=cfg.max_lora_rank if cfg.max_loras else 0,
            speculative=cfg.speculative, lora_dims=None if lora is None else lora[2],
            num_experts=mcfg.num_experts)
        self.grammars = _grammar_compiler(self.tokenizer, mcfg.vocab_size, cfg)
        self.runner.logits.grammars = self.grammars
        self._log_loaded(kv_spec, time.perf_counter() - t0)

    def warm_up(self) -> dict:
        """Every kernel specialization serving needs, compiled (decode buckets recorded, and
        captured as CUDA graphs on a GPU) before the first request: see ``warmup.py``."""
        from tinyserve.engine.running.warmup import warm_up

        return warm_up(self.runner)

    def read_adapter(self, spec: AdapterSpec) -> None:
        """An adapter's weights read whole, each checked finite in the model's dtype, and kept
        in host memory (ValueError naming the file and tensor: the load is refused). Off the
        step thread: the server calls it from its load route's worker."""
        if self.runner.host_adapters is None:
            raise ValueError("this engine serves no LoRA adapters")
        self.runner.host_adapters.read(spec.adapter_id, spec.path, spec.scale)

    def _kv(self, cfg: EngineConfig, mcfg: Any, dtype: Any, max_model_len: int,
            draft: tuple | None) -> Any:
        """The KV cache's spec: its blocks as many as given, budgeted or free memory allows,
        and never fewer than one sequence (or a window and two steps) needs."""
        from tinyserve.engine.model.kv_cache import KVCacheSpec

        one_block = KVCacheSpec(1, cfg.block_size, mcfg.num_layers, mcfg.num_kv_heads,
                                mcfg.head_dim, dtype, cfg.kv_cache_dtype == "int8")
        per_block = one_block.bytes_per_block + (0 if draft is None else
                                                 draft[1].bytes_per_block)
        num_blocks = self._num_kv_blocks(cfg, mcfg, per_block, dtype.itemsize, max_model_len)
        window = mcfg.sliding_window if mcfg.every_layer_windowed else None
        min_blocks = min_kv_blocks(max_model_len, cfg.block_size, window,
                                   cfg.max_num_batched_tokens)
        if num_blocks < min_blocks:
            held = f"a window of {window} and two steps of {cfg.max_num_batched_tokens} tokens" \
                if min_blocks < -(-max_model_len // cfg.block_size) else \
                f"one max_model_len={max_model_len} sequence"
            raise ValueError(f"num_kv_blocks: {num_blocks} blocks of {cfg.block_size} tokens "
                             f"cannot hold {held} ({min_blocks} needed)")
        return dataclasses.replace(one_block, num_blocks=num_blocks)

    def _num_kv_blocks(self, cfg: EngineConfig, mcfg: Any, per_block: int, itemsize: int,
                       max_model_len: int) -> int:
        import torch

        if cfg.num_kv_blocks is not None:
            return cfg.num_kv_blocks
        if cfg.kv_cache_memory is not None:
            return cfg.kv_cache_memory // per_block
        want = cfg.max_num_seqs * -(-max_model_len // cfg.block_size)  # every seq at full length
        if self.device == "cpu":
            return max(1, min(want, int(CPU_KV_BUDGET * cfg.kv_share) // per_block))
        free, _ = torch.cuda.mem_get_info()
        free = max(0, free - cfg.kv_reserve_bytes)
        # Leave room for one step's activations: per batched token a few hidden-size buffers,
        # the fused qkv and gate/up outputs; per sequence a row of fp32 logits.
        per_token = (6 * mcfg.hidden_size + 3 * mcfg.intermediate_size
                     + (mcfg.num_heads + 2 * mcfg.num_kv_heads) * mcfg.head_dim
                     # (a sparse layer: each of the k experts' rows of h and y)
                     + mcfg.experts_per_token * (mcfg.moe_intermediate_size + mcfg.hidden_size)
                     ) * itemsize
        activations = cfg.max_num_batched_tokens * per_token + cfg.max_num_seqs * mcfg.vocab_size * 4
        # ... and the decode buckets' split-KV partials (fp32 out + lse per head and split),
        # pooled for the process's life: each split class (1, 2, 4, ... S splits) keeps its
        # own, < 2S in all (~0.5 GiB at 64 sequences x 32 heads x 128k context)
        from tinyserve.kernels.attention_decode import default_split_size

        splits = -(-max_model_len // default_split_size())
        activations += cfg.max_num_seqs * mcfg.num_heads * 2 * splits * (mcfg.head_dim + 1) * 4
        budget = int(free * cfg.gpu_memory_utilization * cfg.kv_share_of_free) - 2 * activations
        return max(1, min(want, budget // per_block))

    def _log_loaded(self, kv_spec: Any, seconds: float) -> None:
        info = self.info
        if info.quantization:
            log.info("%s weights: %.2f MiB -> %.2f MiB (%.2fx smaller than %s)",
                     info.quantization, info.weight_bytes_unquantized / 2**20,
                     info.weight_bytes / 2**20,
                     info.weight_bytes_unquantized / info.weight_bytes, info.dtype)
        log.info("loaded %s (%s, %s%s) in %.1fs; KV cache (%s, %d B/token): %d blocks x %d "
                 "tokens = %d tokens, %.1f MiB", info.model_path, self.device, info.dtype,
                 f", {info.quantization}" if info.quantization else "", seconds,
                 "int8 + fp16 scales" if kv_spec.quantized else info.dtype, kv_spec.bytes_per_token,
                 kv_spec.num_blocks, kv_spec.block_size, kv_spec.num_blocks * kv_spec.block_size,
                 kv_spec.total_bytes / 2**20)


def _checkpoint(cfg: EngineConfig) -> Path:
    """The model directory or GGUF file to load (the demo's made, SmolLM2 fetched, once)."""
    if cfg.random_demo:
        from tinyserve.engine.loading.demo import ensure_demo_model

        return ensure_demo_model()
    model_dir = Path(cfg.resolved_model)
    if cfg.model == SMOLLM2 and not model_dir.exists():  # fetched on first use
        from tinyserve.models.smollm2 import ensure_smollm2

        return ensure_smollm2()
    return model_dir


def _resolve_dtype(name: str, device: str, checkpoint_dtype: str | None):
    import torch

    if name == "auto":
        if device == "cpu":
            return torch.float32
        return torch.float16 if checkpoint_dtype == "float16" else torch.bfloat16
    dtype = getattr(torch, name)
    if device == "cpu" and dtype == torch.bfloat16:
        raise ValueError("dtype bfloat16 is not supported on the CPU: Triton's interpreter computes "
                         "bf16 on raw bits (silently wrong results); use float32 or float16")
    return dtype


def _weights(cfg: EngineConfig, model_dir: Path, mcfg: Any, dtype: Any, device: str) -> Any:
    if is_gguf(model_dir):
        from tinyserve.engine.loading.gguf_weights import load_gguf_weights
        from tinyserve.formats.gguf import GGUFFile

        return load_gguf_weights(GGUFFile(model_dir), mcfg, dtype, device, cfg.quantization,
                                 cfg.dequantize)
    if cfg.dequantize:
        raise ValueError("dequantize applies to GGUF files only (a float checkpoint is served "
                         "as it is stored unless quantization is given)")
    from tinyserve.engine.loading.checkpoint import load_weights

    return load_weights(model_dir, mcfg, dtype, device, cfg.quantization)


def _tokenizer(model_dir: Path, mcfg: Any) -> Any:
    from tinyserve.text.tokenizer import Tokenizer

    tokenizer = Tokenizer(model_dir)
    tokenizer.add_eos_ids(mcfg.eos_token_ids)
    return tokenizer


def _adapters(cfg: EngineConfig, mcfg: Any, dtype: Any, device: str) -> tuple | None:
    """(device slots, host cache, the dimensions an adapter must fit), or None."""
    if not cfg.max_loras:
        return None
    from tinyserve.engine.model.lora import HostAdapters, LoraStacks

    # (a mixture of experts: adapters on attention and on dense feed-forwards; the sparse
    # layers' slots for gate / up / down stay empty, an adapter for them is refused)
    dims = ModelDims(mcfg.num_layers, mcfg.hidden_size, mcfg.num_heads * mcfg.head_dim,
                     mcfg.num_kv_heads * mcfg.head_dim, mcfg.intermediate_size,
                     frozenset(i for i in range(mcfg.num_layers) if mcfg.is_sparse(i)))
    stacks = LoraStacks(dims, cfg.max_loras, cfg.max_lora_rank, dtype, device)
    host = HostAdapters(dims, cfg.max_lora_rank, dtype, device, cfg.max_cpu_loras or cfg.max_loras)
    log.info("LoRA: %d slots of rank %d, %.1f MiB", cfg.max_loras, cfg.max_lora_rank,
             stacks.nbytes / 2**20)
    return stacks, host, dims


def _draft(cfg: EngineConfig, mcfg: Any, tokenizer: Any, dtype: Any, device: str
           ) -> tuple | None:
    """(the draft's model, its one-block KV spec) for a draft_model speculation, or None."""
    sp = cfg.speculative
    if sp is None or sp.method != "draft_model":
        return None
    from tinyserve.engine.running.draft import load_draft

    return load_draft(sp.model, sp.quantization, mcfg.vocab_size, tokenizer, dtype, device,
                      cfg.block_size, cfg.kv_cache_dtype == "int8",
                      cfg.max_model_len or mcfg.max_position_embeddings)


def _runner(cfg: EngineConfig, mcfg: Any, weights: Any, kv_spec: Any, max_model_len: int,
            lora: tuple | None, draft: tuple | None, device: str) -> Any:
    from tinyserve.engine.model.decoder import DecoderModel
    from tinyserve.engine.model.rope import rope_tables
    from tinyserve.engine.running.runner import ModelRunner

    model = DecoderModel(mcfg, weights, rope_tables(mcfg, max_model_len, device),
                         lora=None if lora is None else lora[0], count_experts=True)
    runner = ModelRunner(model, mcfg, kv_spec, device, max_num_seqs=cfg.max_num_seqs,
                         max_model_len=max_model_len, enforce_eager=cfg.enforce_eager,
                         host_adapters=None if lora is None else lora[1])
    if draft is not None:
        from tinyserve.engine.model.kv_cache import allocate_kv_cache
        from tinyserve.engine.running.draft import DraftProposer

        draft_kv = allocate_kv_cache(dataclasses.replace(draft[1], num_blocks=kv_spec.num_blocks),
                                     device)
        runner.draft = DraftProposer(draft[0], draft_kv, runner.device)
    return runner


def _grammar_compiler(tokenizer, vocab_size: int, cfg: EngineConfig):
    """Structured output for this model (its token trie: O(vocab), 0.7 s at 128K tokens); None
    when the tokenizer has no EOS to end a grammar with (guided requests are then refused)."""
    from tinyserve.text.grammar import GrammarCompiler

    try:
        return GrammarCompiler(tokenizer, vocab_size, tokenizer.eos_token_ids,
                               cache_bytes=cfg.grammar_cache_bytes,
                               scope_cache_bytes=cfg.grammar_tenant_cache_bytes,
                               max_grammar_bytes=cfg.grammar_max_bytes)
    except ValueError as e:
        log.warning("structured output disabled: %s", e)
        return None
