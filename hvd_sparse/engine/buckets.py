"""What the engine keeps about a bucket across steps (``Bucket``), what a step's selection hands
on (``Selection``), and the dtype rules every face applies before any collective."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..algorithms.base import Algorithm
from ..backends import Backend, index_dtype_for
from ..errors import ConfigurationError, UnsupportedTensorError
from .stats import BucketStats, StepTimes

# Dtypes Horovod 0.28.1 can move in collectives (no bfloat16: docs/architecture.md#transport-dtypes).
_TRANSPORTABLE = ("float16", "float32", "float64")
_FLOATS = ("float16", "bfloat16", "float32", "float64")


@dataclass
class Bucket:
    """Everything one rank keeps about one bucket across steps."""

    key: str
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    numel: int
    residual: Any
    value_dtype: str
    index_dtype: str
    sizes: tuple[int, ...] = ()     # element count of each tensor, in bucket order
    step: int = 0
    control: Any = None
    stats: BucketStats | None = None
    nonfinite_steps: int = 0
    sent: tuple | None = None       # (indices, values) of the last step, for take_back
    momentum: Any = None            # the momentum correction's velocity u (None: not started)
    momentum_unmasked: Any = None   # u of the last step before masking (nonfinite="raise": for
                                    # take_back)
    second_moment: Any = None       # the Adam path's v (engine/adam.py; None: not started)
    adam_before: Any = None         # (m, v) before the last dense Adam step (nonfinite="raise": for
                                    # take_back)
    refreshed: int | None = None    # bytes of this step's refresh of the shared v (engine/adam.py)
    dense: bool = False             # every tensor under ``dense_below``: always averaged densely
    members: tuple[str, ...] = ()   # the tensors' own keys when it packs per-tensor steps
    times: StepTimes | None = None  # where the current (or last) step's host time went


@dataclass(frozen=True)
class Selection:
    """What steps 1 and 2 hand on: this rank's accumulated vector and indices."""

    acc: Any              # gradient + residual (zeros on a non-finite step)
    idx: Any              # this rank's indices, in the bucket's index dtype
    selected: int
    finite: bool          # the gradient was finite (or not checked: nonfinite="ignore")
    cleared: bool         # the fused op already cleared the inputs (write_into_inputs)


def check_gradient_dtype(key: str, dtype: str) -> None:
    """Refuse a gradient the engine cannot sparsify; faces call it before any collective (at
    trace time in TensorFlow) so every rank fails at the same point."""
    if dtype not in _FLOATS:
        raise UnsupportedTensorError(
            f"gradient {key!r} has dtype {dtype}; sparsification needs real floating-point "
            "gradients (float16, bfloat16, float32, float64): cast the parameter, or leave it out "
            "of the compressed optimizer")


def value_dtype_for(dtypes: tuple[str, ...]) -> str:
    """Values travel in the gradients' own precision when Horovod can move it, else fp32."""
    common = set(dtypes)
    if len(common) == 1 and dtypes[0] in _TRANSPORTABLE:
        return dtypes[0]
    return "float32"


def new_bucket(key: str, tensors: list[Any], members: tuple[str, ...], algorithm: Algorithm,
               backend: Backend, is_dense: Callable[[tuple[int, ...]], bool]) -> Bucket:
    """A bucket for these tensors, its residual zeros (fp64 when a tensor is, else fp32); refused
    with the reason for a dtype the engine cannot sparsify, a packing the method cannot run or
    no entries at all. ``members``: the tensors' own keys when it packs per-tensor steps."""
    shapes = tuple(tuple(int(d) for d in t.shape) for t in tensors)
    dtypes = tuple(backend.dtype_name(t) for t in tensors)
    for dtype in dtypes:
        check_gradient_dtype(key, dtype)
    if members and not (algorithm.tensor_packing and len(members) == len(tensors)):
        raise ConfigurationError(
            f"bucket {key!r} packs {len(members)} per-tensor steps for {len(tensors)} tensors with "
            f"{type(algorithm).__name__}(scope={algorithm.scope!r}), which "
            + ("needs a key per tensor" if algorithm.tensor_packing
               else "selects per tensor only in buckets of its own, and only in scope 'tensor'"))
    sizes = tuple(int(np.prod(s, dtype=np.int64)) for s in shapes)
    numel = sum(sizes)
    if numel == 0:
        raise UnsupportedTensorError(f"bucket {key!r} is empty: nothing to sparsify")
    residual_dtype = "float64" if "float64" in dtypes else "float32"
    return Bucket(key=key, shapes=shapes, dtypes=dtypes, numel=numel,
                  residual=backend.zeros(numel, residual_dtype, like=tensors[0]),
                  value_dtype=value_dtype_for(dtypes), index_dtype=index_dtype_for(numel),
                  sizes=sizes, dense=is_dense(sizes), members=members)
