"""PyTorch backend: bulk work stays on the gradient's device, in its tensors."""

from __future__ import annotations

import numpy as np
import torch

from .. import kernels
from .base import Backend
from .exact import (
    MAGNITUDE_KEYS,
    blocked_depth,
    blocked_sum,
    exact_mean_std,
    float32_norms,
    mean_std_from_sums,
    sample_shape,
)

_DTYPES = {
    "float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
    "float64": torch.float64, "int32": torch.int32, "int64": torch.int64,
    "int8": torch.int8, "uint8": torch.uint8, "int16": torch.int16, "bool": torch.bool,
}
_NAMES = {v: k for k, v in _DTYPES.items()}


_NORM_CHUNK = 1 << 16


class TorchBackend(Backend):
    """``Backend`` on torch tensors, in place where it may; the fused ops run through the kernels
    of the tensor's device (``kernels.ops_for``) where they handle the arguments."""

    name = "torch"

    def zeros(self, n, dtype="float32", like=None):
        device = like.device if like is not None else None
        return torch.zeros(n, dtype=_DTYPES[dtype], device=device)

    def from_numpy(self, array, like=None):
        t = torch.from_numpy(np.ascontiguousarray(array))
        return t.to(like.device) if like is not None else t

    def to_numpy(self, x):
        return x.detach().cpu().numpy()

    def copy(self, x):
        return x.clone()

    def flat(self, x):
        return x.reshape(-1)

    def reshape(self, x, shape):
        return x.reshape(shape)

    def concat(self, xs):
        return torch.cat(xs) if len(xs) != 1 else xs[0]

    def slice(self, x, lo, hi, step=1):
        return x[lo:hi:step]

    def numel(self, x):
        return x.numel()

    def dtype_name(self, x):
        return _NAMES.get(x.dtype, str(x.dtype).replace("torch.", ""))

    def cast(self, x, dtype):
        return x.to(_DTYPES[dtype])

    def add(self, acc, x):
        return acc.add_(x)

    def scale(self, x, factor):
        return x.mul_(factor)

    def multiply(self, x, y):
        return x.mul_(y)

    def clamp(self, x, bound):
        return x.clamp_(-bound, bound)

    def precondition(self, u, v, first_scale, second_scale, eps):
        return (u * first_scale).div_(_sqrt(v * second_scale).add_(eps))

    def abs(self, x):
        return x.abs()

    def sum_of_squares(self, x):
        return float(torch.dot(x.double(), x.double()))

    def segment_norms(self, x, lengths):
        ops = kernels.ops_for(x)
        norms = None if ops is None else ops.segment_norms(x, list(lengths))
        if norms is not None:
            return norms
        # Squares summed in float64 one chunk at a time (a float64 copy of a whole model costs ten
        # times the arithmetic); a term goes through at most chunk + chunks roundings.
        sums, depths, lo = [], [], 0
        for length in lengths:
            total = torch.zeros((), dtype=torch.float64, device=x.device)
            for start in range(lo, lo + length, _NORM_CHUNK):
                piece = x[start:min(start + _NORM_CHUNK, lo + length)].to(torch.float64)
                total += torch.dot(piece, piece)
            sums.append(total)
            depths.append(min(length, _NORM_CHUNK) + -(-length // _NORM_CHUNK))
            lo += length
        totals = torch.stack(sums).cpu().tolist() if sums else []
        starts = np.cumsum([0, *lengths]).tolist()
        exact = torch.float64 if x.dtype == torch.float64 else torch.float32   # NumPy has no bfloat16
        return float32_norms(totals, depths, lambda i: self.to_numpy(x[starts[i]:starts[i + 1]].to(exact)))

    def all_finite(self, x):
        return bool(torch.isfinite(x).all())

    def mean_std(self, x):
        ops = kernels.ops_for(x)
        done = None if ops is None else ops.mean_std(x)
        if done is not None:
            return done
        x64 = x.reshape(-1).to(torch.float64)
        values = lambda: self.to_numpy(x64)  # noqa: E731
        if x64.numel() < 2:
            return exact_mean_std(values())
        shifted = x64 - x64[0]
        t1, t2 = torch.stack([blocked_sum(v, torch.sum, torch.reshape)
                              for v in (shifted, shifted * shifted)]).tolist()
        return mean_std_from_sums(x64.numel(), float(x64[0]), t1, t2, blocked_depth(x64.numel()), values)

    def tensors_finite(self, tensors):
        ops = kernels.ops_for(tensors[0])
        finite = None if ops is None else ops.all_finite(tensors)
        if finite is not None:
            return finite
        total = torch.stack([t.sum(dtype=torch.float32) for t in tensors]).sum()
        if bool(torch.isfinite(total)):
            return True
        return all(bool(torch.isfinite(t).all()) for t in tensors)   # an overflowing sum is not enough

    def topk_abs_indices(self, x, k):
        x = x.reshape(-1)
        ops = kernels.ops_for(x)
        idx = None if ops is None else ops.topk_abs(x, k, torch.int64)
        if idx is not None:
            return idx
        if k >= x.numel():
            return torch.arange(x.numel(), device=x.device)
        if k <= 0:
            return torch.zeros(0, dtype=torch.int64, device=x.device)
        keys = magnitude_keys(x)
        kth = keys.kthvalue(x.numel() - k + 1).values       # the k-th largest key
        candidates = torch.nonzero(keys >= kth).reshape(-1)  # ascending
        chosen = keys[candidates]
        tied = chosen == kth
        need = k - int((chosen > kth).sum())
        return candidates[~tied | (torch.cumsum(tied, 0) <= need)]   # ties: the lowest indices

    def indices_where_at_least(self, x, threshold, offset=0):
        if x.device.type == "cpu":   # NumPy's SIMD compare and flatnonzero are ~4x faster here
            idx = torch.from_numpy(np.flatnonzero(x.detach().numpy() >= threshold))
        else:
            idx = torch.nonzero(x >= threshold).reshape(-1)
        return idx + offset if offset else idx

    def count_at_least(self, x, thresholds, every=1):
        shape = sample_shape(x.numel(), every)
        sample = x if shape is None else x[: shape[0] * shape[1]].view(shape)[::every]
        if x.device.type == "cpu":
            view = sample.detach().numpy()
            counts = [int(np.count_nonzero(view >= t)) for t in thresholds]
        else:
            counts = torch.stack([torch.count_nonzero(sample >= t) for t in thresholds]).tolist()
        return [float(c) * x.numel() / sample.numel() for c in counts]

    def count_in_ranges(self, idx, bounds):
        # In the indices' own dtype (bounds never exceed n): no int64 copy of a large selection.
        inner = torch.as_tensor(np.asarray(bounds)[1:-1], dtype=idx.dtype, device=idx.device)
        which = torch.bucketize(idx, inner, right=True, out_int32=True)
        return torch.bincount(which, minlength=len(bounds) - 1).cpu().numpy().astype(np.int64)

    def take(self, x, idx):
        if x.dim() == 1 and idx.dim() == 1 and idx.dtype in (torch.int64, torch.int32):
            return x.index_select(0, idx)   # the same gather, 2-3x faster than x[idx] on a CPU
        return x[idx]

    def zero_at(self, x, idx):
        ops = kernels.ops_for(x)
        if ops is not None and ops.zero_at(x, idx):
            return x
        return x.index_fill_(0, idx.long(), 0)

    def put(self, x, idx, values):
        return x.index_put_((idx.long(),), values.to(x.dtype))

    def scatter(self, n, idx, values, like=None):
        out = torch.zeros(n, dtype=values.dtype, device=values.device)
        if values.is_cuda:
            return _ordered_index_add(out, idx.long(), values)
        return out.index_add_(0, idx.long(), values)  # CPU: sums duplicates in order

    def unique(self, idx):
        return torch.unique(idx)

    def arange(self, lo, hi, like=None):
        return torch.arange(lo, hi, dtype=torch.int64, device=like.device if like is not None else None)

    def accumulate(self, residual, tensors, clear_inputs=False, momentum=None):
        if momentum is not None:   # the velocity's own op (one pass with the CPU kernel)
            return super().accumulate(residual, tensors, clear_inputs, momentum)
        ops = kernels.ops_for(residual)
        done = None if ops is None else ops.accumulate(residual, tensors, clear_inputs)
        if done is not None:
            return done
        offset = 0
        for t in tensors:
            n = t.numel()
            residual[offset:offset + n].add_(t.reshape(-1))
            offset += n
        if clear_inputs:
            self.clear(tensors)
        return residual

    def clear(self, tensors):
        ops = kernels.ops_for(tensors[0]) if tensors else None
        if ops is None or ops.clear(tensors) is None:
            for t in tensors:
                t.zero_()

    def momentum_accumulate(self, residual, momentum, tensors, factor, nesterov):
        ops = kernels.ops_for(residual)
        done = None if ops is None else ops.momentum_accumulate(residual, momentum, tensors, factor, nesterov)
        if done is not None:
            return done
        return super().momentum_accumulate(residual, momentum, tensors, factor, nesterov)

    def adam_accumulate(self, residual, momentum, tensors):
        ops = kernels.ops_for(residual)
        done = None if ops is None else ops.adam_accumulate(residual, momentum.buffer, tensors,
                                                             momentum.factor, momentum.second)
        if done is not None:
            return done
        return super().adam_accumulate(residual, momentum, tensors)

    def adam_update(self, average, first, second, beta1, beta2, first_scale, second_scale, eps):
        ops = kernels.ops_for(average)
        done = None if ops is None else ops.adam_update(average, first, second, beta1, beta2, first_scale,
                                                         second_scale, eps)
        if done is not None:
            return done
        return super().adam_update(average, first, second, beta1, beta2, first_scale, second_scale, eps)

    def sampled_threshold_select(self, x, segments, band):
        ops = kernels.ops_for(x)   # one kernel call: no return to Python between passes
        done = None if ops is None else ops.sampled_threshold_select(x, list(segments), band, torch.int64)
        return super().sampled_threshold_select(x, segments, band) if done is None else done

    def select_at_least(self, x, lo, hi, threshold, probes=(), every=1):
        ops = kernels.ops_for(x)
        done = None if ops is None else ops.select_at_least(x, lo, hi, threshold, list(probes), every,
                                                              torch.int64)
        if done is not None:
            return done
        return super().select_at_least(x, lo, hi, threshold, probes, every)

    def accumulate_moments(self, residual, tensors, clear_inputs=False, check_finite=False, momentum=None):
        if momentum is not None:
            return super().accumulate_moments(residual, tensors, clear_inputs, check_finite, momentum)
        ops = kernels.ops_for(residual)
        done = None if ops is None else ops.accumulate_moments(residual, tensors, clear_inputs, check_finite)
        if done is not None:
            return done
        return super().accumulate_moments(residual, tensors, clear_inputs, check_finite)

    def accumulate_segment_moments(self, residual, tensors, lengths, clear_inputs=False, check_finite=False,
                                   momentum=None):
        ops = None if momentum is not None else kernels.ops_for(residual)
        done = None if ops is None else ops.accumulate_segment_moments(residual, tensors, list(lengths),
                                                                       clear_inputs, check_finite)
        if done is not None:
            return done
        return super().accumulate_segment_moments(residual, tensors, lengths, clear_inputs, check_finite,
                                                  momentum)

    def accumulate_norms(self, residual, tensors, lengths, momentum=None):
        if momentum is not None:
            return super().accumulate_norms(residual, tensors, lengths, momentum)
        ops = kernels.ops_for(residual)
        done = None if ops is None else ops.accumulate_norms(residual, tensors, list(lengths))
        if done is not None:
            return done
        return super().accumulate_norms(residual, tensors, lengths)

    def accumulate_select(self, residual, tensors, lo, hi, threshold, probes=(), every=1,
                          index_dtype="int64", clear_inputs=False, check_finite=False, momentum=None):
        ops = kernels.ops_for(residual)
        done = None
        if ops is not None and momentum is not None and momentum.second is not None:
            # the Adam path in the same pass: both moments updated in place (or, not finite, left)
            done = ops.adam_accumulate_select(
                residual, momentum.buffer, tensors, momentum.factor, momentum.second, lo, hi, threshold,
                list(probes), every, _DTYPES[index_dtype], clear_inputs, check_finite)
        elif ops is not None and momentum is not None:   # the momentum correction in the same pass
            # momentum.buffer updated in place (or, not finite, left)
            done = ops.momentum_accumulate_select(
                residual, momentum.buffer, tensors, momentum.factor, momentum.nesterov, lo, hi, threshold,
                list(probes), every, _DTYPES[index_dtype], clear_inputs, check_finite)
        elif ops is not None:
            # With check_finite: the finite check and the count read together (one sync on a GPU).
            op = ops.accumulate_select_if_finite if check_finite else ops.accumulate_select
            done = op(residual, tensors, lo, hi, threshold, list(probes), every, _DTYPES[index_dtype],
                      clear_inputs)
        if done is not None:
            return done
        return super().accumulate_select(residual, tensors, lo, hi, threshold, probes, every,
                                         index_dtype, clear_inputs, check_finite, momentum)

    def scatter_into(self, tensors, idx, values, unique, zeroed=False):
        if not all(t.is_contiguous() for t in tensors):   # no flat view to write through
            return super().scatter_into(tensors, idx, values, unique)
        if not unique:  # sum duplicates in fp32 before any cast to the gradients' dtype
            idx, inverse = torch.unique(idx, return_inverse=True)
            summed = torch.zeros(idx.numel(), dtype=values.dtype, device=values.device)
            values = (_ordered_index_add(summed, inverse, values) if values.is_cuda
                      else summed.index_add_(0, inverse, values))
        if len(tensors) > 1 and not _ascending(idx):   # cut per tensor below: needs them in order
            idx, order = torch.sort(idx)
            values = values[order]
        offsets = np.cumsum([0] + [t.numel() for t in tensors]).tolist()
        cuts = torch.searchsorted(idx, torch.tensor(offsets, dtype=idx.dtype, device=idx.device)).tolist()
        if not zeroed:
            self.clear(tensors)
        ops = kernels.ops_for(values)
        for t, lo, hi, offset in zip(tensors, cuts[:-1], cuts[1:], offsets, strict=False):
            flat = t.view(-1)
            if hi > lo and not (ops is not None and ops.put_at(flat, idx[lo:hi], values[lo:hi], offset)):
                flat.index_put_((idx[lo:hi].long() - offset,), values[lo:hi].to(t.dtype))
        return list(tensors)

def _ascending(idx: torch.Tensor) -> bool:
    """Whether ``idx`` is already in ascending order (the dense average's indices, a union just
    de-duplicated): one pass, against a sort that costs about 30 of them at millions of entries."""
    return idx.numel() < 2 or bool((idx[1:] >= idx[:-1]).all())


def magnitude_keys(x: torch.Tensor) -> torch.Tensor:
    """Integer keys ordered as the magnitudes of x (see base.MAGNITUDE_KEYS)."""
    int_dtype, mask, nan_key = MAGNITUDE_KEYS[_NAMES[x.dtype]]
    return (x.view(_DTYPES[int_dtype]) & mask).clamp_(max=nan_key)


def _ordered_index_add(out: torch.Tensor, idx: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``out.index_add_(0, idx, values)`` with duplicate indices summed in their order in ``idx``.

    CUDA's ``index_add_`` sums duplicates with atomics in a varying order, so two ranks holding
    the same gathered pairs could round differently and drift apart. Here the k-th occurrence of
    every index is added in pass k (indices are unique within a pass, so no two additions meet):
    the result is bitwise reproducible, as on the CPU. Passes: the largest multiplicity, at most
    the number of ranks for the gather pattern."""
    if idx.numel() == 0:
        return out
    order = torch.argsort(idx, stable=True)
    sorted_idx, sorted_values = idx[order], values[order]
    _, counts = torch.unique_consecutive(sorted_idx, return_counts=True)
    starts = torch.cumsum(counts, 0) - counts
    occurrence = torch.arange(idx.numel(), device=idx.device) - torch.repeat_interleave(starts, counts)
    for k in range(int(counts.max())):
        chosen = occurrence == k
        out.index_add_(0, sorted_idx[chosen], sorted_values[chosen])
    return out


def _sqrt(x: torch.Tensor) -> torch.Tensor:
    """The correctly rounded square root of x (in place where it can): CUDA's is; torch's CPU one
    is not (its vectorized library misses by an ulp on about 0.7% of fp32 entries), NumPy's is."""
    if x.device.type != "cpu":
        return x.sqrt_()
    return torch.from_numpy(np.sqrt(x.contiguous().numpy()))
