"""The three communication patterns (docs/architecture.md#communication-patterns), one object each.

A pattern owns everything that differs between them: its phases of named collectives, the values
a rank sends and the residual it leaves, the bytes it moves, and where the average lands for the
reconstruction. Its ``phases`` are written once and read twice: by ``exchange``, which issues the
collectives during a step, and by ``schedule``, which lists them before any data exists (what
TensorFlow's per-tensor graphs are built from), so the two cannot drift apart.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from ..algorithms.base import GATHER, SHARED, UNION, Algorithm, StepContext
from ..backends import Backend, index_dtype_for
from ..comm import ALLGATHER, ALLREDUCE, Collective, Phase, Protocol
from ..errors import ConfigurationError
from .buckets import value_dtype_for

ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8, "int32": 4, "int64": 8}
IDX, VAL = "idx", "val"    # a bucket's collectives: f"{ctx.name}.idx", f"{ctx.name}.val"

# One phase: the (op, part) of each of its collectives, run concurrently.
PhaseSpec = tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class Outgoing:
    """What the engine hands a pattern: this rank's selection and how its values travel."""

    acc: Any                    # gradient + residual
    idx: Any                    # this rank's indices, in the bucket's index dtype
    index_dtype: str
    value_dtype: str            # the values' transport dtype
    poison: bool                # send NaN, so that every rank raises (nonfinite="raise")
    riders: Any                 # Algorithm.piggyback: floats added to a value allreduce, or None
    union: Callable[[Any], Any]  # every rank's indices -> the aggregated set (union pattern)


@dataclass(frozen=True)
class Exchanged:
    """What a pattern's exchange leaves for the engine's residual, statistics and reconstruction."""

    residual: Any               # acc cleared where values were sent (their rounding error kept)
    sent_at: Any                # the indices this rank's values were taken at ...
    values: Any                 # ... and those values, as sent
    received: Any               # the values summed over ranks as they came back, riders split off
    at: Any                     # where the average lands: every rank's indices, or the common set
    average: Any                # fp32, divided by N
    unique: bool                # ``at`` holds no duplicates: the scatter may overwrite
    gathered: Any               # every rank's indices in rank order (StepOutcome.gathered_indices)
    union_size: int | None      # size of the aggregated set where known without extra work
    bytes_sent: int
    bytes_received: int
    riders: Any = None          # the riders' sum over ranks (NumPy)


class Pattern:
    """A fixed sequence of phases of named collectives (see the module docstring)."""

    name: ClassVar[str]
    phases: ClassVar[tuple[PhaseSpec, ...]]

    def schedule(self, name: str, index_dtype: str, value_dtype: str) -> list[list[tuple[str, str, str]]]:
        """The phases ``exchange`` yields for a bucket named ``name``, as (op, name, dtype)."""
        dtypes = {IDX: index_dtype, VAL: value_dtype}
        return [[(op, f"{name}.{part}", dtypes[part]) for op, part in phase] for phase in self.phases]

    def exchange(self, out: Outgoing, ctx: StepContext) -> Protocol:
        """Protocol: send this rank's selection, returning ``Exchanged``."""
        raise NotImplementedError

    def _phase(self, number: int, ctx: StepContext, *tensors: Any) -> Phase:
        """Phase ``number`` of ``phases``, carrying ``tensors``."""
        return [Collective(op, f"{ctx.name}.{part}", tensor)
                for (op, part), tensor in zip(self.phases[number], tensors, strict=True)]

    def _allreduce(self, number: int, ctx: StepContext, values: Any, riders: Any) -> Protocol:
        """Protocol: allreduce ``values`` with the riders appended; returns (values, riders)."""
        (received,) = yield self._phase(number, ctx, _ride(ctx.backend, values, riders))
        return _unride(ctx.backend, received, riders)


class Gather(Pattern):
    """Allgather (index, value) pairs; scatter-add; divide by N."""

    name = GATHER
    phases = (((ALLGATHER, IDX), (ALLGATHER, VAL)),)

    def exchange(self, out: Outgoing, ctx: StepContext) -> Protocol:
        """Allgather indices and values; the average lands where the pairs point."""
        b = ctx.backend
        values, residual = _send(out, out.idx, ctx)
        gathered, received = yield self._phase(0, ctx, out.idx, values)
        selected, pair = b.numel(out.idx), ITEMSIZE[out.index_dtype] + ITEMSIZE[out.value_dtype]
        return Exchanged(residual, out.idx, values, received, gathered, _average(received, ctx),
                         unique=False, gathered=gathered, union_size=None, bytes_sent=selected * pair,
                         bytes_received=(b.numel(gathered) - selected) * pair)


