"""TensorFlow custom ops over the CPU kernels: kernels/cpu/tf_ops.cc, compiled with the same kernel
sources against the installed TensorFlow (setup.py, ``_tf_ops`` next to the ctypes library) and
loaded with ``tf.load_op_library``. The ops run in TensorFlow's executor on TensorFlow's buffers,
eager or inside a graph: nothing leaves the framework.

Importing this module loads the library; when that fails it raises ``KernelUnavailable`` naming
the cause (not built, older than its sources, built against another TensorFlow), and the loader
(``hvd_sparse.kernels.tf_ops``) falls back to the reference path with one warning. Each op returns
None for arguments it has no kernel for (the caller then runs the TensorFlow backend's own ops).
"""

from __future__ import annotations

import importlib.machinery
from pathlib import Path
from typing import Any

import tensorflow as tf

from . import KernelUnavailable

CPU = Path(__file__).resolve().parent / "cpu"
STEM = "_tf_ops"
SOURCES = ("tf_ops.cc", "topk.cpp", "norms.cpp")
FIX = "rebuild it with `make install` (or `pip install -e .` in the repository)"
_VALUES = (tf.float32, tf.float64)


def library_path() -> Path | None:
    """The built op library next to the CPU kernels, or None."""
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = CPU / f"{STEM}{suffix}"
        if path.exists():
            return path
    return None


def _open() -> Any:
    path = library_path()
    if path is None:
        raise KernelUnavailable(f"the TensorFlow op library {CPU / STEM}*.so was not built: {FIX}")
    built = path.stat().st_mtime
    stale = [name for name in (*SOURCES, *(p.name for p in sorted(CPU.glob("*.h"))))
             if (CPU / name).stat().st_mtime > built]
    if stale:
        raise KernelUnavailable(f"the TensorFlow op library {path.name} is older than "
                                f"{', '.join(stale)}: {FIX}")
    try:
        return tf.load_op_library(str(path))
    except (tf.errors.NotFoundError, OSError) as error:   # e.g. built against another TensorFlow
        raise KernelUnavailable(f"cannot load {path}: {error}") from error


_OPS = _open()


def topk_abs(x: tf.Tensor, k: int, index_dtype: str = "int64") -> tf.Tensor | None:
    """Ascending indices (``index_dtype``) of the k entries of largest magnitude of x (flattened),
    with the tie rule of ``Backend.topk_abs_indices``; None where there is no kernel (a dtype other
    than fp32/fp64, a tensor not on the CPU, k outside [0, numel])."""
    n = x.shape.num_elements()
    if x.dtype not in _VALUES or n is None or not 0 <= k <= n or "GPU" in (x.device or "").upper():
        return None
    return _OPS.hvd_sparse_topk_abs(x, tf.constant(k, tf.int64), Tidx=index_dtype)


def segment_sums(x: tf.Tensor, lengths: list[int]) -> tuple[list[float], list[int]] | None:
    """The float64 sums of squares of consecutive segments of x (flattened) in one read, and the
    rounding depth of each (norms.cpp), for ``exact.float32_norms``; None where there is no kernel
    (a dtype other than fp32/fp64, a tensor not on the CPU, lengths that do not add up to its size)."""
    n = x.shape.num_elements()
    if (x.dtype not in _VALUES or n is None or "GPU" in (x.device or "").upper()
            or any(length < 0 for length in lengths) or sum(lengths) != n):
        return None
    sums, depths = _OPS.hvd_sparse_segment_sumsq(tf.reshape(x, [-1]), tf.constant(lengths, tf.int64))
    return sums.numpy().tolist(), depths.numpy().tolist()
