"""What the control plane knows of an engine, and nothing more: ``EngineInfo`` (plain values
read once it is loaded) and the ``Engine`` / ``Runner`` protocols that the device side's
DeviceEngine and ModelRunner implement, and that the tests' fakes implement too. The server,
the executor and the engine core are typed against these; none of them imports the device
side (engine/) or torch.

    Engine    info, tokenizer, grammars, runner, warm_up()
    Runner    launch(plan) -> a launched step (or its StepResult, when already done),
              finish(launched) -> StepResult
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from tinyserve.config import SpeculativeConfig
from tinyserve.core.adapters import AdapterSpec, ModelDims
from tinyserve.messages import StepPlan, StepResult

if TYPE_CHECKING:
    from tinyserve.text.grammar import GrammarCompiler
    from tinyserve.text.tokenizer import Tokenizer


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """The loaded engine, in plain values."""

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
    speculative: SpeculativeConfig | None = None  # what its runner was built for (None: off)
    num_experts: int = 0  # a mixture of experts' experts per sparse layer (0: dense)


@runtime_checkable
class Launched(Protocol):
    """A step queued on the device: ``ready`` once its tokens are on the host."""

    def ready(self) -> bool: ...


@runtime_checkable
class Runner(Protocol):
    """Runs one model's steps on the executor's worker thread. ``fills_on_device``: it
    takes a plan's PLACEHOLDER tokens from its own previous step (so the executor may launch
    step N+1 before it finishes N); otherwise the executor fills them in on the host."""

    fills_on_device: bool

    def launch(self, plan: StepPlan) -> Launched | StepResult: ...

    def finish(self, launched: Any) -> StepResult: ...


@runtime_checkable
class Engine(Protocol):
    """One loaded model: what the server wires into its actors and the API."""

    info: EngineInfo
    tokenizer: Tokenizer
    runner: Runner
    grammars: GrammarCompiler | None  # structured output (None: the tokenizer has no EOS)

    def warm_up(self) -> dict: ...

    def read_adapter(self, spec: AdapterSpec) -> None:
        """Read and check a LoRA adapter's weights whole (ValueError: refused); only called
        where ``info.max_loras``."""
        ...


class StepFunction:
    """A Runner from a function plan -> StepResult that runs each step whole (the actor
    tests' steps): launch is the whole step, so there is nothing to finish."""

    fills_on_device = False

    def __init__(self, step: Any) -> None:
        self._step = step

    def launch(self, plan: StepPlan) -> StepResult:
        return self._step(plan)

    def finish(self, launched: StepResult) -> StepResult:
        return launched
