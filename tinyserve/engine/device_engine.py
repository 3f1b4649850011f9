"""DeviceEngine: a loaded model, its KV cache and its tokenizer, built from an EngineConfig.

The data plane's entry point. It decides the device (and the Triton interpreter) before the
kernels are imported, loads weights, sizes the KV cache, and owns the ModelRunner.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tinyserve.config import EngineConfig
from tinyserve.core.adapters import ModelDims
from tinyserve.core.kv_manager import min_kv_blocks
from tinyserve.engine.device import select_device
from tinyserve.formats.gguf import is_gguf
from tinyserve.models import SMOLLM2

log = logging.getLogger(__name__)

CPU_KV_BUDGET = 2 << 30  # bytes: the interpreter copies KV storages per launch; keep them modest


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """What the control plane needs to know about the loaded engine (plain values)."""

    model_path: str
    device: str
    dtype: str
    quantization: str | None
    kv_cache_dtype: str  # "auto" (the model's dtype) or "int8"
    vocab_size: int
    max_model_len: int
    block_size: int
    num_kv_blocks: int
    kv_cache_bytes: int
    weight_bytes: int
    weight_bytes_unquantized: int
    eos_token_ids: frozenset[int]
    random_weights: bool
    architecture: str = "LlamaForCausalLM"
    kv_window: int | None = None  # every layer's sliding window (blocks behind it are freed)
    max_loras: int = 0  # LoRA adapter slots (0: no adapters)
    max_lora_rank: int = 0
    lora_dims: ModelDims | None = None  # what an adapter must fit (core/adapters.py)
    speculative: Any = None  # the SpeculativeConfig its runner was built for (None: off)


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


class DeviceEngine:
    def __init__(self, cfg: EngineConfig) -> None:
        t0 = time.perf_counter()
        self.device = select_device(cfg.device)
        from tinyserve.engine.kv_cache import KVCacheSpec
        from tinyserve.engine.loader import load_weights
        from tinyserve.engine.model import DecoderModel
        from tinyserve.engine.model_config import load_model_config
        from tinyserve.engine.rope import rope_tables
        from tinyserve.engine.runner import ModelRunner
        from tinyserve.text.tokenizer import Tokenizer

        random_weights = cfg.random_demo
        if random_weights:
            from tinyserve.engine.demo import ensure_demo_model

            model_dir = ensure_demo_model()
        else:
            model_dir = Path(cfg.resolved_model)
            if cfg.model == SMOLLM2 and not model_dir.exists():  # fetched on first use
                from tinyserve.models.smollm2 import ensure_smollm2

                model_dir = ensure_smollm2()
        mcfg = load_model_config(model_dir)
        dtype = _resolve_dtype(cfg.dtype, self.device, mcfg.torch_dtype)
        if is_gguf(model_dir):
            from tinyserve.engine.gguf_weights import load_gguf_weights
            from tinyserve.formats.gguf import GGUFFile

            weights = load_gguf_weights(GGUFFile(model_dir), mcfg, dtype, self.device,
                                        cfg.quantization, cfg.dequantize)
        else:
            if cfg.dequantize:
                raise ValueError("dequantize applies to GGUF files only (a float checkpoint "
                                 "is served as it is stored unless quantization is given)")
            weights = load_weights(model_dir, mcfg, dtype, self.device, cfg.quantization)
        self.tokenizer = Tokenizer(model_dir)
        self.tokenizer.add_eos_ids(mcfg.eos_token_ids)

        max_model_len = cfg.max_model_len or mcfg.max_position_embeddings
        if max_model_len > mcfg.max_position_embeddings:
            log.warning("max_model_len %d exceeds the model's max_position_embeddings %d",
                        max_model_len, mcfg.max_position_embeddings)
        kv_int8 = cfg.kv_cache_dtype == "int8"
        lora, dims = None, None
        if cfg.max_loras:  # (before the KV cache: sized from what memory it leaves)
            from tinyserve.engine.lora import HostAdapters, LoraStacks

            dims = ModelDims(mcfg.num_layers, mcfg.hidden_size, mcfg.num_heads * mcfg.head_dim,
                             mcfg.num_kv_heads * mcfg.head_dim, mcfg.intermediate_size)
            lora = (LoraStacks(dims, cfg.max_loras, cfg.max_lora_rank, dtype, self.device),
                    HostAdapters(dims, cfg.max_lora_rank, dtype, self.device,
                                 cfg.max_cpu_loras or cfg.max_loras))
            log.info("LoRA: %d slots of rank %d, %.1f MiB", cfg.max_loras, cfg.max_lora_rank,
                     lora[0].nbytes / 2**20)
        one_block = KVCacheSpec(1, cfg.block_size, mcfg.num_layers, mcfg.num_kv_heads,
                                mcfg.head_dim, dtype, kv_int8)
        draft = None  # speculation's draft model: its KV is paged by the target's blocks
        sp = cfg.speculative
        if sp is not None and sp.method == "draft_model":
            from tinyserve.engine.draft import load_draft

            draft = load_draft(sp.model, sp.quantization, mcfg.vocab_size, self.tokenizer,
                               dtype, self.device, cfg.block_size, kv_int8,
                               cfg.max_model_len or mcfg.max_position_embeddings)
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
            raise ValueError(f"num_kv_blocks: {num_blocks} blocks of {cfg.block_size} tokens cannot "
                             f"hold {held} ({min_blocks} needed)")
        spec = dataclasses.replace(one_block, num_blocks=num_blocks)

        self.model_config = mcfg
        model = DecoderModel(mcfg, weights, rope_tables(mcfg, max_model_len, self.device),
                             lora=None if lora is None else lora[0])
        self.runner = ModelRunner(model, mcfg, spec, self.device,
                                  max_num_seqs=cfg.max_num_seqs, max_model_len=max_model_len,
                                  enforce_eager=cfg.enforce_eager,
                                  host_adapters=None if lora is None else lora[1])
        if draft is not None:
            from tinyserve.engine.draft import DraftProposer
            from tinyserve.engine.kv_cache import allocate_kv_cache

            draft_kv = allocate_kv_cache(dataclasses.replace(draft[1], num_blocks=num_blocks),
                                         self.device)
            self.runner.draft = DraftProposer(draft[0], draft_kv, self.runner.device)
        self.info = EngineInfo(
            model_path=str(model_dir), device=self.device, dtype=str(dtype).removeprefix("torch."),
            quantization=weights.quantization, kv_cache_dtype=cfg.kv_cache_dtype,
            vocab_size=mcfg.vocab_size, max_model_len=max_model_len,
            block_size=cfg.block_size, num_kv_blocks=num_blocks, kv_cache_bytes=spec.total_bytes,
            weight_bytes=weights.nbytes(), weight_bytes_unquantized=weights.nbytes(dtype),
            eos_token_ids=self.tokenizer.eos_token_ids, random_weights=random_weights,
            architecture=mcfg.architecture,
            kv_window=mcfg.sliding_window if mcfg.every_layer_windowed else None,
            max_loras=cfg.max_loras, max_lora_rank=cfg.max_lora_rank if cfg.max_loras else 0,
            speculative=cfg.speculative,
            lora_dims=dims)
        self.grammars = _grammar_compiler(self.tokenizer, mcfg.vocab_size, cfg)
        self.runner.logits.grammars = self.grammars
        if weights.quantization:
            log.info("%s weights: %.2f MiB -> %.2f MiB (%.2fx smaller than %s)",
                     weights.quantization, self.info.weight_bytes_unquantized / 2**20,
                     self.info.weight_bytes / 2**20,
                     self.info.weight_bytes_unquantized / self.info.weight_bytes, self.info.dtype)
        log.info("loaded %s (%s, %s%s) in %.1fs; KV cache (%s, %d B/token): %d blocks x %d tokens "
                 "= %d tokens, %.1f MiB", model_dir, self.device, self.info.dtype,
                 f", {weights.quantization}" if weights.quantization else "", time.perf_counter() - t0,
                 "int8 + fp16 scales" if kv_int8 else self.info.dtype, spec.bytes_per_token,
                 num_blocks, cfg.block_size, num_blocks * cfg.block_size, spec.total_bytes / 2**20)

    def warm_up(self) -> dict:
        """Every kernel specialization serving needs, compiled (decode buckets recorded, and
        captured as CUDA graphs on a GPU) before the first request: see ``warmup.py``."""
        from tinyserve.engine.warmup import warm_up

        return warm_up(self.runner)

    def _num_kv_blocks(self, cfg: EngineConfig, mcfg, per_block: int, itemsize: int,
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
                     + (mcfg.num_heads + 2 * mcfg.num_kv_heads) * mcfg.head_dim) * itemsize
        activations = cfg.max_num_batched_tokens * per_token + cfg.max_num_seqs * mcfg.vocab_size * 4
        # ... and the decode buckets' split-KV partials (fp32 out + lse per head and split),
        # pooled for the process's life: each split class (1, 2, 4, ... S splits) keeps its
        # own, < 2S in all (~0.5 GiB at 64 sequences x 32 heads x 128k context)
        from tinyserve.kernels.attention_decode import default_split_size

        splits = -(-max_model_len // default_split_size())
        activations += cfg.max_num_seqs * mcfg.num_heads * 2 * splits * (mcfg.head_dim + 1) * 4
        budget = int(free * cfg.gpu_memory_utilization * cfg.kv_share_of_free) - 2 * activations
        return max(1, min(want, budget // per_block))


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
