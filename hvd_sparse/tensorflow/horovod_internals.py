"""Everything the TensorFlow face reads from Horovod's internals, in one place.

Written against Horovod 0.28.1 (``WRITTEN_FOR``). Why it is needed at all: Horovod calls
``compress(tensor)`` with the tensor alone (docs/architecture.md#compressor-contract); nothing
public tells a compressor which reduction the calling allreduce applies, nor whether it runs under
Horovod's Keras optimizer. A sparsifier must refuse Adasum and every op other than Average, and
Horovod's Keras optimizer must be refused on Keras 3 (docs/architecture.md#keras), so both are
read from the callers' frames.

What this relies on, checked on the installed Horovod by tests/unit/test_horovod_internals.py
(the code) and tests/multiproc/test_horovod_refusals.py (the op read in real jobs, for every way
Horovod calls a compressor, and the refusals), so that a Horovod upgrade that changes any of it
fails a test instead of silently switching a refusal off:

* ``horovod.tensorflow.allreduce`` and ``grouped_allreduce`` call ``compression.compress`` with
  their parameters ``compression`` (the compressor) and ``op`` (the reduction, already resolved
  from the deprecated ``average=``) as locals. Inside ``tf.function`` AutoGraph converts them and
  puts its own frames in between, so the search goes up to ``CALLER_DEPTH`` frames.
* On ROCm builds those functions average in the framework: they set ``average_in_framework`` and
  replace Average by Sum before compressing, so that pair reads as Average here.
* Horovod's Keras optimizer lives in the package ``horovod/_keras``, which is on the call stack
  whenever it reduces gradients; the ``self`` of its frames there is the optimizer (a class built
  from the wrapped optimizer's base classes and configuration), whose momentum the face reads to
  warn when the update would have momentum twice (``calling_keras_optimizer``).
"""

from __future__ import annotations

import os
import sys
from typing import Any

import horovod.tensorflow as hvd

WRITTEN_FOR = "0.28.1"

# compress <- allreduce/grouped_allreduce, and AutoGraph's frames between them inside tf.function.
CALLER_DEPTH = 12
KERAS_PACKAGE = f"horovod{os.sep}_keras"


def calling_allreduce_op(compressor: Any) -> Any:
    """The reduction op of the Horovod allreduce that called ``compressor.compress``; call it from
    ``compress`` itself. The nearest caller whose locals hold this compressor as ``compression``
    and an ``op``: ``hvd.allreduce``/``grouped_allreduce``, or the pieces AutoGraph makes of them
    inside ``tf.function``. None when called otherwise."""
    frame = sys._getframe(2)  # 0: here, 1: compress, 2: its caller
    for _ in range(CALLER_DEPTH):
        if frame is None:
            return None
        names = frame.f_locals
        if names.get("compression") is compressor and "op" in names:
            op = names["op"]
            if names.get("average_in_framework") and op == hvd.Sum:
                return hvd.Average  # ROCm: Horovod sums and divides by the size itself
            return op
        frame = frame.f_back
    return None


def called_from_horovod_keras() -> bool:
    """True when Horovod's Keras optimizer is on the call stack."""
    frame = sys._getframe(1)
    while frame is not None:
        if KERAS_PACKAGE in frame.f_code.co_filename:
            return True
        frame = frame.f_back
    return False


def calling_keras_optimizer() -> Any:
    """The Horovod Keras optimizer on the call stack (the ``self`` of its nearest frame in
    ``horovod/_keras`` that has a ``get_config``), or None: under ``DistributedGradientTape`` no
    optimizer takes part in the reduction."""
    frame = sys._getframe(1)
    while frame is not None:
        if KERAS_PACKAGE in frame.f_code.co_filename:
            owner = frame.f_locals.get("self")
            if owner is not None and callable(getattr(owner, "get_config", None)):
                return owner
        frame = frame.f_back
    return None


def horovod_build() -> dict[str, bool]:
    """How Horovod was built for TensorFlow (its public build queries; ``python -m hvd_sparse.info``)."""
    return {name: bool(getattr(hvd, f"{name}_built")()) for name in ("mpi", "gloo", "nccl", "cuda", "rocm")}
