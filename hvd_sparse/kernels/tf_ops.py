"""TensorFlow custom ops over the CPU kernels: hvd_sparse/kernels/cpu/tf_ops.cc, compiled with the same kernel
sources against the installed TensorFlow (setup.py, ``_tf_ops`` next to the ctypes library; where
the install could not, on first use into a per-user cache: tf_build.py) and loaded with
``tf.load_op_library``. The ops run in TensorFlow's executor on TensorFlow's buffers,
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

import numpy as np
import tensorflow as tf

from ..backends.contract import SampledSegment, ThresholdBand, sampled_plan_fits
from ..backends.exact import KernelSelection
from ..backends.tf_eager import constant
from . import KernelUnavailable, tf_build

CPU = Path(__file__).resolve().parent / "cpu"
STEM = "_tf_ops"
SOURCES = tf_build.SOURCES
FIX = "rebuild it with `make install` (or `pip install -e .` in the repository)"
_VALUES = (tf.float32, tf.float64)
_INPUTS = (tf.float16, tf.bfloat16, tf.float32, tf.float64)
_KINDS = {tf.float32: np.float32, tf.float64: np.float64}


def library_path() -> Path | None:
    """The built op library next to the CPU kernels, or None."""
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = CPU / f"{STEM}{suffix}"
        if path.exists():
            return path
    return None


def _open() -> Any:
    """The library the install built next to the CPU kernels; else the one compiled on first use
    into the per-user cache (tf_build.py: a wheel built under pip's build isolation has none)."""
    path = library_path()
    if path is None:
        return _load(tf_build.cached_library(tf))
    built = path.stat().st_mtime
    stale = [name for name in (*SOURCES, *(p.name for p in sorted(CPU.glob("*.h"))))
             if (CPU / name).stat().st_mtime > built]
    if stale:
        raise KernelUnavailable(f"the TensorFlow op library {path.name} is older than "
                                f"{', '.join(stale)}: {FIX}")
    return _load(path)


def _load(path: Path) -> Any:
    try:
        return tf.load_op_library(str(path))
    except (tf.errors.NotFoundError, OSError) as error:   # e.g. built against another TensorFlow
        raise KernelUnavailable(f"cannot load {path}: {error}") from error


_OPS = _open()


def _on_cpu(*tensors: tf.Tensor) -> bool:
    return not any("GPU" in (t.device or "").upper() for t in tensors)


# Per-call overhead matters: a per-tensor step calls these ops on tens of small tensors, and an
# eager slice or reshape costs far more than the op itself (about 100 and 55 us against 20 us).
_EMPTY: dict = {}


def _empty(dtype: tf.DType) -> tf.Tensor:
    """An empty vector of dtype (the ops' "no values" input), made once per dtype when eager."""
    if not tf.executing_eagerly():
        return tf.zeros([0], dtype)
    if dtype not in _EMPTY:
        _EMPTY[dtype] = tf.zeros([0], dtype)
    return _EMPTY[dtype]


def _vector(x: tf.Tensor) -> tf.Tensor:
    """x flattened, without an op when it already is a vector."""
    return x if x.shape.rank == 1 else tf.reshape(x, [-1])


def topk_abs(x: tf.Tensor, k: int, index_dtype: str = "int64") -> tf.Tensor | None:
    """Ascending indices (``index_dtype``) of the k entries of largest magnitude of x (flattened),
    with the tie rule of ``Backend.topk_abs_indices``; None where there is no kernel (a dtype other
    than fp32/fp64, a tensor not on the CPU, k outside [0, numel])."""
    n = x.shape.num_elements()
    if x.dtype not in _VALUES or n is None or not 0 <= k <= n or not _on_cpu(x):
        return None
    return _OPS.hvd_sparse_topk_abs(x, constant(k, tf.int64), Tidx=tf.as_dtype(index_dtype))


def topk_abs_segments(x: tf.Tensor, segments: list[tuple[int, int, int]],
                      index_dtype: str = "int64") -> tf.Tensor | None:
    """``topk_abs`` in each (start, size, k) segment of x (flattened), offset by its start and
    concatenated in order, in one op; None where there is no kernel (as ``topk_abs``, or a
    segment outside x)."""
    n = x.shape.num_elements()
    if (x.dtype not in _VALUES or n is None or not _on_cpu(x)
            or any(not (start >= 0 and 0 <= k <= size and start + size <= n)
                   for start, size, k in segments)):
        return None
    flat = [value for segment in segments for value in segment]
    return _OPS.hvd_sparse_topk_abs_segments(x, constant(flat, tf.int64),
                                             Tidx=tf.as_dtype(index_dtype))


def segment_sums(x: tf.Tensor, lengths: list[int]) -> tuple[list[float], list[int]] | None:
    """The float64 sums of squares of consecutive segments of x (flattened) in one read, and the
    rounding depth of each (norms.cpp), for ``exact.float32_norms``; None where there is no kernel
    (a dtype other than fp32/fp64, a tensor not on the CPU, lengths that do not add up to its size)."""
    n = x.shape.num_elements()
    if (x.dtype not in _VALUES or n is None or not _on_cpu(x)
            or any(length < 0 for length in lengths) or sum(lengths) != n):
        return None
    sums, depths = _OPS.hvd_sparse_segment_sumsq(_vector(x), constant(lengths, tf.int64))
    return sums.numpy().tolist(), depths.numpy().tolist()


def accumulate_select(residual: tf.Tensor, tensors: list[tf.Tensor], lo: int, hi: int, threshold: float,
                      probes: list[float], every: int, index_dtype: str, check_finite: bool,
                      velocity: tf.Tensor | None, factor: float, nesterov: bool, in_place: bool
                      ) -> tuple[tf.Tensor, tf.Tensor | None, tf.Tensor, list[float], bool] | None:
    """The residual plus the tensors (through the momentum correction's ``velocity`` when given) and
    in the same pass the ascending indices in [lo, hi) with |a| >= threshold and the probe counts
    of ``count_at_least``: (accumulated, velocity, indices, counts, finite). With ``check_finite``
    and an input holding NaN/Inf nothing is written (not finite, no indices). ``in_place``: the
    residual and velocity are written where they are (the caller owns them); else copies are.
    None where there is no kernel (a dtype, a device, a range or too many probes)."""
    n = residual.shape.num_elements()
    if (residual.dtype not in _VALUES or n is None or not 0 <= lo <= hi <= n or len(probes) > 8
            or any(t.dtype not in _INPUTS for t in tensors) or not _on_cpu(residual, *tensors)
            or sum(t.shape.num_elements() or 0 for t in tensors) != n
            or (velocity is not None
                and (velocity.dtype != residual.dtype or velocity.shape != residual.shape))):
        return None
    plan = KernelSelection.of(_KINDS[residual.dtype], lo, hi, threshold, probes, every)
    acc, velocity_out, idx, counts, finite = _OPS.hvd_sparse_accumulate_select(
        residual, _empty(residual.dtype) if velocity is None else velocity, list(tensors),   # read flat
        constant([lo, hi, plan.row_len, every, plan.sample_end], tf.int64),
        constant(plan.threshold, tf.float64), constant(plan.probes, tf.float64),
        constant(float(factor), tf.float64),
        Tidx=tf.as_dtype(index_dtype), check=check_finite, nesterov=nesterov, in_place=in_place)
    finite = bool(finite)
    counts = plan.scale(counts.numpy().tolist()) if finite else []
    return acc, (None if velocity is None else velocity_out), (idx if finite else None), counts, finite


def select_at_least(x: tf.Tensor, lo: int, hi: int, threshold: float, probes: list[float], every: int,
                    index_dtype: str = "int64") -> tuple[tf.Tensor, list[float]] | None:
    """The reference ``select_at_least`` on an accumulated fp32/fp64 vector (read flat), in one read
    and no temporary of its size: the ascending indices in [lo, hi) with |x| >= threshold and the
    probe counts of ``count_at_least``; None where there is no kernel."""
    n = x.shape.num_elements()
    if x.dtype not in _VALUES or n is None or not 0 <= lo <= hi <= n or len(probes) > 8 or not _on_cpu(x):
        return None
    plan = KernelSelection.of(_KINDS[x.dtype], lo, hi, threshold, probes, every)
    idx, counts = _OPS.hvd_sparse_select_at_least(
        x, constant([lo, hi, plan.row_len, every, plan.sample_end], tf.int64),
        constant(plan.threshold, tf.float64), constant(plan.probes, tf.float64),
        Tidx=tf.as_dtype(index_dtype))
    return idx, plan.scale(counts.numpy().tolist())


def sampled_threshold_select(x: tf.Tensor, segments: list[SampledSegment], band: ThresholdBand,
                             index_dtype: str = "int64") -> tuple[tf.Tensor, list[float]] | None:
    """``Backend.sampled_threshold_select`` (DGC's selection, every segment) in one op
    (sampled.cpp): (indices, a threshold per segment); None where there is no kernel."""
    n = x.shape.num_elements()
    if (x.dtype not in _VALUES or n is None or x.shape.rank != 1 or not segments
            or not sampled_plan_fits(segments, n) or not _on_cpu(x)):
        return None
    idx, thresholds = _OPS.hvd_sparse_sampled_threshold_select(
        x, tf.constant(np.asarray(segments, np.int64).reshape(-1)),
        constant((band.upper, band.lower), tf.float64), resample=band.resample, Tidx=tf.as_dtype(index_dtype))
    return idx, thresholds.numpy().tolist()


def set_at(x: tf.Tensor, idx: tf.Tensor, values: tf.Tensor | None, in_place: bool) -> tf.Tensor | None:
    """x with x[idx] = values (zeros without values), written in place with ``in_place`` (the
    caller owns x); None where there is no kernel."""
    if (x.dtype not in _VALUES or idx.dtype not in (tf.int32, tf.int64) or x.shape.rank != 1
            or not _on_cpu(x, idx)):
        return None
    values = _empty(x.dtype) if values is None else _vector(values)
    if values.dtype != x.dtype:
        values = tf.cast(values, x.dtype)
    return _OPS.hvd_sparse_set_at(x, _vector(idx), values, in_place=in_place)


def scatter_split(idx: tf.Tensor, values: tf.Tensor, sizes: list[int]) -> list[tf.Tensor] | None:
    """The dense vector with ``values`` at ``idx`` (duplicates summed in order from zeros, as
    ``tf.scatter_nd``) cut into new vectors of ``sizes``, each written once; None where there is
    no kernel."""
    idx = tf.convert_to_tensor(idx)
    if (values.dtype not in _VALUES or idx.dtype not in (tf.int32, tf.int64) or not sizes
            or min(sizes) < 0 or not _on_cpu(idx, values)):
        return None
    return _OPS.hvd_sparse_scatter_split(_vector(idx), _vector(values), sizes=sizes, N=len(sizes))
