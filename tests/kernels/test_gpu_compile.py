"""Every kernel, with the launch configuration a GPU would get, compiles for sm_90 (H100/H200).

No GPU needed: Triton's whole pipeline down to the cubin (ptxas) runs on the CPU. This catches
what the interpreter never checks (tl.dot minimum sizes, bf16 codegen, shared-memory limits,
type errors in the GPU-only branches). It runs in a subprocess because this test process has
TRITON_INTERPRET=1 set for the other tests. The script drives Triton-private internals: a
Triton without them makes it exit with UNSUPPORTED, and these tests skip with its line (which
names the version and what is missing). Both pass under Triton 3.6 and 3.9.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("gpu_compile_check.py")
UNSUPPORTED = 3  # gpu_compile_check.UNSUPPORTED (not imported: importing it patches Triton)


def run_check(*flags: str) -> subprocess.CompletedProcess:
    """The script without the interpreter, in the repo root; a skip if this Triton lacks what
    it needs (its own line says which version and what)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    out = subprocess.run([sys.executable, str(SCRIPT), *flags], env=env, capture_output=True,
                         text=True, timeout=600, cwd=Path(__file__).parents[2])
    if out.returncode == UNSUPPORTED and out.stdout.startswith("UNSUPPORTED"):
        pytest.skip(out.stdout.strip())
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    return out


def test_all_kernels_compile_for_hopper():
    import triton

    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not ptxas.exists():
        pytest.skip(f"Triton {triton.__version__} at {ptxas.parents[3]} ships no ptxas "
                    "(the sm_90 check needs the NVIDIA backend's ptxas and cuobjdump)")
    out = run_check("--resources")
    assert "kernel variants compiled for sm_90" in out.stdout
    assert "_sample_kernel" in out.stdout and "_merge_splits_kernel" in out.stdout
    # No spills in what serves: fp16 / bf16, Llama-3-8B's and each family's real shapes
    # (head_dim 256, soft-caps, windows, q/k norm, partial rotary). fp32 on a GPU is for
    # debugging: some of its tiles spill (docs/limits.md).
    lines = [x for x in out.stdout.splitlines() if x.startswith("ok ")]
    assert sum(" families " in x for x in lines) >= 30, "the family shapes were compiled"
    moe = [x for x in lines if " moe " in x]  # MoE shapes: each stage, int8 experts, sinks
    for kernel in ("_moe_route_kernel", "_moe_count_kernel", "_moe_offsets_kernel",
                   "_moe_place_kernel", "_moe_gemm_kernel", "_moe_combine_kernel",
                   "_token_attention_paged_kernel", "_context_attention_paged_kernel",
                   "_merge_splits_kernel"):
        assert any(kernel in x for x in moe), kernel
    for quant in ("'W_QUANT': 1", "'W_QUANT': 2", "'SINKS': True"):  # int8, int4 experts
        assert any(quant in x for x in moe), quant
    spills = [x for x in lines if "torch.float32" not in x and "STACK:0 " not in x]
    assert not spills, "\n".join(spills)


def test_the_warm_up_launches_every_specialization_serving_needs():
    """With the GPU's launch configurations (launches recorded, not run), the runner's warm-up
    is compared with decode, prefill and mixed steps of every size, context and sampling
    variant: every key Triton's JIT would compile for serving must have been launched by the
    warm-up (else a compile stalls a step while serving)."""
    out = run_check("--warm-up")
    # buckets, enforce-eager, buckets over an int8 KV cache, and with every family switch
    assert out.stdout.count(", 0 of them not warmed up") == 4
    assert "with every family switch" in out.stdout
    assert "(0 split-K sums)" not in out.stdout  # the GPU's split-K path was in it
