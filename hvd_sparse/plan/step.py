"""A training step's time, composed: computation, selection and collectives on the critical
path each method has.

The backward pass computes the gradients from the last tensor to the first; a bucket can start
once all its tensors are computed. Horovod's face and the DDP hook run a bucket's accumulation
and selection in the gradient's hook, on the computing thread (``select`` below lengthens the
backward pass), and hand its collectives to one background channel that runs them one after
another (Horovod's background thread; a NCCL stream). The step ends when the last collective and
the backward pass have both ended, plus the optimizer's update:

    ready_b   = end of the backward pass through b's last tensor (+ every earlier bucket's select)
    start_b   = max(ready_b + select_b, end_(b-1))
    end_b     = start_b + sum of b's collectives' seconds (network.py)
    step      = forward + max(backward + all selects, end_last) + update

A method in whole-model scope (ExDyna, MiCRO, DEFT) has one bucket, ready at the end of the
backward pass: nothing overlaps. Per-tensor and grouped scopes (LAGS, top-k per tensor, dense
allreduce buffers) overlap their early buckets' communication with the rest of the backward pass.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from .network import Network
from .traffic import BucketTraffic


@dataclass(frozen=True)
class ComputeProfile:
    """Seconds of one rank's forward pass, each tensor's share of the backward pass (model
    order) and the optimizer's update; ``straggler``: how much later than the mean the slowest
    rank ends its backward pass (every collective waits for it)."""

    forward: float
    backward: tuple[float, ...]
    update: float = 0.0
    straggler: float = 0.0

    @classmethod
    def proportional(cls, sizes: Sequence[int], forward: float, backward: float,
                     update: float = 0.0, straggler: float = 0.0) -> ComputeProfile:
        """The backward pass spread over tensors by their sizes (an assumption: the arithmetic
        of a layer's backward grows with its parameters, which holds for dense and recurrent
        layers and is rough for convolutions and attention)."""
        total = sum(sizes)
        return cls(forward, tuple(backward * s / total for s in sizes), update, straggler)


class SelectsBuckets(Protocol):
    """What the step needs of a selection cost model: one rank's seconds for a bucket."""

    def seconds(self, bucket: BucketTraffic) -> float:
        """One rank's seconds to accumulate and select ``bucket``."""
        ...


@dataclass(frozen=True)
class SelectionCost:
    """Per-element seconds of one rank's selection: ``accumulate`` over every entry of a bucket
    (the pass ``a = g + e``, the memory floor) and ``scan`` over the entries the method reads to
    select (``BucketTraffic.scanned``: the rank's partition, or the whole bucket)."""

    accumulate: float
    scan: float

    def seconds(self, bucket: BucketTraffic) -> float:
        """Seconds to accumulate and select ``bucket`` (none for a dense bucket)."""
        if bucket.scanned == 0:
            return 0.0
        return self.accumulate * bucket.numel + self.scan * bucket.scanned


@dataclass(frozen=True)
class StepTime:
    """A step's seconds and its parts; ``exposed`` is the communication the backward pass did
    not hide."""

    total: float
    compute: float
    select: float
    comm: float
    exposed: float


def step_time(profile: ComputeProfile, traffic: list[BucketTraffic], network: Network,
              selection: SelectsBuckets | None = None) -> StepTime:
    """The step's time on the critical path of the module docstring, on the slowest rank (its
    backward pass ``straggler`` seconds longer, spread over it); a collective issued every few
    steps (``Transfer.every``) counts in the mean step by its share."""
    order = sorted(traffic, key=lambda b: min(b.members), reverse=True)   # backward: last first
    total = sum(profile.backward)
    stretch = 1.0 + profile.straggler / total if total > 0 else 1.0
    done = [t * stretch for t in _backward_finish_times(profile.backward)]
    channel = select_total = comm_total = 0.0
    for bucket in order:
        select = selection.seconds(bucket) if selection is not None else 0.0
        ready = done[min(bucket.members)] + select_total + select
        select_total += select
        comm = sum(network.seconds(t.op, t.parts) / t.every for phase in bucket.phases for t in phase)
        comm_total += comm
        channel = max(ready, channel) + comm
    backward = total * stretch + select_total
    end = max(backward, channel)
    return StepTime(profile.forward + end + profile.update, profile.forward + total * stretch
                    + profile.update, select_total, comm_total, end - backward)


def _backward_finish_times(backward: Sequence[float]) -> list[float]:
    """When the backward pass has computed each tensor's gradient (it runs last to first)."""
    finish = [0.0] * len(backward)
    elapsed = 0.0
    for i in reversed(range(len(backward))):
        elapsed += backward[i]
        finish[i] = elapsed
    return finish
