"""What each rank puts into collectives in one step: recorded from the engine, or derived from a
method's plan and pattern at any N.

Recorded (``RecordingGroup``): the local driver (comm/local.py) with every executed phase kept
as data -- each collective's op and the bytes each rank contributed. This is what the engine
really issues, at the N the simulator can hold.

Derived (``steady_traffic``): the same phases written from what decides them -- the method's
plan of the model into buckets, its pattern (docs/architecture.md#communication-patterns) and
its k -- for the steady state (after warm-up, threshold settled at the target density), so any
N and any model size can be priced. Each rank of an exclusive method (ExDyna, MiCRO, DEFT)
sends k/N of a bucket's k and the union is k; every other method's rank sends k, and a gather
brings N·k pairs to every rank. The tests hold the two against each other. A collective
issued only every few steps (the Adam path's refresh of a shared second moment) is one
``Transfer`` with ``every`` > 1: the step it prices is the mean step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..algorithms.base import GATHER, SHARED, UNION, Algorithm
from ..comm.local import LocalGroup
from ..comm.protocol import ALLGATHER, ALLREDUCE, BROADCAST, Collective
from ..engine.patterns import ITEMSIZE
from ..engine.planning import PACKED_BUCKET_ENTRIES, pack_tensors, plan_buckets

INDEX_BYTES = ITEMSIZE["int32"]     # the engine's default index and value dtypes
VALUE_BYTES = DENSE_BYTES = ITEMSIZE["float32"]   # a dense fp32 allreduce (Horovod's fp16: 2)


@dataclass(frozen=True)
class Transfer:
    """One collective: its op and each participating rank's contribution in bytes, issued once
    every ``every`` steps (a mean step counts 1/every of it)."""

    op: str
    parts: tuple[int, ...]
    name: str = ""
    every: int = 1


@dataclass(frozen=True)
class BucketTraffic:
    """A bucket's step: the tensors it waits for (``members``, model order indices), the entries
    one rank's selection reads (``scanned``) and its phases, in order."""

    name: str
    members: tuple[int, ...]
    numel: int
    scanned: int
    phases: tuple[tuple[Transfer, ...], ...]


class RecordingGroup(LocalGroup):
    """The local driver, keeping every executed phase (``phases``) as ``Transfer``s."""

    def __init__(self, size: int, backend: Any = "numpy"):
        super().__init__(size, backend)
        self.phases: list[tuple[Transfer, ...]] = []

    def _execute(self, phases: list[list[Collective] | None]) -> list[list]:
        outputs = super()._execute(phases)   # checks agreement first
        issued = [phase for phase in phases if phase is not None]
        self.phases.append(tuple(
            Transfer(first.op, tuple(self._nbytes(rank_phase[i].tensor) for rank_phase in issued),
                     first.name)
            for i, first in enumerate(issued[0])))
        return outputs

    def _nbytes(self, tensor: Any) -> int:
        return self.backend.numel(tensor) * ITEMSIZE[self.backend.dtype_name(tensor)]


def dense_traffic(sizes: list[int], size: int, itemsize: int = DENSE_BYTES,
                  fusion_bytes: int = 64 << 20) -> list[BucketTraffic]:
    """Dense training as Horovod runs it: the gradients, in backward order, fused into buffers of
    at most ``fusion_bytes`` (``HOROVOD_FUSION_THRESHOLD``, 64 MiB; a larger tensor alone), one
    allreduce each."""
    groups: list[list[int]] = [[]]
    held = 0
    for i in reversed(range(len(sizes))):
        if groups[-1] and held + sizes[i] * itemsize > fusion_bytes:
            groups.append([])
            held = 0
        groups[-1].append(i)
        held += sizes[i] * itemsize
    out = []
    for number, members in enumerate(groups):
        numel = sum(sizes[j] for j in members)
        allreduce = Transfer(ALLREDUCE, (numel * itemsize,) * size, f"dense{number}")
        out.append(BucketTraffic(f"dense{number}", tuple(members), numel, 0, ((allreduce,),)))
    return out


