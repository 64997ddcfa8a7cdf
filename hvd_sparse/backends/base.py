"""The few bulk array operations the engine needs, one implementation per framework.

Bulk data (gradients, residuals, selected values and indices) never leaves the framework: the
engine and the algorithms touch it only through these methods, so one algorithm module serves
NumPy, PyTorch and TensorFlow alike. Every method returns its result; a backend whose arrays are
mutable may update its first argument in place and return it (the engine always uses the return
value), so the TensorFlow backend, whose tensors are immutable, fits the same code.

Control decisions (thresholds, counts, partitions) are not made here: they are small NumPy
computations that read host scalars (``to_numpy``, ``item``). One exception:
``adapt_threshold_select``, DGC's threshold adaptation, decides between passes over the vector,
so that a kernel can run the whole selection in one call (``sampled_threshold_select``).

This module is the interface and the reference compositions of the fused ops; the bit-exact
numerics the backends and the kernels share (norms, moments, magnitude keys, sampling) live in
exact.py, below both.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .contract import Array, Moments, Norms, SampledSegment, Selected, ThresholdBand, Velocity


@dataclass
class SecondMoment:
    """The Adam path's second moment on its sparse steps: each rank's own v from its own gradient
    (the residual's dtype and length; updated in place, or replaced by backends whose arrays are
    immutable), its factor beta2, the bias corrections of m and v and the update's bound: the
    update is ``clamp(precondition(u, v, first_scale, second_scale, eps), bound)``
    (algorithms/corrections.py ``AdamPath``). ``frozen``: v is shared by the ranks and only read
    (``second_moment_refresh``): the rank's gradient does not enter it."""

    buffer: Array
    factor: float
    first_scale: float
    second_scale: float
    eps: float
    bound: float = float("inf")   # each step's update clipped to [-bound, bound] (NaN stays NaN)
    frozen: bool = False


@dataclass
class Momentum:
    """One bucket's momentum correction, handed to the ops that accumulate: the velocity ``u``
    (the residual's dtype and length; updated in place, or replaced by backends whose arrays are
    immutable), its factor and form. With it, what is accumulated into the residual is
    ``u <- factor*u + g`` (Nesterov: ``u <- factor*(u + g)``, then ``(e + u) + g``) instead of g.
    With a ``second`` moment (the Adam path) u is Adam's first moment,
    ``u <- factor*u + (1 - factor)*g``, v is updated from g alike, and the residual gains Adam's
    update of them (``Backend.adam_step``)."""

    buffer: Array
    factor: float
    nesterov: bool = False
    second: SecondMoment | None = None


