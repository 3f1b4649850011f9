"""Triton kernels for the Llama forward pass, installed as ``tinyserve.kernels``.

Set ``TRITON_INTERPRET=1`` before importing this package to run the kernels on the CPU through
Triton's interpreter (``tinyserve.engine.device.select_device`` does it for you). Launchers
choose block sizes from ``utils.INTERPRET``; the kernel source is the same on GPU and CPU.
"""

from tinyserve.kernels import interpreter as _interpreter
from tinyserve.kernels.utils import INTERPRET

if INTERPRET:
    _interpreter.install()

from tinyserve.kernels.activation import silu_and_mul  # noqa: E402
from tinyserve.kernels.attention_decode import token_attention_paged  # noqa: E402
from tinyserve.kernels.attention_prefill import context_attention_paged  # noqa: E402
from tinyserve.kernels.embedding import gather_rows  # noqa: E402
from tinyserve.kernels.group_matmul import int4_matmul, int8_group_matmul  # noqa: E402
from tinyserve.kernels.int4_pack import quantize_int4  # noqa: E402
from tinyserve.kernels.kv_cache import update_block_table, write_kv_cache  # noqa: E402
from tinyserve.kernels.matmul import int8_matmul, matmul  # noqa: E402
from tinyserve.kernels.moe import (  # noqa: E402
    Int4Experts,
    fused_moe,
    moe_combine,
    moe_down,
    moe_gate_up,
)
from tinyserve.kernels.moe_routing import moe_align, moe_route  # noqa: E402
from tinyserve.kernels.penalties import apply_penalties  # noqa: E402
from tinyserve.kernels.rmsnorm import add_rmsnorm  # noqa: E402
from tinyserve.kernels.rotary import apply_rotary, rotary_and_write_kv  # noqa: E402
from tinyserve.kernels.sampling import sample, target_logprobs  # noqa: E402

__all__ = [
    "add_rmsnorm",
    "apply_penalties",
    "apply_rotary",
    "context_attention_paged",
    "fused_moe",
    "Int4Experts",
    "gather_rows",
    "int4_matmul",
    "int8_group_matmul",
    "int8_matmul",
    "matmul",
    "moe_align",
    "moe_combine",
    "moe_down",
    "moe_gate_up",
    "moe_route",
    "quantize_int4",
    "rotary_and_write_kv",
    "sample",
    "target_logprobs",
    "silu_and_mul",
    "token_attention_paged",
    "update_block_table",
    "write_kv_cache",
]
