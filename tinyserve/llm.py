"""Offline API: ``LLM(model).generate(prompts, SamplingParams(...))``.

Many prompts run as one continuously batched workload over the paged cache, through the same
EngineCore step the server drives.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence as Seq
from dataclasses import dataclass

from tinyserve.config import EngineConfig
from tinyserve.core.adapters import AdapterRegistry, AdapterSpec
from tinyserve.core.engine_core import CoreConfig, EngineCore
from tinyserve.core.request import Request
from tinyserve.engine.device_engine import DeviceEngine
from tinyserve.messages import SamplingParams

log = logging.getLogger(__name__)

Prompt = str | Seq[int]


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """vLLM's: the adapter a prompt runs with (a PEFT directory), by name; the id is vLLM's
    and unused here (a name is loaded once)."""

    lora_name: str
    lora_int_id: int
    lora_path: str


@dataclass(frozen=True, slots=True)
class RequestOutput:
    prompt_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]  # generated tokens
    text: str  # generated text, cut at a matched stop string
    finish_reason: str  # "stop" | "length"
    logprobs: list[dict[int, float]] | None  # per token: top-N alternatives and the chosen one
    num_cached_tokens: int  # prompt tokens served by the prefix cache
    # vLLM's: None for the first prompt token, then {token: logprob} with the prompt's token
    # and the top N (SamplingParams.prompt_logprobs = N); None unless asked for
    prompt_logprobs: list[dict[int, float] | None] | None = None


class LLM:
    def __init__(self, model: str | None = None, *, dtype: str = "auto",
                 quantization: str | None = None, block_size: int = 16,
                 num_kv_blocks: int | None = None, **engine_kwargs) -> None:
        self.config = EngineConfig(model=model, dtype=dtype, quantization=quantization,
                                   block_size=block_size, num_kv_blocks=num_kv_blocks,
                                   **engine_kwargs)
        self.engine = DeviceEngine(self.config)
        # As the server does before its first request: every kernel specialization compiled
        # and, on a GPU, every decode bucket captured as a CUDA graph here, not in the middle
        # of generate (nothing to do under the interpreter).
        self.warm_up_info = self.engine.warm_up()
        self.tokenizer = self.engine.tokenizer
        self.info = self.engine.info
        self.core = EngineCore(CoreConfig.from_engine(self.config, self.info), self.tokenizer)
        self._ids = itertools.count()
        self.adapters = None if not self.info.max_loras else AdapterRegistry(
            "", self.info.lora_dims, self.info.max_lora_rank, reader=self.engine.read_adapter)

    def generate(self, prompts: Prompt | Seq[Prompt],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 lora_request: LoRARequest | Seq[LoRARequest | None] | None = None,
                 ) -> list[RequestOutput]:
        """``lora_request``: one adapter for every prompt, or one (or None: the base model)
        per prompt; an adapter is loaded on first use (the engine needs max_loras > 0)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")
        loras = lora_request if isinstance(lora_request, (list, tuple)) else \
            [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError(f"got {len(loras)} LoRA requests for {len(prompts)} prompts")
        ids = []
        try:
            for prompt, p, lora in zip(prompts, params, loras, strict=True):
                tokens = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
                ids.append(self.core.add_request(next(self._ids), tokens, p,
                                                 adapter=self._adapter(lora)).request_id)
            while self.core.has_unfinished:
                plan = self.core.schedule()
                if plan is None:
                    raise RuntimeError("scheduler made no progress with work pending")
                self.core.process(plan, self.engine.runner.execute(plan))
            return [self._output(self.core.release(i)) for i in ids]
        finally:
            for i in ids:
                self.core.release(i)  # after an error: free whatever is left

    def _adapter(self, lora: LoRARequest | None) -> AdapterSpec | None:
        if lora is None:
            return None
        if self.adapters is None:
            raise ValueError("LoRA adapters need an engine with max_loras > 0")
        return self.adapters.get(lora.lora_name) or self.adapters.load(lora.lora_name,
                                                                       lora.lora_path)

    def _output(self, req: Request) -> RequestOutput:
        seq = req.seq
        logprobs = None
        if seq.params.logprobs is not None:
            logprobs = []
            for token, (lp, top) in zip(seq.output_token_ids, seq.logprobs, strict=True):
                entry = dict(top or ())
                entry[token] = lp
                logprobs.append(entry)
        prompt_logprobs = None
        if seq.params.prompt_logprobs is not None:
            infos, _ = seq.prompt_logprobs()
            prompt_logprobs = [None] + [{**dict(t.top), t.token_id: t.logprob} for t in infos[1:]]
        return RequestOutput(seq.prompt_token_ids, tuple(seq.output_token_ids), req.detok.text,
                             seq.finish_reason or "abort", logprobs, seq.num_cached_tokens,
                             prompt_logprobs)

