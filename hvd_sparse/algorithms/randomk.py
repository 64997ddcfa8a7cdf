"""Random-k with error feedback (docs/algorithms.md#randomk).

Each rank sends k = floor(density * n) entries of its accumulated vector ``a = g + e`` drawn
uniformly without replacement, and keeps the rest as its residual. Two modes:

* ``shared_seed=False`` (paper mode, pattern "gather"): every rank draws its own indices, so the
  ranks' sets overlap only by chance; allgather of (index, value) pairs, scatter-add, divide by
  N. The aggregate holds between k and N*k entries (build-up).
* ``shared_seed=True`` (pattern "shared"): every rank draws the *same* indices, so no index is
  sent at all -- only an allreduce of the k values -- and there is no build-up. (The authors'
  ``RandomKSameECCompressor`` never re-seeds, so it is not actually "same"; this option does what
  its name promises.)

The draw is made on the host with NumPy from a seed built from ``seed``, the step, the bucket's
name and -- unless ``shared_seed`` -- the rank, then moved to the framework's device. The indices
are therefore the same whatever the framework, reproducible from run to run, and resume exactly
from a checkpoint (the step is part of it).

With error feedback no n/k rescaling is applied (that is only for the unbiased variant without
a residual, which hvd_sparse does not offer).
"""

from __future__ import annotations

import zlib
from typing import Any, Unpack

import numpy as np

from ..errors import ConfigurationError
from .base import GATHER, MODEL, SHARED, TENSOR, Algorithm, StepContext
from .corrections import CorrectionOptions


def bucket_seed(key: str) -> int:
    """A 32-bit number for a bucket name, identical in every process (unlike ``hash``)."""
    return zlib.crc32(key.encode())


class RandomK(Algorithm):
    """Error-feedback random-k.

    Args:
        density: fraction of entries each rank sends per step, in (0, 1]; k = floor(density * n),
            at least 1.
        seed: non-negative integer; the draws depend on it, the step and the bucket (and the rank
            unless ``shared_seed``).
        shared_seed: every rank draws the same indices and only values are allreduced.
        scope: "tensor" (k per gradient tensor) or "model" (k over the whole model).
    """

    name = "randomk"
    patterns = (GATHER, SHARED)
    scopes = (TENSOR, MODEL)
    packs_tensors = True

    def __init__(self, density: float = 0.01, *, seed: int = 0, shared_seed: bool = False,
                 scope: str = TENSOR, **corrections: Unpack[CorrectionOptions]):
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
            raise ConfigurationError(f"seed must be a non-negative integer, got {seed!r}")
        if not isinstance(shared_seed, bool):
            raise ConfigurationError(f"shared_seed must be True or False, got {shared_seed!r}")
        super().__init__(density, pattern=SHARED if shared_seed else GATHER, scope=scope, **corrections)
        self.seed = int(seed)
        self.shared_seed = shared_seed

    def draw(self, ctx: StepContext) -> np.ndarray:
        """This step's indices (sorted int64) for the bucket, as NumPy: each tensor's own draw in
        a bucket packing per-tensor steps, seeded by the tensor's key as in a bucket of its own."""
        density = self.step_density(ctx)
        parts = [offset + self._draw(ctx, key, size, density)
                 for offset, size, key in self.tensor_segments(ctx)]
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def _draw(self, ctx: StepContext, key: str, numel: int, density: float) -> np.ndarray:
        """k of ``numel`` indices, sorted, from the stream of (seed, rank unless shared, step, key)."""
        stream = 0 if self.shared_seed else ctx.rank + 1
        rng = np.random.default_rng([self.seed, stream, ctx.step, bucket_seed(key)])
        k = self.k(numel, density)
        if k >= numel:
            return np.arange(numel, dtype=np.int64)
        return np.sort(rng.choice(numel, size=k, replace=False)).astype(np.int64)

    def select_local(self, acc: Any, control: Any, ctx: StepContext) -> Any:
        """The step's random indices (``draw``)."""
        return ctx.backend.from_numpy(self.draw(ctx), like=acc)