def steady_traffic(algorithm: Algorithm, sizes: list[int], size: int, buildup: float | None = None,
                   packed: bool = True) -> list[BucketTraffic]:
    """The method's steady-state step on a model of tensors ``sizes`` (model order) at ``size``
    ranks: its own plan (buckets, small tensors averaged densely), pattern and k. ``packed``:
    per-tensor steps packed as the PyTorch faces pack them (``planning.pack_tensors``: the same
    decisions, fewer collectives). ``buildup`` (union / k) sizes the value allreduce of a
    non-exclusive method in the union pattern; None: ``size``, no overlap (the upper bound)."""
    keys = [f"t{i}" for i in range(len(sizes))]
    position = {key: i for i, key in enumerate(keys)}
    plan = plan_buckets(algorithm, keys, sizes)
    single = {name for name, _ in plan}
    if packed:
        plan = pack_tensors(algorithm, plan, dict(zip(keys, sizes, strict=True)),
                            dict.fromkeys(keys, "float32"), PACKED_BUCKET_ENTRIES)
    out = []
    for bucket, members in plan:
        index = tuple(position[m] for m in members)
        numel = sum(sizes[i] for i in index)
        if all(algorithm.corrections.is_dense_tensor(sizes[i]) for i in index):
            out += [BucketTraffic(bucket, index, numel, 0,
                                  ((Transfer(ALLREDUCE, (numel * DENSE_BYTES,) * size, bucket),),))]
            continue
        # a packed bucket makes each member's decisions: its k is theirs summed
        k = algorithm.k(numel) if bucket in single else sum(algorithm.k(sizes[i]) for i in index)
        union = k if algorithm.exclusive else min(numel, round(k * (size if buildup is None else buildup)))
        phases = _phases(algorithm, bucket, k, union, size)
        refresh = algorithm.corrections.second_moment_refresh
        if refresh:   # the shared second moment's dense allreduce, before the selection
            phases = ((Transfer(ALLREDUCE, (numel * DENSE_BYTES,) * size, f"{bucket}.v", refresh),), *phases)
        if algorithm.name == "deft":   # the rotating master's assignment, every step
            phases = ((Transfer(BROADCAST, (_deft_assignment_bytes(algorithm, [sizes[i] for i in index],
                                                                   size),) * size, f"{bucket}.assign"),),
                      *phases)
        out.append(BucketTraffic(bucket, index, numel, _scanned(algorithm, numel, size), phases))
    return out


def _scanned(algorithm: Algorithm, numel: int, size: int) -> int:
    """Entries one rank's selection reads beyond the accumulation: its partition (exclusive
    methods), else the whole bucket."""
    return -(-numel // size) if algorithm.exclusive else numel


def _phases(algorithm: Algorithm, bucket: str, k: int, union: int,
            size: int) -> tuple[tuple[Transfer, ...], ...]:
    """A sparse bucket's phases in its pattern, each rank sending ``k / size`` (exclusive) or
    ``k`` entries, the values of the union pattern allreduced at ``union`` entries."""
    own = -(-k // size) if algorithm.exclusive else k
    idx = Transfer(ALLGATHER, (own * INDEX_BYTES,) * size, f"{bucket}.idx")
    pattern = algorithm.pattern
    if pattern == GATHER:
        return ((idx, Transfer(ALLGATHER, (own * VALUE_BYTES,) * size, f"{bucket}.val")),)
    if pattern == SHARED:
        return ((Transfer(ALLREDUCE, (own * VALUE_BYTES,) * size, f"{bucket}.val"),),)
    if pattern != UNION:
        raise ValueError(f"unknown pattern {pattern!r}")
    return ((idx,), (Transfer(ALLREDUCE, (union * VALUE_BYTES,) * size, f"{bucket}.val"),))


def _deft_assignment_bytes(algorithm: Algorithm, sizes: list[int], size: int) -> int:
    """DEFT's broadcast: int32 bin sizes (N), unit ids and, with ``agreed_k``, per-unit k."""
    from ..algorithms.deft import build_unit_table

    units = len(build_unit_table(sizes, size))
    return 4 * (size + units * (2 if getattr(algorithm, "agreed_k", False) else 1))


def bytes_per_rank(traffic: list[BucketTraffic], rank: int = 0) -> float:
    """What one rank puts into collectives in a (mean) step."""
    return sum(t.parts[rank] / t.every for bucket in traffic for phase in bucket.phases for t in phase)