class Union(Pattern):
    """Allgather indices; allreduce every rank's values at their union; divide by N."""

    name = UNION
    phases = (((ALLGATHER, IDX),), ((ALLREDUCE, VAL),))

    def exchange(self, out: Outgoing, ctx: StepContext) -> Protocol:
        """Allgather indices, then allreduce every rank's values on their union."""
        b = ctx.backend
        (gathered,) = yield self._phase(0, ctx, out.idx)
        union = out.union(gathered)
        values, residual = _send(out, union, ctx)
        received, riders = yield from self._allreduce(1, ctx, values, out.riders)
        selected, union_size = b.numel(out.idx), b.numel(union)
        isz, vsz = ITEMSIZE[out.index_dtype], ITEMSIZE[out.value_dtype]
        return Exchanged(residual, union, values, received, union, _average(received, ctx),
                         unique=True, gathered=gathered, union_size=union_size,
                         bytes_sent=selected * isz + union_size * vsz,
                         bytes_received=(b.numel(gathered) - selected) * isz + union_size * vsz,
                         riders=riders)


class Shared(Pattern):
    """Indices agreed without messages; allreduce the values; divide by N."""

    name = SHARED
    phases = (((ALLREDUCE, VAL),),)

    def exchange(self, out: Outgoing, ctx: StepContext) -> Protocol:
        """Allreduce the values on indices every rank knows without a message."""
        values, residual = _send(out, out.idx, ctx)
        received, riders = yield from self._allreduce(0, ctx, values, out.riders)
        selected = ctx.backend.numel(out.idx)
        moved = selected * ITEMSIZE[out.value_dtype]
        return Exchanged(residual, out.idx, values, received, out.idx, _average(received, ctx),
                         unique=True, gathered=out.idx, union_size=selected, bytes_sent=moved,
                         bytes_received=moved, riders=riders)


BY_NAME: dict[str, Pattern] = {pattern.name: pattern for pattern in (Gather(), Union(), Shared())}


def graph_schedule(algorithm: Algorithm, name: str, numel: int, dtypes: tuple[str, ...],
                   dense_pattern: str | None) -> list[list[tuple[str, str, str]]]:
    """The phases of a bucket's step as (op, name, dtype) triples, known before any data is seen:
    what a graph must be built with in advance (TensorFlow per-tensor steps run each phase as
    graph ops). ``dense_pattern``: the pattern of a bucket of ``dense_below`` tensors, which is
    always averaged densely (None: not such a bucket)."""
    if algorithm.select_collectives:
        raise ConfigurationError(
            f"{type(algorithm).__name__} exchanges messages while selecting and runs "
            "only with scope='model' in TensorFlow")
    if numel == 0:  # an empty bucket is returned as it is (Engine.step)
        return []
    corrections = algorithm.corrections
    if dense_pattern is not None:
        pattern = dense_pattern
    elif corrections.dense_steps:
        what = ("the Adam path averages its dense steps densely, which changes" if corrections.adam
                else "dense_steps changes")
        raise ConfigurationError(
            f"{what} the collectives of a step after the first steps, which a TensorFlow graph "
            "built per tensor cannot follow: use scope='model' (one bucket, run eagerly)"
            + ("" if corrections.adam else ", or warmup_steps, which keeps the collectives"))
    else:
        pattern = algorithm.pattern
    return BY_NAME[pattern].schedule(name, index_dtype_for(numel), value_dtype_for(dtypes))


def _send(out: Outgoing, at: Any, ctx: StepContext) -> tuple[Any, Any]:
    """Values to send at ``at``, and the residual left behind (exact error feedback)."""
    b = ctx.backend
    values = b.take(out.acc, at)
    if out.poison:
        values = values + float("nan")
    if out.value_dtype == b.dtype_name(out.acc):
        return values, b.zero_at(out.acc, at)
    sent = b.cast(values, out.value_dtype)
    rounding = values - b.cast(sent, b.dtype_name(out.acc))
    return sent, b.put(out.acc, at, rounding)


def _average(received: Any, ctx: StepContext) -> Any:
    """Summed values as fp32, divided by N (on the k values, not on the dense vector)."""
    values = ctx.backend.cast(received, "float32")
    return ctx.backend.scale(values, 1.0 / ctx.size) if ctx.size > 1 else values


def _ride(b: Backend, values: Any, riders: Any) -> Any:
    """The values with the algorithm's riders appended, on the values' device and dtype."""
    if riders is None:
        return values
    riders = b.from_numpy(b.to_numpy(riders).astype(b.dtype_name(values)), like=values)
    return b.concat([values, riders])


def _unride(b: Backend, received: Any, riders: Any) -> tuple[Any, Any]:
    """Split the allreduced values from the riders' sums (returned as NumPy)."""
    if riders is None:
        return received, None
    total, count = b.numel(received), b.numel(riders)
    summed = b.to_numpy(b.cast(b.slice(received, total - count, total), "float64"))
    return b.slice(received, 0, total - count), summed
