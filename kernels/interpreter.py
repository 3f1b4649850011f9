"""A speed-up for Triton's CPU interpreter: patch ``triton.language`` once per process.

Before each launch, and again at every nested device-function call (``tl.sum``, ``tl.max``,
``tl.zeros``, our own helpers), the interpreter re-binds every builtin of ``triton.language``
to its NumPy semantics (``inspect.getmembers`` over several modules, ~360 setattrs) and, for a
launch, undoes it afterwards. NOTE: measured here (Triton 3.9, 2 cores) a nested call cost
~0.95 ms against ~0.07 ms for an elementwise op, and a trivial launch ~1.5 ms: the patching was
most of a decode step on the tiny model.

When every kernel in the process is interpreted (TRITON_INTERPRET=1 was set before any was
defined), the bindings can simply stay in place: we apply them once, for both language modules
(ours import ``tl``, Triton's standard library imports ``core``), and make later patch/undo
calls no-ops. The same patch functions run, so semantics do not change. If Triton's internals
change shape, ``install`` leaves the interpreter as it is.

``install`` also makes the interpreter's ``tl.dot`` order-stable: a row's result depends only on
that row and the other operand, never on its position in the tile or on how many rows share the
tile. Triton computes ``tl.dot`` as one ``np.matmul``, i.e. one BLAS gemm, and OpenBLAS picks its
kernels per CPU at run time. Measured (OpenBLAS 0.3.31 via numpy 2.4, forced with
OPENBLAS_CORETYPE): the Haswell/Zen gemm (AVX2 machines, AMD EPYC) rounds a row 1 ulp
differently depending on where it sits in the tile, at every tile shape we use; Prescott does so
when M is not a multiple of its unroll, Sandybridge when N == 1; numpy also switches a 1-row
tile to gemv. So our kernels' batch invariance (fixed tiles, fixed reduction order) held bit
for bit on one machine and not on the next. We hand Triton's own ``create_dot`` the operands as
a stack of one-row products, ``(M, 1, K) @ (K, N)``: numpy then runs the same 1-row BLAS call
(gemv; sdot when N == 1; its own loop for non-BLAS dtypes) once per row, with the same
arguments but the row's data. Dtype handling (fp8 -> fp16, the accumulator's dtype, the
``+ d`` add) stays Triton's. Integer dots (int8 x int8 -> int32) are exact on any path and are
left alone. Measured (2 cores): a dot alone costs 2-3x more (8-360 us instead of 3-110 us at
our tile shapes), but decode/prefill steps and the kernel tests are as fast as before: the
interpreter's per-op overhead dominates.

Two more fixes, each probed first and left out where this Triton is already right: a scalar
argument as a loop bound (Triton 3.6 with numpy >= 2.4 refused it: ``_install_scalar_index``),
and fp32 -> bf16 casts that round to nearest even, as a GPU's do, instead of truncating
(``_install_bf16_rounding``). tests/kernels/test_interpreter_compat.py checks both.
"""

from __future__ import annotations

import inspect
import logging
import operator
import types
import warnings

import numpy as np

log = logging.getLogger(__name__)

_installed = False


def install() -> bool:
    """Make the interpreter's language patching a one-time cost. Idempotent."""
    global _installed
    if _installed:
        return True
    try:
        import triton.language as tl
        import triton.runtime.interpreter as interp

        original_patch_lang = interp._patch_lang
        no_op_scope = interp._LangPatchScope
        no_op_scope().restore()  # fail here, not mid-launch, if the API moved
    except (ImportError, AttributeError, TypeError) as e:  # pragma: no cover - Triton version
        log.warning("Triton interpreter fast path unavailable: %s", e)
        return False

    original_patch_lang(types.SimpleNamespace(__globals__={"tl": tl, "core": tl.core}))
    interp._patch_lang = lambda fn: no_op_scope()
    _install_row_stable_dot(interp)
    _install_scalar_index(interp, tl)
    _install_bf16_rounding(interp, tl)
    _installed = True
    return True


def _install_scalar_index(interp, tl) -> bool:
    """Make a scalar argument usable as an index (``range(0, V, BLOCK)``, V a runtime int).

    NOTE: the interpreter holds a scalar as a one-element array, shape (1,). Triton 3.6 binds
    ``tensor.__index__`` to ``int(data)``, which numpy 2.4 refuses ("only 0-dimensional arrays
    can be converted to Python scalars"; numpy 1.25-2.3 only warn): measured, 303 of 497 kernel
    tests failed under Triton 3.6 + numpy 2.4.6. Triton 3.9 squeezes first. We probe the bound
    ``__index__`` once and, only where it refuses or warns, bind one that reshapes to 0-d: on
    Triton 3.9 nothing changes. It lasts because ``install`` makes the patching one-time (each
    launch would bind Triton's again).
    """
    try:
        probe = tl.core.tensor(interp.TensorHandle(np.array([3], dtype=np.int32), tl.int32), tl.int32)
    except (AttributeError, TypeError) as e:  # pragma: no cover - Triton version
        log.warning("Triton interpreter scalar index check unavailable: %s", e)
        return False
    try:
        with warnings.catch_warnings():  # numpy 1.25-2.3: a DeprecationWarning on each call
            warnings.simplefilter("error", DeprecationWarning)
            if operator.index(probe) == 3:
                return True
    except (TypeError, DeprecationWarning):
        pass
    tl.core.tensor.__index__ = lambda self: int(self.handle.data.reshape(()))
    return operator.index(probe) == 3


