"""GPU kernels in Triton: the op module ``ops_for`` returns for CUDA tensors.

A CUDA build of torch ships the Triton it was built with, so nothing is compiled at install time;
each kernel is compiled on first use (seconds, cached by Triton on disk). Importing this module
needs Triton but no GPU; without Triton it raises ``KernelUnavailable`` naming the fix, and the
loader (hvd_sparse.kernels) runs the reference path after one warning. Every op returns None for
arguments it has no kernel for (an integer input, an fp16 residual, a non-contiguous residual,
tensors on different devices); the caller then runs the reference ops.

The ops of the kernel contract (``KernelOps``, hvd_sparse/backends/contract.py: each returns the
named result of the backend op it replaces), with the reference's results bit for bit:

* ``all_finite(tensors)``                                    -- 1 host synchronization
* ``accumulate(residual, tensors, clear_inputs)``            -- 0
* ``accumulate_select(residual, tensors, lo, hi, threshold, probes, every, index_dtype,
  clear_inputs)``                                            -- 1 (the count the allgather needs)
* ``topk_abs(x, k, index_dtype)``                            -- 0 (the output size is k)
* ``mean_std(x)``, ``segment_norms(x, lengths)``               -- 1 (the sums; sums.py)
* ``accumulate_moments(residual, tensors, clear_inputs, check_finite)``,
  ``accumulate_norms(residual, tensors, lengths)``           -- 1 (the finite flag with the sums)
* ``momentum_accumulate(residual, momentum, tensors, factor, nesterov)``  -- 0
* ``momentum_accumulate_select(residual, momentum, tensors, factor, nesterov, lo, hi, threshold,
  probes, every, index_dtype, clear_inputs, check_finite)``  -- 1: accumulate_select (with the
  finite check when asked) with the momentum correction in the same pass
* ``adam_accumulate(residual, momentum, tensors, factor, second)`` -- 0, and
  ``adam_accumulate_select(...)`` -- 1: the same on the Adam path
* ``adam_update(average, first, second, beta1, beta2, first_scale, second_scale, eps)`` -- 0

Host synchronizations. Each one stalls the host until the GPU has drained its queue, so a bucket
takes at most one per step: the count of selected entries, which the allgather needs on the host.
The finite check therefore has variants that keep their answer on the device:

* ``finite_flag(tensors)`` -> int64 [1] device tensor, 0 when every input is finite.
* ``accumulate(..., skip_if=flag)``: the kernels read the flag and write nothing when it is set.
* ``accumulate_if_finite(residual, tensors, clear_inputs)`` -> the flag (finite check, then the
  gated accumulate): for top-k methods, whose ``topk_abs`` needs no synchronization, the caller
  reads the flag with whatever it reads next.
* ``accumulate_select_if_finite(...)`` -> ``(finite, idx, probe_counts)``: the finite check,
  the gated accumulate-and-select, and ONE host copy that reads the finite flag, the probe
  counts and the total together. Not finite: residual and inputs untouched, idx empty.

The engine today calls ``all_finite`` and then ``accumulate_select`` (through the torch backend):
two synchronizations for a threshold method's finite check and count, where
``accumulate_select_if_finite`` takes one.

Tests (tests/unit/kernels/test_triton.py, cases in triton_cases.py beside it): without a GPU every
kernel runs in Triton's interpreter (``TRITON_INTERPRET=1`` before Triton is imported, CPU
tensors) against the reference path, and is compiled for sm_90; on a GPU the same cases run
compiled, and the host synchronizations are counted. scripts/gpu_check.sh runs the GPU checks.
"""

from __future__ import annotations

from hvd_sparse.backends.contract import not_handled

from .. import KernelUnavailable

try:
    import triton  # noqa: F401  (the availability check; the kernels import it themselves)
except ImportError as error:   # pragma: no cover  (CI installs Triton)
    raise KernelUnavailable(
        f"Triton is not installed ({error}); a CUDA build of torch ships it, or "
        "`pip install triton` at the version your torch requires") from error

from .accumulate import (
    accumulate,
    accumulate_if_finite,
    accumulate_select,
    accumulate_select_if_finite,
    adam_accumulate,
    adam_accumulate_select,
    adam_update,
    all_finite,
    finite_flag,
    momentum_accumulate,
    momentum_accumulate_select,
)
from .sums import accumulate_moments, accumulate_norms, mean_std, segment_norms
from .topk import topk_abs

# Ops of the contract without a GPU kernel: the torch ops are already one pass there (or, for
# accumulate_segment_moments, not yet fused: accumulate, then a synchronization per segment).
clear = select_at_least = sampled_threshold_select = zero_at = put_at = not_handled
accumulate_segment_moments = not_handled

__all__ = [
    "accumulate",
    "accumulate_if_finite",
    "accumulate_moments",
    "accumulate_norms",
    "accumulate_segment_moments",
    "accumulate_select",
    "accumulate_select_if_finite",
    "adam_accumulate",
    "adam_accumulate_select",
    "adam_update",
    "all_finite",
    "clear",
    "finite_flag",
    "mean_std",
    "momentum_accumulate",
    "momentum_accumulate_select",
    "put_at",
    "sampled_threshold_select",
    "segment_norms",
    "select_at_least",
    "topk_abs",
    "zero_at",
]
