"""Local gradient clipping (the ``clip_norm`` correction), before a sparse step accumulates.

Why: at a small k an entry waits many steps in the residual. A gradient burst (an unlucky
batch, a step that just released a large stale value) enters the residual whole and comes out
later, at weights that have moved on, as a larger burst: at ρ = 0.001 on the digits CNN
(38 entries a step) that loop drove the loss to 17-200 and the model to chance
(docs/methods.md#corrections). DGC's rule bounds what one step can put in: each rank scales
its gradient to an L2 norm of at most ``clip_norm / sqrt(N)``, so the average of N independent
clipped gradients has a norm of about ``clip_norm``.

The norm is taken per tensor in a bucket packing per-tensor steps (as in a bucket of its own),
else over the bucket. Clipped tensors are new fp32 tensors (the inputs are left as they are:
the faces may write the average into them), so the accumulation downstream -- kernels, the
momentum correction, the Adam path -- runs unchanged on them.
"""

from __future__ import annotations

import math
from typing import Any

from ..backends import Backend

# Added to the norm, as DGC's authors do: a zero gradient is never divided by zero.
NORM_EPSILON = 1e-6


def clip_locally(b: Backend, tensors: list[Any], segments: list[tuple[int, int, str]], clip_norm: float,
                 size: int, dtype: str) -> list[Any] | None:
    """The tensors with each segment's L2 norm clipped to ``clip_norm / sqrt(size)`` (those
    of unclipped segments as they were), or None when no segment exceeds it or a norm is not
    finite (the finite check downstream then sees the inputs themselves). ``segments``:
    (offset, numel, key) in the bucket, each covering whole tensors."""
    limit = clip_norm / math.sqrt(size)
    sizes = [b.numel(t) for t in tensors]
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    out, clipped = list(tensors), False
    for offset, numel, _ in segments:
        members = [i for i, start in enumerate(starts) if offset <= start < offset + numel]
        norm = math.sqrt(sum(b.sum_of_squares(b.flat(tensors[i])) for i in members))
        if not math.isfinite(norm):
            return None
        coefficient = limit / (norm + NORM_EPSILON)
        if coefficient < 1.0:
            clipped = True
            for i in members:
                out[i] = b.scale(_own_copy(b, tensors[i], dtype), coefficient)
    return out if clipped else None


def _own_copy(b: Backend, tensor: Any, dtype: str) -> Any:
    """``tensor`` flat in ``dtype``, in memory of its own (the backends' ``scale`` may work in
    place)."""
    flat = b.cast(b.flat(tensor), dtype)
    return b.copy(flat) if b.dtype_name(tensor) == dtype else flat
