"""What the Triton kernels share: magnitude keys, launch sizes and argument checks.

Every comparison of magnitudes is made on integer keys, never on floats: a float's bits with the
sign cleared, read as an integer of the same width, order exactly as |x| does for every non-NaN
value (and -0 and +0 get the same key); every NaN is mapped to the one key just above +Inf. So a
threshold test ``|a| >= T`` is ``key(T) <= key(a) < NAN_KEY`` and the top-k order (NaN above
+Inf, -0 == +0) is the integer order of the keys, with no float scalar passed to a kernel (Triton
would pass a Python float as fp32, which is wrong for fp64 data).
"""

from __future__ import annotations

import contextlib
import math

import torch
import triton
import triton.language as tl

from hvd_sparse.backends.exact import MAGNITUDE_KEYS

# Elements per program in the elementwise kernels, and at most this many programs in the radix
# histogram passes (each loops over several blocks, then adds its 256 bins to the global histogram
# with one atomic per bin). Module attributes so that tests can shrink them to get several blocks
# and loop iterations out of a few thousand elements in the interpreter.
BLOCK = 1024
HISTOGRAM_PROGRAMS = 1024

FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
RESIDUALS = (torch.float32, torch.float64)
INDICES = (torch.int32, torch.int64)


def nan_key(dtype: torch.dtype) -> int:
    """The key every NaN of ``dtype`` gets: one above the key of +Inf (base.MAGNITUDE_KEYS, the
    keys every backend orders magnitudes by)."""
    return MAGNITUDE_KEYS[str(dtype).removeprefix("torch.")][2]


def _bits(value: torch.Tensor) -> int:
    """A one-element float tensor's bits, read as a signed integer of its width."""
    integer = MAGNITUDE_KEYS[str(value.dtype).removeprefix("torch.")][0]
    return int(value.view(getattr(torch, integer)).item())


def threshold_key(threshold: float, dtype: torch.dtype) -> int:
    """The smallest key that passes ``|a| >= threshold`` for ``a`` of ``dtype``.

    The threshold is first rounded to ``dtype`` (to nearest, as torch and NumPy compare a tensor
    with a Python float); a threshold <= 0 passes every non-NaN value, a NaN one passes nothing."""
    rounded = torch.tensor(threshold, dtype=torch.float64).to(dtype)
    if math.isnan(float(rounded)):
        return nan_key(dtype)
    if float(rounded) <= 0:
        return 0
    return _bits(rounded)


def float_bits(value: float, dtype: torch.dtype) -> int:
    """The bits of ``value`` rounded to nearest in ``dtype`` (fp32 or fp64), as a signed integer:
    how a float scalar reaches a kernel exactly (a kernel bitcasts it back)."""
    return _bits(torch.tensor(value, dtype=torch.float64).to(dtype))


@triton.jit
def capped_key(x, NAN_KEY: tl.constexpr):
    """Integer key of |x| (int32 for 16- and 32-bit floats, int64 for fp64), every NaN at
    NAN_KEY. One function, not two: each call of a jit function costs in the interpreter."""
    if x.dtype.primitive_bitwidth == 64:
        key = x.to(tl.int64, bitcast=True) & 0x7FFFFFFFFFFFFFFF
    elif x.dtype.primitive_bitwidth == 32:
        key = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    else:
        key = x.to(tl.int16, bitcast=True).to(tl.int32) & 0x7FFF
    return tl.minimum(key, NAN_KEY)


def blocks(n: int, block: int) -> int:
    return -(-n // block)


def on_device(device: torch.device) -> contextlib.AbstractContextManager:
    """Triton launches on the current CUDA device: make it the tensors' own (a rank's tensors may
    live on another GPU than the current one)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def same_device(tensors: list[torch.Tensor], device: torch.device) -> bool:
    return all(t.device == device for t in tensors)