class Backend:
    """Interface; see numpy_backend.py for the reference semantics of each method."""

    name = "abstract"

    # --- creation and layout -------------------------------------------------------------------
    def zeros(self, n: int, dtype: str = "float32", like: Array | None = None) -> Array:
        """1-D zeros of length n on the device of ``like``; dtype a NumPy dtype name."""
        raise NotImplementedError

    def from_numpy(self, array: np.ndarray, like: Array | None = None) -> Array:
        """A framework array with ``array``'s contents, on the device of ``like``."""
        raise NotImplementedError

    def to_numpy(self, x: Array) -> np.ndarray:
        """x as a NumPy array on the host (synchronizes)."""
        raise NotImplementedError

    def copy(self, x: Array) -> Array:
        """A new array with x's contents (on x's device)."""
        raise NotImplementedError

    def flat(self, x: Array) -> Array:
        """1-D view (or reshape) of x."""
        raise NotImplementedError

    def reshape(self, x: Array, shape: tuple[int, ...]) -> Array:
        """x in ``shape`` (a view where the framework can)."""
        raise NotImplementedError

    def concat(self, xs: list[Array]) -> Array:
        """The 1-D concatenation of ``xs``."""
        raise NotImplementedError

    def slice(self, x: Array, lo: int, hi: int, step: int = 1) -> Array:
        """x[lo:hi:step] (a view where the framework can)."""
        raise NotImplementedError

    def numel(self, x: Array) -> int:
        """The number of entries of x."""
        raise NotImplementedError

    def dtype_name(self, x: Array) -> str:
        """NumPy-style name of x's dtype ('float32', 'float16', 'bfloat16', 'int64', ...)."""
        raise NotImplementedError

    def cast(self, x: Array, dtype: str) -> Array:
        """x in ``dtype`` (a NumPy dtype name)."""
        raise NotImplementedError

    # --- arithmetic ------------------------------------------------------------------------------
    def add(self, acc: Array, x: Array) -> Array:
        """acc + x (float32 acc; x may be lower precision); may write into acc."""
        raise NotImplementedError

    def multiply(self, x: Array, y: Array) -> Array:
        """Element-wise x * y (may write into x)."""
        raise NotImplementedError

    def clamp(self, x: Array, bound: float) -> Array:
        """x clipped to [-bound, bound], NaN kept (may write into x)."""
        raise NotImplementedError

    def precondition(self, u: Array, v: Array, first_scale: float, second_scale: float, eps: float) -> Array:
        """A new array, element by element ``(u * first_scale) / (sqrt(v * second_scale) + eps)``,
        each operation rounded to the arrays' dtype in that order, the square root correctly
        rounded (IEEE, as the kernels' is): Adam's bias-corrected update."""
        raise NotImplementedError

    def scale(self, x: Array, factor: float) -> Array:
        """x * factor; may write into x."""
        raise NotImplementedError

    def abs(self, x: Array) -> Array:
        """|x|, elementwise."""
        raise NotImplementedError

    def sum_of_squares(self, x: Array) -> float:
        """Host float (synchronizes)."""
        raise NotImplementedError

    def segment_norms(self, x: Array, lengths: list[int]) -> np.ndarray:
        """L2 norm of each consecutive segment of x (segment i has ``lengths[i]`` entries, which
        sum to numel(x)) rounded to float32, as a host float64 array (one synchronization). The
        same on every backend and kernel, bit for bit: float32(sqrt(S)) for S the exact sum of
        squares rounded to float64 (see ``exact.float32_norms``)."""
        raise NotImplementedError

    def all_finite(self, x: Array) -> bool:
        """Host bool (synchronizes)."""
        raise NotImplementedError

    def mean_std(self, x: Array) -> tuple[float, float]:
        """Host floats (synchronizes): the mean of x and its sample standard deviation (n - 1 in
        the denominator, as ``torch.std``; 0.0 for a single element), each exactly rounded to
        float32 from the exact sums Σx and Σx², so identical on every backend and kernel (see
        ``exact.certain_mean_std``)."""
        raise NotImplementedError

    def tensors_finite(self, tensors: list[Array]) -> bool:
        """Whether no tensor holds NaN or Inf: one sum per tensor and a single host
        synchronization (a sum is finite when its terms are, short of overflow; a sum that is
        not is confirmed element by element, so an overflowing sum of finite terms is finite)."""
        raise NotImplementedError

    # --- selection and scatter -------------------------------------------------------------------
    def topk_abs_indices(self, x: Array, k: int) -> Array:
        """The k entries of x of largest magnitude, as ascending int64 indices; 0 <= k <= numel(x).

        One rule on every backend and kernel, so every rank and framework selects the same set:
        magnitudes are ordered as |x| with -0 == +0 and every NaN equal to every other NaN and
        above +Inf (``exact.MAGNITUDE_KEYS``); of the entries tied at the k-th largest magnitude, those
        of the lowest indices are taken."""
        raise NotImplementedError

    def topk_abs_segments(self, x: Array, segments: Sequence[tuple[int, int, int]]) -> Array:
        """``topk_abs_indices`` in each (start, size, k) segment of x, offset by the segment's
        start, concatenated in the order given (int64): DEFT's per-unit selection, one call."""
        parts = [self.topk_abs_indices(self.slice(x, start, start + size), k) + start
                 for start, size, k in segments]
        return self.concat(parts) if parts else self.arange(0, 0, like=x)

    def sampled_threshold_select(self, x: Array, segments: Sequence[SampledSegment],
                                 band: ThresholdBand) -> tuple[Array, list[float]]:
        """DGC's selection in each segment of x (a vector) on its own, one call: int64 indices,
        each segment's ascending and offset by its offset, concatenated in the order given, and
        each segment's final threshold. A segment's threshold is the smallest of the ``top``
        largest magnitudes of ``seg[start::stride]``, then ``adapt_threshold_select`` with the
        segment's ``iterations``."""
        parts, thresholds = [], []
        for seg in segments:
            part = self.slice(x, seg.offset, seg.offset + seg.size)
            # |sample| is a contiguous copy of a strided view: the top-k kernels take it
            sample = self.abs(self.slice(part, seg.start, seg.size, seg.stride))
            threshold = top_magnitudes(self, sample, seg.top)[1]
            idx, threshold = self.adapt_threshold_select(part, threshold, seg.k,
                                                         band._replace(iterations=seg.iterations))
            parts.append(idx + seg.offset if seg.offset else idx)
            thresholds.append(threshold)
        return (self.concat(parts) if parts else self.arange(0, 0, like=x)), thresholds

    def adapt_threshold_select(self, x: Array, threshold: float, k: int, band: ThresholdBand
                               ) -> tuple[Array, float]:
        """The entries with |x| >= threshold, the threshold adapted by ``band`` until between k
        and upper·k are chosen, then the first k chosen: ascending int64 indices, and the final
        threshold (a NaN threshold chooses nothing)."""
        n = self.numel(x)
        idx = self.select_at_least(x, 0, n, threshold)[0]
        count = self.numel(idx)
        for _ in range(band.iterations):
            if count > k:
                if count <= band.upper * k:
                    break
                if band.resample:
                    idx = self.take(idx, self.topk_abs_indices(self.take(x, idx), k))
                    break
                threshold *= band.upper
            elif count < band.lower * k:
                threshold *= band.lower
            else:
                break
            idx = self.select_at_least(x, 0, n, threshold)[0]
            count = self.numel(idx)
        return (self.slice(idx, 0, k) if self.numel(idx) > k else idx), threshold

    def indices_where_at_least(self, x: Array, threshold: float, offset: int = 0) -> Array:
        """int64 indices i (plus offset) with x[i] >= threshold, ascending."""
        raise NotImplementedError

    def count_at_least(self, x: Array, thresholds: list[float], every: int = 1) -> list[float]:
        """How many entries of x are >= each threshold (one host synchronization). With
        ``every`` > 1, an estimate from 1/every of x read as 64 evenly spaced contiguous runs (so
        only that share of memory is touched), scaled back to the whole."""
        raise NotImplementedError

    def count_in_ranges(self, idx: Array, bounds: np.ndarray) -> np.ndarray:
        """How many indices fall in each range [bounds[i], bounds[i+1]) (ascending bounds; every
        index inside [bounds[0], bounds[-1])), as NumPy int64."""
        raise NotImplementedError

    def take(self, x: Array, idx: Array) -> Array:
        """x[idx] (a gather)."""
        raise NotImplementedError

    def zero_at(self, x: Array, idx: Array) -> Array:
        """x with x[idx] = 0; may write into x."""
        raise NotImplementedError

    def put(self, x: Array, idx: Array, values: Array) -> Array:
        """x with x[idx] = values; may write into x."""
        raise NotImplementedError

    def scatter(self, n: int, idx: Array, values: Array, like: Array | None = None) -> Array:
        """Dense length-n vector holding values at idx; duplicate indices are summed."""
        raise NotImplementedError

    def unique(self, idx: Array) -> Array:
        """Sorted distinct indices."""
        raise NotImplementedError

    def arange(self, lo: int, hi: int, like: Array | None = None) -> Array:
        """int64 [lo, hi)."""
        raise NotImplementedError

    # --- buckets: many tensors <-> one flat vector ---------------------------------------------------
    def accumulate(self, residual: Array, tensors: list[Array], clear_inputs: bool = False,
                   momentum: Momentum | None = None) -> Array:
        """residual + concat(flattened tensors), in the residual's dtype; may write into residual
        (backends with mutable arrays add slice by slice, without a concatenated copy). With
        ``clear_inputs`` every input is also set to zero (mutable backends; the engine writes the
        average into the inputs later, so a kernel can clear them in the same pass). With
        ``momentum`` the gradient enters through the velocity (``Momentum``), which is updated."""
        if momentum is not None and momentum.second is not None:
            out, momentum.buffer = self.adam_accumulate(residual, momentum, tensors)
        elif momentum is not None:
            out, momentum.buffer = self.momentum_accumulate(residual, momentum.buffer, tensors,
                                                            momentum.factor, momentum.nesterov)
        else:
            flat = self.concat([self.cast(self.flat(t), self.dtype_name(residual)) for t in tensors])
            out = self.add(residual, flat)
        if clear_inputs:
            self.clear(tensors)
        return out

    def clear(self, tensors: list[Array]) -> None:
        """Set every tensor to zero in place (backends with mutable arrays only)."""
        raise NotImplementedError(f"the {self.name} backend's tensors are immutable")

    def select_at_least(self, x: Array, lo: int, hi: int, threshold: float, probes: Sequence[float] = (),
                        every: int = 1) -> tuple[Array, list[float]]:
        """What a threshold method reads off its accumulated vector x in [lo, hi): the ascending
        indices i (absolute) with |x_i| >= threshold, and ``count_at_least`` of |x[lo:hi]| at each
        probe (none without probes)."""
        magnitude = self.abs(self.slice(x, lo, hi))
        counts = self.count_at_least(magnitude, list(probes), every) if len(probes) else []
        return self.indices_where_at_least(magnitude, threshold, offset=lo), counts

    def accumulate_select(self, residual: Array, tensors: list[Array], lo: int, hi: int, threshold: float,
                          probes: Sequence[float] = (), every: int = 1, index_dtype: str = "int64",
                          clear_inputs: bool = False, check_finite: bool = False,
                          momentum: Momentum | None = None) -> Selected:
        """``accumulate`` then ``select_at_least`` on the result: ``Selected`` (accumulated vector,
        indices, probe counts, finite). A kernel does both in one pass and returns the indices as
        ``index_dtype`` (the reference returns int64; the engine casts either to the bucket's index
        dtype). With ``check_finite`` the inputs are first checked (``tensors_finite``; on a GPU in
        the same host synchronization as the count): when one holds NaN/Inf nothing is written (the
        momentum buffer neither) and the result is not finite: (residual, None, [], False)."""
        if check_finite and not self.tensors_finite(tensors):
            return Selected(residual, None, [], False)
        acc = self.accumulate(residual, tensors, clear_inputs, momentum)
        return Selected(acc, *self.select_at_least(acc, lo, hi, threshold, probes, every), True)

    def accumulate_moments(self, residual: Array, tensors: list[Array], clear_inputs: bool = False,
                           check_finite: bool = False, momentum: Momentum | None = None
                           ) -> Moments:
        """``accumulate`` then ``mean_std`` of the result: ``Moments`` (accumulated vector,
        (mean, std), finite); a kernel takes the moments in the accumulating pass (Gaussian-k).
        With ``check_finite`` the inputs are first checked: when one holds NaN/Inf nothing is
        written and the result is not finite: (residual, None, False)."""
        if check_finite and not self.tensors_finite(tensors):
            return Moments(residual, None, False)
        acc = self.accumulate(residual, tensors, clear_inputs, momentum)
        return Moments(acc, self.mean_std(acc), True)

    def accumulate_segment_moments(self, residual: Array, tensors: list[Array], lengths: list[int],
                                   clear_inputs: bool = False, check_finite: bool = False,
                                   momentum: Momentum | None = None) -> Moments:
        """``accumulate_moments`` with the moments of each consecutive segment (``lengths``) of the
        result, a list: Gaussian-k's packed per-tensor steps, each tensor's μ and σ its own."""
        if check_finite and not self.tensors_finite(tensors):
            return Moments(residual, None, False)
        acc = self.accumulate(residual, tensors, clear_inputs, momentum)
        starts = np.cumsum([0, *lengths]).tolist()
        return Moments(acc, [self.mean_std(self.slice(acc, lo, hi)) for lo, hi in itertools.pairwise(starts)],
                       True)

    def accumulate_norms(self, residual: Array, tensors: list[Array], lengths: list[int],
                         momentum: Momentum | None = None) -> Norms:
        """``accumulate`` then ``segment_norms`` of the result: ``Norms`` (accumulated vector,
        norms); a kernel takes the sums of squares in the accumulating pass (DEFT)."""
        acc = self.accumulate(residual, tensors, momentum=momentum)
        return Norms(acc, self.segment_norms(acc, lengths))

    def momentum_accumulate(self, residual: Array, momentum: Array, tensors: list[Array], factor: float,
                            nesterov: bool) -> Velocity:
        """The momentum correction of the gradient g = concat(tensors): ``Velocity`` (residual + u,
        u) with u = u·m + g, or with ``nesterov`` u = (u + g)·m and residual + u + g; may write into
        residual and momentum."""
        grad = self.accumulate(self.zeros(self.numel(residual), self.dtype_name(residual), like=residual),
                               tensors)
        return self.momentum_step(residual, momentum, grad, factor, nesterov)

    def momentum_step(self, residual: Array, momentum: Array, grad: Array, factor: float,
                      nesterov: bool) -> Velocity:
        """``momentum_accumulate`` from the gradient as one vector (e.g. after clipping)."""
        if nesterov:
            momentum = self.scale(self.add(momentum, grad), factor)
            return Velocity(self.add(self.add(residual, momentum), grad), momentum)
        momentum = self.add(self.scale(momentum, factor), grad)
        return Velocity(self.add(residual, momentum), momentum)

    def adam_accumulate(self, residual: Array, momentum: Momentum, tensors: list[Array]) -> Velocity:
        """The Adam path's accumulation of the gradient g = concat(tensors) (``momentum`` has a
        ``SecondMoment``): ``adam_step`` of it; may write into residual and both moments."""
        grad = self.accumulate(self.zeros(self.numel(residual), self.dtype_name(residual), like=residual),
                               tensors)
        return self.adam_step(residual, momentum, grad)

    def adam_step(self, residual: Array, momentum: Momentum, grad: Array) -> Velocity:
        """``adam_accumulate`` from the gradient as one vector (``grad`` may be overwritten):
        u = u·factor + g·(1 - factor), v = v·beta2 + (g·g)·(1 - beta2) (``momentum.second.buffer``
        replaced by the new v; a ``frozen`` v is left as it is), then residual +
        clamp(precondition(u, v), bound): Adam's moments and update as ``adam_update`` rounds them,
        clamped. Returns (residual, u)."""
        second = momentum.second
        if second.frozen:
            beta1 = momentum.factor
            u = self.add(self.scale(momentum.buffer, beta1), self.scale(grad, 1.0 - beta1))
            update = self.precondition(u, second.buffer, second.first_scale, second.second_scale, second.eps)
            return Velocity(self.add(residual, self.clamp(update, second.bound)), u)
        update, u, second.buffer = self.adam_update(grad, momentum.buffer, second.buffer, momentum.factor,
                                                    second.factor, second.first_scale, second.second_scale,
                                                    second.eps)
        return Velocity(self.add(residual, self.clamp(update, second.bound)), u)

    def adam_update(self, average: Array, first: Array, second: Array, beta1: float, beta2: float,
                    first_scale: float, second_scale: float, eps: float) -> tuple[Array, Array, Array]:
        """Adam's moments of an averaged gradient and the update they give (the Adam path's dense
        steps): m <- m·beta1 + a·(1 - beta1), v <- v·beta2 + (a·a)·(1 - beta2), and a new array
        ``precondition(m, v, first_scale, second_scale, eps)``. Returns (update, m, v); may write
        into ``first``, ``second`` and ``average``."""
        square = self.multiply(self.copy(average), average)
        first = self.add(self.scale(first, beta1), self.scale(average, 1.0 - beta1))
        second = self.add(self.scale(second, beta2), self.scale(square, 1.0 - beta2))
        return self.precondition(first, second, first_scale, second_scale, eps), first, second

    def scatter_into(self, tensors: list[Array], idx: Array, values: Array, unique: bool,
                     zeroed: bool = False) -> list[Array]:
        """The dense vector holding ``values`` at flat ``idx`` (summed where ``unique`` is False),
        cut into tensors shaped like ``tensors``; backends with mutable arrays write it into
        ``tensors`` themselves (zeroing them first, unless ``zeroed`` says they already are)
        instead of allocating a dense vector."""
        n = sum(self.numel(t) for t in tensors)
        return self.split_like(self.scatter(n, idx, values), tensors)

    def scatter_split(self, n: int, idx: Array, values: Array, tensors: list[Array],
                      like: Array | None = None) -> list[Array]:
        """``split_like(scatter(n, idx, values))``: the dense length-n vector holding ``values`` at
        ``idx`` (duplicates summed in order) as new tensors shaped like ``tensors``; a backend may
        write each piece directly, without the dense vector."""
        return self.split_like(self.scatter(n, idx, values, like=like), tensors)

    def split_like(self, flat: Array, tensors: list[Array]) -> list[Array]:
        """Cut a flat vector back into tensors with the shapes and dtypes of ``tensors``."""
        out, offset = [], 0
        for t in tensors:
            n = self.numel(t)
            piece = self.reshape(self.slice(flat, offset, offset + n), tuple(t.shape))
            out.append(self.cast(piece, self.dtype_name(t)))
            offset += n
        return out


def top_magnitudes(b: Backend, x: Array, k: int) -> tuple[Array, float]:
    """The indices of the k largest magnitudes of ``x`` (``Backend.topk_abs_indices``) and the
    smallest of those magnitudes: NaN when a NaN is among them (NaN ranks above +Inf), and then
    nothing passes ``>=`` it. Only those k values leave the device."""
    idx = b.topk_abs_indices(x, k)
    return idx, float(np.abs(b.to_numpy(b.take(x, idx))).min())


def index_dtype_for(n: int) -> str:
    """int32 indices while they fit (half the bytes on the wire), int64 beyond 2**31."""
    return "int32" if n < 2**31 else "int64"
