"""Top-k with error feedback (docs/algorithms.md#topk).

Each rank sends the k entries of largest magnitude of its accumulated vector ``a = g + e`` and
keeps the rest as its residual. Two aggregations:

* ``pattern="gather"`` (classic): allgather of (index, value) pairs, scatter-add, divide by N.
  Each rank contributes only at its own selection; the aggregate holds between k and N*k entries.
* ``pattern="union"`` (the variant the ExDyna/MiCRO/DEFT authors call Top-k): allgather of the
  indices, then an allreduce of every rank's own values at the union; every rank clears its
  residual on the whole union.

``scope="tensor"`` selects k = density * numel per gradient tensor; ``scope="model"`` selects
over the whole model flattened into one vector.
"""

from __future__ import annotations

from typing import Any, Unpack

from .base import GATHER, MODEL, TENSOR, UNION, Algorithm, StepContext
from .corrections import CorrectionOptions


class TopK(Algorithm):
    """Error-feedback top-k.

    Args:
        density: fraction of entries each rank sends per step, in (0, 1]; k = floor(density * n),
            at least 1.
        pattern: "gather" (classic allgather of pairs) or "union" (index allgather + value
            allreduce at the union).
        scope: "tensor" (k per gradient tensor) or "model" (k over the whole model).
    """

    name = "topk"
    patterns = (GATHER, UNION)
    scopes = (TENSOR, MODEL)
    packs_tensors = True

    def __init__(self, density: float = 0.01, *, pattern: str = GATHER, scope: str = TENSOR,
                 **corrections: Unpack[CorrectionOptions]):
        super().__init__(density, pattern=pattern, scope=scope, **corrections)

    def select_local(self, acc: Any, control: Any, ctx: StepContext) -> Any:
        """The k entries of largest magnitude (ties: docs/algorithms.md#ties), in each tensor of a
        bucket packing per-tensor steps."""
        b, density = ctx.backend, self.step_density(ctx)
        if not ctx.members:
            return b.topk_abs_indices(acc, self.k(ctx.numel, density))
        return b.topk_abs_segments(acc, [(offset, size, self.k(size, density))
                                         for offset, size, _ in self.tensor_segments(ctx)])
