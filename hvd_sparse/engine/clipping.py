"""Local gradient clipping (the ``clip_norm`` correction), before a sparse step accumulates.

Why: at a small k an entry waits many steps in the residual. A gradient burst (an unlucky
batch, a step that just released a large stale value) enters the residual whole and comes out
later, at weights that have moved on, as a larger burst: at ρ = 0.001 on the digits CNN
(38 entries a step) that loop drove the loss to 17-200 and the model to chance
(docs/methods.md#corrections). DGC's rule bounds what one step can put in: each rank scales
its gradient to an L2 norm of at most ``clip_norm / sqrt(N)``, so the average of N independent
clipped gradients has a norm of about ``clip_norm``.

The norm is taken per tensor in a bucket packing per-tensor steps (as in a bucket of its own),
else over the bucket. The gradient is first gathered into a flat fp32 vector of its own (one
pass: the inputs are left as they are, since the faces may write the average into them, and a
TensorFlow bucket's inputs may be a packed set of parts); the accumulation downstream -- kernels,
the momentum correction, the Adam path -- then runs unchanged on it.
"""

from __future__ import annotations

import math
from typing import Any

from ..backends import Backend

# Added to the norm, as DGC's authors do: a zero gradient is never divided by zero.
NORM_EPSILON = 1e-6


def clip_locally(b: Backend, tensors: Any, segments: list[tuple[int, int, str]], clip_norm: float,
                 size: int, like: Any) -> list[Any] | None:
    """The bucket's gradient as one flat vector (the dtype of ``like``, the residual) with each
    segment's L2 norm clipped to ``clip_norm / sqrt(size)``, or None when no segment exceeds it
    or a norm is not finite (the finite check downstream then sees the inputs themselves).
    ``segments``: (offset, numel, key) in the bucket."""
    limit = clip_norm / math.sqrt(size)
    numel = sum(n for _, n, _ in segments)
    grad = b.accumulate(b.zeros(numel, b.dtype_name(like), like=like), tensors)
    parts, clipped = [], False
    for offset, n, _ in segments:
        part = grad if len(segments) == 1 else b.slice(grad, offset, offset + n)
        norm = math.sqrt(b.sum_of_squares(part))
        if not math.isfinite(norm):
            return None
        coefficient = limit / (norm + NORM_EPSILON)
        if coefficient < 1.0:
            part, clipped = b.scale(part, coefficient), True
        parts.append(part)
    if not clipped:
        return None
    return [parts[0] if len(segments) == 1 else b.concat(parts)]
