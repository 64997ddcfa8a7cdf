"""The plain average as a pseudo-method: every entry allreduced, nothing kept back.

Not a compressor a user picks: the engine runs it for the steps and tensors the corrections
average densely (``dense_steps``, ``dense_below``: algorithms/corrections.py), and the simulator
runs it as the dense baseline, both on the same code path as the sparsifiers.
"""

from __future__ import annotations

from typing import Any

from .base import MODEL, SHARED, TENSOR, Algorithm, StepContext

DENSE = "dense"


class DenseAverage(Algorithm):
    """Every entry, through the shared pattern (one allreduce of the bucket's values): the
    residual stays at what lower-precision transport rounds off, the result is Σ gradients / N."""

    name = DENSE
    patterns = (SHARED,)
    scopes = (MODEL, TENSOR)

    def __init__(self, density: float = 1.0, *, scope: str = MODEL):
        super().__init__(1.0, scope=scope)

    def select_local(self, acc: Any, control: Any, ctx: StepContext) -> Any:
        """Every index: the plain average."""
        return ctx.backend.arange(0, ctx.numel, like=acc)