def _install_bf16_rounding(interp, tl) -> bool:
    """fp32 -> bf16 casts (``.to(tl.bfloat16)``, a store into bf16) round to nearest even, as a
    GPU's ``cvt.rn.bf16.f32`` does, instead of truncating.

    NOTE: Triton 3.6 and 3.9's interpreter drop the low 16 bits (measured: 44% of the bf16
    products in the embedding-scale test came out one step toward zero), so a bf16 result was
    up to a whole step off the GPU's. The probe keeps Triton's cast where it already rounds.
    Only this cast changes; bf16 arithmetic, bf16 ``tl.dot`` and int -> bf16 casts stay wrong in
    the interpreter (triton-lang/triton#11584): use fp32 there.
    """
    try:
        builder_cls = interp.InterpreterBuilder
        original = builder_cls.create_fp_trunc
        handle_cls = interp.TensorHandle
        probe = handle_cls(np.array([1.0 + 2.0**-8 + 2.0**-10], dtype=np.float32), tl.float32)
        rounds = original(interp.interpreter_builder, probe, tl.bfloat16).data.view(np.uint16)[0]
    except (AttributeError, TypeError, ValueError) as e:  # pragma: no cover - Triton version
        log.warning("Triton interpreter bf16 rounding unavailable: %s", e)
        return False
    if rounds == 0x3F81:  # 1 + 2^-7: this Triton (or an earlier install) already rounds
        return True

    def create_fp_trunc(self, src, dst_type):
        if src.dtype.scalar != tl.float32 or dst_type.scalar != tl.bfloat16:
            return original(self, src, dst_type)
        bits = np.asarray(src.data, dtype=np.float32).view(np.uint32)
        # + 0x7FFF and the kept part's lowest bit: ties go to even; a carry moves the exponent
        # (the largest finite values round to inf, as on the GPU); NaN stays a quiet NaN
        out = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
        out = np.where(np.isnan(src.data), ((bits >> 16) | 0x0040).astype(np.uint16), out)
        return handle_cls(out, dst_type.scalar)

    builder_cls.create_fp_trunc = create_fp_trunc
    return True


_DOT_PARAMS = ["self", "a", "b", "d", "input_precision", "max_num_imprecise_acc"]


def _install_row_stable_dot(interp) -> bool:
    """Route the interpreter's ``tl.dot`` through one identical 1-row product per output row.

    NOTE: a gemm's rounding of a row may depend on the row's position in the tile (OpenBLAS
    Haswell/Zen kernels do this), which broke bitwise batch invariance on some machines only.
    See the module docstring. No-op (with a warning) if Triton's ``create_dot`` changed shape.
    """
    try:
        builder_cls = interp.InterpreterBuilder
        handle_cls = interp.TensorHandle
        original = builder_cls.create_dot
        params = list(inspect.signature(original).parameters)
    except (AttributeError, TypeError, ValueError) as e:  # pragma: no cover - Triton version
        log.warning("Triton interpreter row-stable dot unavailable: %s", e)
        return False
    if getattr(original, "_row_stable", False):
        return True
    if params != _DOT_PARAMS:  # pragma: no cover - Triton version
        log.warning("Triton interpreter row-stable dot unavailable: create_dot%s", params)
        return False

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if not np.issubdtype(d.data.dtype, np.floating) or a.data.ndim < 2:
            return original(self, a, b, d, input_precision, max_num_imprecise_acc)
        # (..., M, K) @ (..., K, N) as (..., M, 1, K) @ (..., 1, K, N): numpy loops over the rows
        # and hands each the same 1-row BLAS call. The row is made contiguous first, so the
        # call numpy picks (BLAS or its own loop) cannot depend on the tile's strides (a
        # transposed tile's row is contiguous only when M == 1).
        rows = np.ascontiguousarray(a.data)[..., :, None, :]
        out = original(self, handle_cls(rows, a.dtype), handle_cls(b.data[..., None, :, :], b.dtype),
                       handle_cls(d.data[..., :, None, :], d.dtype), input_precision,
                       max_num_imprecise_acc)
        return handle_cls(out.data.reshape(d.data.shape), out.dtype)

    create_dot._row_stable = True
    builder_cls.create_dot = create_dot
    return True
