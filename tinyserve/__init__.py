"""tinyserve: a small, readable LLM inference server over a pure-Triton Llama engine.

``LLM`` and ``SamplingParams`` are imported lazily so that the server's control plane (and its
tests) never imports torch or triton.
"""

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "RequestOutput", "LoRARequest"]

if TYPE_CHECKING:
    from tinyserve.llm import LLM, LoRARequest, RequestOutput
    from tinyserve.messages import SamplingParams


def __getattr__(name: str) -> Any:
    if name == "SamplingParams":
        from tinyserve.messages import SamplingParams

        return SamplingParams
    if name in ("LLM", "RequestOutput", "LoRARequest"):
        from tinyserve import llm

        return getattr(llm, name)
    raise AttributeError(f"module 'tinyserve' has no attribute {name!r}")
