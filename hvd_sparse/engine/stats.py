"""Per-step statistics: recorded cheaply during the step, materialized only when read.

Anything that would cost a device synchronization or an extra pass (the residual norm, the size of
a de-duplicated index set) is kept as a reference and computed when ``stats()`` is called, so a
training loop that never reads statistics pays nothing for them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ..backends import Backend


@dataclass
class StepTimes:
    """Host seconds one bucket's last step spent in each part of the engine's step, on this rank:
    only the time the step's protocol ran, never the time it was suspended on a collective."""

    accumulate: float = 0.0   # a = g + e (with DEFT's norms); 0 where the selection op fuses it
    select: float = 0.0       # the selection (the whole fused accumulate-and-select op where
                              # there is one), without waiting on its own collectives
    select_wait: float = 0.0  # wall time the selection was suspended on its own collectives
                              # (DEFT's bin broadcast): other work of the process runs meanwhile
    exchange: float = 0.0     # the pattern's host work between collectives, the residual update,
                              # the controller's observation
    reconstruct: float = 0.0  # the average written back into the tensors
    engine: float = 0.0       # all the step's protocol ran: the above and the rest (preparation,
                              # the first step's configuration check)

    FIELDS = ("accumulate", "select", "select_wait", "exchange", "reconstruct", "engine")


def sum_times(times: list[StepTimes]) -> dict:
    """``<part>_seconds`` summed over buckets: the keys ``stats()`` reports."""
    return {f"{name}_seconds": sum(getattr(t, name) for t in times) for name in StepTimes.FIELDS}


@dataclass
class BucketStats:
    """What one bucket's last step did on this rank."""

    step: int
    numel: int
    k: int
    selected: int
    bytes_sent: int
    bytes_received: int
    times: StepTimes                   # where the step's host time went (select_seconds: its
                                       # ``select``; for a threshold method with the fused
                                       # accumulate-and-select op, that whole op)
    backend: Backend
    residual: Any = None               # reference; its norm is computed on demand
    union_size: int | None = None      # known exactly (union/shared patterns) ...
    gathered_indices: Any = None       # ... or derived on demand (gather pattern)
    nonfinite_steps: int = 0
    extra: dict = field(default_factory=dict)

    def union(self) -> int:
        """The size of the aggregated index set (computed once, when first asked)."""
        if self.union_size is None:
            self.union_size = self.backend.numel(self.backend.unique(self.gathered_indices))
            self.gathered_indices = None
        return self.union_size

    def residual_sq(self) -> float:
        """The squared norm of the residual after the step."""
        return 0.0 if self.residual is None else self.backend.sum_of_squares(self.residual)


def summarize(buckets: list[BucketStats], density_target: float) -> dict:
    """The last step over all buckets: the dict every compressor's ``stats()`` returns."""
    if not buckets:
        return {"step": 0, "density_target": density_target, "density_actual": 0.0, "k": 0,
                "selected": 0, "union": 0, "buildup": 0.0, "numel": 0, "bytes_sent": 0,
                "bytes_received": 0, "residual_norm": 0.0, "buckets": 0, "nonfinite_steps": 0,
                "bytes_sent_total": 0, "bytes_received_total": 0, "dense_bytes_total": 0,
                **sum_times([])}
    numel = sum(b.numel for b in buckets)
    union = sum(b.union() for b in buckets)
    k = sum(b.k for b in buckets)
    out = {
        "step": max(b.step for b in buckets),
        "density_target": density_target,
        "density_actual": union / numel,
        "k": k,
        "selected": sum(b.selected for b in buckets),
        "union": union,
        "buildup": union / k,
        "numel": numel,
        "bytes_sent": sum(b.bytes_sent for b in buckets),
        "bytes_received": sum(b.bytes_received for b in buckets),
        **sum_times([b.times for b in buckets]),
        "residual_norm": math.sqrt(sum(b.residual_sq() for b in buckets)),
        "buckets": len(buckets),
        "nonfinite_steps": sum(b.nonfinite_steps for b in buckets),
    }
    if len(buckets) == 1:
        out.update(buckets[0].extra)
    else:  # scalars every bucket reports (e.g. a per-tensor threshold): their mean
        shared = set.intersection(*(set(b.extra) for b in buckets))
        for key in sorted(shared):
            values = [b.extra[key] for b in buckets]
            if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
                out[key] = sum(values) / len(values)
    return out


def last_step_stats(algorithm: Any, buckets: list[Any], last: int, controls: dict) -> dict:
    """An engine's last step (``last``), summed over its buckets against the step's target (during
    dense steps and a warm-up, the schedule's), with the method's own figures from ``controls``
    (the buckets it ran on)."""
    target = algorithm.corrections.density_at(algorithm.density, max(last, 0))
    out = summarize([bk.stats for bk in buckets if bk.stats is not None], target)
    out.update(algorithm.model_stats(controls))
    return out
