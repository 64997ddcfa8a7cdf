"""Everything the PyTorch face reads from Horovod's private internals, in one place.

Written against Horovod 0.28.1 (``WRITTEN_FOR``). Why it is needed at all: Horovod calls
``compress(tensor)`` with the tensor alone (docs/architecture.md#compressor-contract), and no
public attribute or hook tells a compressor which reduction the calling optimizer will apply.
``hvd.DistributedOptimizer`` builds a class at run time from one of two private classes and
keeps the reduction in the instance attribute ``op``. A sparsifier must refuse Adasum and every
op other than Average, so the op is read from the caller's frame.

What this relies on, checked on the installed Horovod by tests/unit/test_horovod_internals.py
(the code) and tests/multiproc/test_horovod_refusals.py (the op read in real jobs, for every way
Horovod calls a compressor, and the refusals), so that a Horovod upgrade that changes any of it
fails a test instead of silently switching a refusal off:

* ``_DistributedOptimizer._allreduce_grad_async`` (per tensor) calls
  ``self._compression.compress`` directly, and ``_grouped_allreduce_grad_async`` (``groups=``)
  from a list comprehension, so the optimizer's frame is at most three frames above ``compress``;
  ``self`` there is the optimizer, whose ``_compression`` is the compressor and ``op`` the
  reduction.
* With ``op=hvd.Adasum`` on more than one rank the optimizer is built from
  ``_DistributedAdasumOptimizer``, whose ``_allreduce_grad_async`` compresses parameter deltas and
  always reduces with Adasum; it has no ``op`` attribute, so its code object identifies it
  (``DistributedOptimizer`` copies the class dict, so the function and its code are shared).
* The same frame's ``self`` is the optimizer the user wrapped (Horovod's class derives from its
  class and keeps its ``param_groups``): the face reads its momentum from there
  (``calling_optimizer``) to warn when it would apply momentum twice.
"""

from __future__ import annotations

import sys
from typing import Any

import horovod.torch as hvd
from horovod.torch.optimizer import _DistributedAdasumOptimizer, _DistributedOptimizer

WRITTEN_FOR = "0.28.1"

# The functions of Horovod's optimizers that call ``compress``.
ADASUM_COMPRESS_CALLER = _DistributedAdasumOptimizer._allreduce_grad_async.__code__
OPTIMIZER_COMPRESS_CALLERS = (_DistributedOptimizer._allreduce_grad_async.__code__,
                              _DistributedOptimizer._grouped_allreduce_grad_async.__code__)
# compress <- [list comprehension <-] _(grouped_)allreduce_grad_async, with a frame to spare.
CALLER_DEPTH = 4


def calling_optimizer(compressor: Any) -> tuple[Any, Any]:
    """(optimizer, op): the Horovod optimizer that called ``compressor.compress`` and its
    reduction op; call it from ``compress`` itself. The optimizer is the instance Horovod built
    (a subclass of the wrapped optimizer's class, with its ``param_groups``). (None, None) when
    ``compress`` was not called by a Horovod optimizer."""
    return _find_optimizer(compressor, sys._getframe(2))   # 0: here, 1: compress, 2: its caller


def calling_optimizer_op(compressor: Any) -> Any:
    """The reduction op of the Horovod optimizer that called ``compressor.compress``; call it from
    ``compress`` itself. None when ``compress`` was not called by a Horovod optimizer."""
    return _find_optimizer(compressor, sys._getframe(2))[1]


def _find_optimizer(compressor: Any, frame: Any) -> tuple[Any, Any]:
    for _ in range(CALLER_DEPTH):
        if frame is None:
            break
        owner = frame.f_locals.get("self")
        if frame.f_code is ADASUM_COMPRESS_CALLER:
            return owner, hvd.Adasum
        if owner is not None and getattr(owner, "_compression", None) is compressor:
            return owner, getattr(owner, "op", None)
        frame = frame.f_back
    return None, None


def horovod_build() -> dict[str, bool]:
    """How Horovod was built for PyTorch (its public build queries; ``python -m hvd_sparse.info``)."""
    return {name: bool(getattr(hvd, f"{name}_built")()) for name in ("mpi", "gloo", "nccl", "cuda", "rocm")}
