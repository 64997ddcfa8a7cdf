"""One rank's sparsification engine: error feedback, communication patterns, reconstruction.

A *bucket* is a named list of gradient tensors sparsified as one flat vector: one tensor (scope
"tensor"), the whole model (scope "model"), or a merged group of layers. For each bucket and step
``Engine.step`` returns a protocol (comm/protocol.py) that

0. lets the algorithm fix the step's selection domain before any data is read
   (``Algorithm.prepare``: ExDyna moves its partition boundaries there),
1. accumulates ``acc = gradient + residual`` into the bucket's fp32 residual buffer (in place
   where the backend allows),
2. asks the algorithm for this rank's indices -- for threshold methods in the same pass as step 1
   (``Algorithm.accumulate_select``, one backend op that a kernel fuses),
3. exchanges them with one of the three patterns (algorithms/base.py: gather, union, shared),
4. reconstructs the average over ranks as a dense vector and cuts it back into tensors,
5. keeps what was not sent as the new residual -- exactly: on every index,
   ``sent + new residual == gradient + old residual`` (values travelling in a lower precision
   than the residual leave their rounding error in the residual),
6. lets the algorithm's controller observe what was exchanged, and records statistics.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..algorithms.base import (
    GATHER,
    SHARED,
    UNION,
    Algorithm,
    StepContext,
    StepEnd,
    StepOutcome,
    check_choice,
)
from ..backends import Backend, index_dtype_for
from ..comm import ALLGATHER, ALLREDUCE, Collective, Protocol
from ..errors import ConfigurationError, RankMismatchError, UnsupportedTensorError
from .agreement import Layout, agree, config_fields
from .stats import BucketStats, summarize

_ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8, "int32": 4, "int64": 8}
# Dtypes Horovod 0.28.1 can move in collectives (no bfloat16: docs/architecture.md#transport-dtypes).
_TRANSPORTABLE = ("float16", "float32", "float64")
_FLOATS = ("float16", "bfloat16", "float32", "float64")

STATE_FORMAT = 1
# What a rank does with a NaN/Inf gradient: send zeros and keep its residual ("skip", with a
# warning), make every rank raise ("raise"), or not look (no check at all: "ignore").
NONFINITE_POLICIES = ("skip", "raise", "ignore")


@dataclass
class Bucket:
    """Everything one rank keeps about one bucket across steps."""

    key: str
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    numel: int
    residual: Any
    value_dtype: str
    index_dtype: str
    sizes: tuple[int, ...] = ()     # element count of each tensor, in bucket order
    step: int = 0
    control: Any = None
    stats: BucketStats | None = None
    nonfinite_steps: int = 0
    sent: tuple | None = None       # (indices, values) of the last step, for take_back


def check_gradient_dtype(key: str, dtype: str) -> None:
    """Refuse a gradient the engine cannot sparsify; faces call it before any collective (at
    trace time in TensorFlow) so every rank fails at the same point."""
    if dtype not in _FLOATS:
        raise UnsupportedTensorError(
            f"gradient {key!r} has dtype {dtype}; sparsification needs real floating-point "
            "gradients (float16, bfloat16, float32, float64): cast the parameter, or leave it out "
            "of the compressed optimizer")


def value_dtype_for(dtypes: tuple[str, ...]) -> str:
    """Values travel in the gradients' own precision when Horovod can move it, else fp32."""
    common = set(dtypes)
    if len(common) == 1 and dtypes[0] in _TRANSPORTABLE:
        return dtypes[0]
    return "float32"


class Engine:
    """Per-rank state of every bucket, and the step protocol (see module docstring)."""

    def __init__(self, algorithm: Algorithm, backend: Backend, rank: int, size: int,
                 prefix: str = "hvd_sparse", nonfinite: str = "skip", write_into_inputs: bool = False):
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} outside a world of size {size}")
        self.nonfinite = check_choice("nonfinite", nonfinite, NONFINITE_POLICIES)
        # The averaged gradient may overwrite the input tensors (their content is in the residual
        # by then): no dense allocation per step. Only for callers that own the inputs.
        self.write_into_inputs = write_into_inputs
        self.algorithm = algorithm
        self.backend = backend
        self.rank = rank
        self.size = size
        self.prefix = prefix
        self.buckets: dict[str, Bucket] = {}
        self._restored: dict[str, dict] = {}
        self._restored_size: int | None = None
        self._agreed: set[str] = set()   # buckets whose configuration every rank has checked

    # --- the step ------------------------------------------------------------------------------
    def step(self, key: str, tensors: list[Any], check_layout: bool = True) -> Protocol:
        """Protocol of one step of bucket ``key``; returns the averaged tensors, shaped like
        ``tensors`` (the same tensor objects, overwritten, with ``write_into_inputs``). With
        ``check_layout`` the first step also checks, unless ``agree_on_config`` already covered
        the bucket, that every rank runs the same method and options on a bucket of the same
        layout (one tiny allgather), so a configuration that differs across ranks fails loudly.
        An empty bucket (a zero-size parameter) is returned as it is, without any collective."""
        b = self.backend
        if all(b.numel(t) == 0 for t in tensors):
            return list(tensors)
        bucket = self._bucket(key, tensors)
        bucket.sent = None
        name = f"{self.prefix}.{key}"
        if check_layout and not self._agreed & {key, "*"} and self.size > 1:
            yield from self.agree_on_config(self.layout_of(key, tensors), [key], like=bucket.residual)
        self._agreed.add(key)
        ctx = StepContext(self.rank, self.size, bucket.step, key, bucket.numel, b, name, bucket.sizes)
        if bucket.control is None:
            bucket.control = self.algorithm.init_control(ctx)
        yield from self.algorithm.prepare(bucket.control, ctx)

        # A rank whose gradient is not finite still takes part in every collective (skipping one
        # would hang the others) but sends zeros -- or NaN, so every rank raises -- and keeps its
        # residual as it was: checked before the accumulation writes the residual. Threshold
        # methods accumulate and select in one op, which checks first; with write_into_inputs it
        # clears the inputs in the same pass, so the reconstruction writes only the selection.
        check = self.nonfinite != "ignore"
        started = time.perf_counter()
        fused = self.algorithm.accumulate_select(bucket.residual, tensors, bucket.control, ctx,
                                                 self.write_into_inputs, check)
        if fused is None:
            finite = not check or b.tensors_finite(tensors)
            if finite:
                acc = self.algorithm.accumulate(bucket.residual, tensors, bucket.control, ctx)
        else:
            acc, idx, finite = fused
        cleared = fused is not None and finite and self.write_into_inputs
        if not finite:
            fused = None   # select from zeros, as every method does on such a step
            acc = b.zeros(bucket.numel, b.dtype_name(bucket.residual), like=bucket.residual)
            bucket.nonfinite_steps += 1
            if self.nonfinite == "skip":
                warnings.warn(f"hvd_sparse: non-finite gradient in {key!r} on rank {self.rank} at "
                              f"step {bucket.step}: this rank sends zeros and keeps its residual",
                              RuntimeWarning, stacklevel=2)
        poison = not finite and self.nonfinite == "raise"

        if fused is None:
            started = time.perf_counter()
            idx = yield from self.algorithm.select(acc, bucket.control, ctx)
        if b.numel(idx) == 0:  # an empty collective can hang: docs/architecture.md#collective-rules
            idx = self.algorithm.fallback(bucket.control, ctx)
            idx = b.from_numpy(b.to_numpy(idx), like=acc)  # on the gradient's device (a GPU)
        selected = b.numel(idx)
        select_seconds = time.perf_counter() - started
        idx = b.cast(idx, bucket.index_dtype)
        extra = self.algorithm.piggyback(bucket.control, ctx)
        riders = None

        pattern = self.algorithm.pattern
        isz, vsz = _ITEMSIZE[bucket.index_dtype], _ITEMSIZE[bucket.value_dtype]
        union_size = None
        if pattern == GATHER:
            values, acc = self._send(bucket, acc, idx, poison)
            all_idx, received = yield [Collective(ALLGATHER, f"{name}.idx", idx),
                                       Collective(ALLGATHER, f"{name}.val", values)]
            gathered = b.numel(all_idx)
            result = (all_idx, self._average(received), False)
            bytes_sent = selected * (isz + vsz)
            bytes_received = (gathered - selected) * (isz + vsz)
        elif pattern == UNION:
            (all_idx,) = yield [Collective(ALLGATHER, f"{name}.idx", idx)]
            gathered = b.numel(all_idx)
            union = self.algorithm.union_indices(all_idx, bucket.control, ctx)
            union_size = b.numel(union)
            values, acc = self._send(bucket, acc, union, poison)
            (received,) = yield [Collective(ALLREDUCE, f"{name}.val", self._ride(values, extra))]
            received, riders = self._unride(received, extra)
            result = (union, self._average(received), True)
            bytes_sent = selected * isz + union_size * vsz
            bytes_received = (gathered - selected) * isz + union_size * vsz
        elif pattern == SHARED:
            values, acc = self._send(bucket, acc, idx, poison)
            (received,) = yield [Collective(ALLREDUCE, f"{name}.val", self._ride(values, extra))]
            received, riders = self._unride(received, extra)
            all_idx, union_size = idx, selected
            result = (idx, self._average(received), True)
            bytes_sent = bytes_received = selected * vsz
        else:  # pragma: no cover  (patterns are validated by Algorithm.__init__)
            raise ConfigurationError(f"unknown pattern {pattern!r}")
        sent_at = idx if pattern == GATHER else result[0]
        if self.nonfinite == "raise" and not b.all_finite(received):
            if finite:  # nothing of the step is applied: the residual keeps all of g + e
                bucket.residual = self._put_back(acc, sent_at, values)
            raise FloatingPointError(
                f"hvd_sparse: non-finite gradient in {key!r} at step {bucket.step} on at least one "
                "rank (raised on every rank; this step was applied nowhere and every rank keeps its "
                "residual, the step counter unchanged). In PyTorch training can go on: catch it "
                "around optimizer.step(), then call optimizer.load_state_dict(optimizer.state_dict()) "
                "and optimizer.zero_grad() (README, 'Non-finite gradients'). Or pass "
                "nonfinite='skip' to drop such a rank's contribution for the step instead")
        if finite:
            bucket.residual = acc
        bucket.sent = (sent_at, values) if finite and self.nonfinite == "raise" else None

        target_k = self.algorithm.target_k(bucket.control, ctx)
        bucket.control = self.algorithm.observe(
            bucket.control, StepOutcome(selected, union_size, all_idx, idx, riders), ctx)
        bucket.step += 1
        bucket.stats = BucketStats(
            step=bucket.step, numel=bucket.numel, k=target_k,
            selected=selected, bytes_sent=bytes_sent, bytes_received=bytes_received,
            select_seconds=select_seconds, backend=b, residual=bucket.residual, union_size=union_size,
            gathered_indices=None if union_size is not None else all_idx,
            nonfinite_steps=bucket.nonfinite_steps,
            extra=self.algorithm.control_stats(bucket.control))
        if self.write_into_inputs:
            return b.scatter_into(tensors, *result, zeroed=cleared)
        return b.split_like(b.scatter(bucket.numel, result[0], result[1], like=acc), tensors)

    def end_step(self, ready: dict[str, float] | None = None) -> Protocol:
        """Protocol to run once per training step, after every bucket's step has finished, on
        every rank and outside the backward pass: the algorithm's cross-bucket decisions
        (``Algorithm.end_step``). ``ready``: per bucket, seconds from the step's first gradient to
        the arrival of the bucket's last one, where the driver can observe it."""
        if not self.buckets:
            return
        buckets = self.buckets
        like = next(iter(buckets.values())).residual
        ctx = StepContext(self.rank, self.size, max(bk.step for bk in buckets.values()), "",
                          sum(bk.numel for bk in buckets.values()), self.backend, self.prefix)
        end = StepEnd({key: bk.control for key, bk in buckets.items()},
                      {key: bk.numel for key, bk in buckets.items()}, ready, like)
        updated = yield from self.algorithm.end_step(end, ctx)
        for key, control in (updated or {}).items():
            buckets[key].control = control

    def measuring(self) -> bool:
        """Whether the algorithm wants exact readiness times for the next step (see end_step)."""
        return self.algorithm.measuring({key: bk.control for key, bk in self.buckets.items()})

    def schedule(self, key: str, numel: int, dtypes: tuple[str, ...]) -> list[list[tuple[str, str, str]]]:
        """The phases ``step(..., check_layout=False)`` will yield for a bucket, as
        (op, name, dtype) triples, known before any data is seen: what a graph must be built with
        in advance (TensorFlow per-tensor steps run each phase as graph ops)."""
        if self.algorithm.select_collectives:
            raise ConfigurationError(
                f"{type(self.algorithm).__name__} exchanges messages while selecting and runs "
                "only with scope='model' in TensorFlow")
        if numel == 0:  # an empty bucket is returned as it is (see step)
            return []
        name = f"{self.prefix}.{key}"
        idx = (ALLGATHER, f"{name}.idx", index_dtype_for(numel))
        val_dtype = value_dtype_for(dtypes)
        pattern = self.algorithm.pattern
        if pattern == GATHER:
            return [[idx, (ALLGATHER, f"{name}.val", val_dtype)]]
        if pattern == UNION:
            return [[idx], [(ALLREDUCE, f"{name}.val", val_dtype)]]
        return [[(ALLREDUCE, f"{name}.val", val_dtype)]]

    def _average(self, received: Any) -> Any:
        """Summed values as fp32, divided by N (on the k values, not on the dense vector)."""
        values = self.backend.cast(received, "float32")
        return self.backend.scale(values, 1.0 / self.size) if self.size > 1 else values

    def _ride(self, values: Any, extra: Any) -> Any:
        """The values with the algorithm's riders appended, on the values' device and dtype."""
        if extra is None:
            return values
        b = self.backend
        riders = b.from_numpy(b.to_numpy(extra).astype(b.dtype_name(values)), like=values)
        return b.concat([values, riders])

    def _unride(self, received: Any, extra: Any) -> tuple[Any, Any]:
        """Split the allreduced values from the riders' sums (returned as NumPy)."""
        if extra is None:
            return received, None
        b = self.backend
        total, riders = b.numel(received), b.numel(extra)
        summed = b.to_numpy(b.cast(b.slice(received, total - riders, total), "float64"))
        return b.slice(received, 0, total - riders), summed

    def take_back(self, keys: list[str]) -> None:
        """Undo, on this rank, the last step of these buckets: what each sent goes back into its
        residual and its step counter goes back by one (control states stay as they are, the same
        on every rank). For a step that another bucket aborted with a non-finite gradient under
        ``nonfinite="raise"``, so that the step is applied nowhere. Only under that policy."""
        for key in keys:
            bucket = self.buckets.get(key)
            if bucket is not None and bucket.sent is not None:
                bucket.residual = self._put_back(bucket.residual, *bucket.sent)
                bucket.sent = None
                bucket.step -= 1

    def _put_back(self, residual: Any, idx: Any, values: Any) -> Any:
        """The residual with the values sent at idx added back (exact: with a lower transport
        precision the residual held the rounding error there)."""
        b = self.backend
        return b.put(residual, idx, b.take(residual, idx) + b.cast(values, b.dtype_name(residual)))

    def _send(self, bucket: Bucket, acc: Any, idx: Any, poison: bool) -> tuple[Any, Any]:
        """Values to send at idx, and the residual left behind (exact error feedback)."""
        b = self.backend
        values = b.take(acc, idx)
        if poison:
            values = values + float("nan")
        if bucket.value_dtype == b.dtype_name(acc):
            return values, b.zero_at(acc, idx)
        sent = b.cast(values, bucket.value_dtype)
        rounding = values - b.cast(sent, b.dtype_name(acc))
        return sent, b.put(acc, idx, rounding)

    def layout_of(self, key: str, tensors: list[Any]) -> Layout:
        """A bucket's layout for ``agree_on_config``: its tensors' (name, shape, dtype)."""
        b = self.backend
        return [(f"{key}[{i}]" if len(tensors) > 1 else key, tuple(int(d) for d in t.shape),
                 b.dtype_name(t)) for i, t in enumerate(tensors)]

    def agree_on_config(self, layout: Layout, buckets: list[str] | None = None,
                        like: Any = None) -> Protocol:
        """Protocol: check, once, that every rank runs the same method with the same
        hyper-parameters and options on the same ``layout`` (name, shape, dtype of each tensor,
        in order; None where the caller cannot know it yet), raising ``RankMismatchError`` on
        every rank, naming what differs, otherwise (engine/agreement.py). ``buckets``: the bucket
        keys the check covers (``step`` then skips its own); None: every bucket, once the layout
        is known."""
        fields = config_fields(self.algorithm.name, self.algorithm.describe(),
                               {"nonfinite": self.nonfinite}, layout)
        name = self.prefix if buckets is None else f"{self.prefix}.{buckets[0]}"
        if self.size > 1:
            yield from agree(fields, self.backend, like, name, self.rank)
        if buckets is not None:
            self._agreed.update(buckets)
        elif layout is not None:
            self._agreed.add("*")

    def config_agreed(self) -> bool:
        """Whether a check of the whole configuration (``buckets=None``) has passed."""
        return "*" in self._agreed

    def _bucket(self, key: str, tensors: list[Any]) -> Bucket:
        b = self.backend
        shapes = tuple(tuple(int(d) for d in t.shape) for t in tensors)
        dtypes = tuple(b.dtype_name(t) for t in tensors)
        bucket = self.buckets.get(key)
        if bucket is not None:
            if bucket.shapes != shapes:
                raise ConfigurationError(
                    f"bucket {key!r} changed shape from {bucket.shapes} to {shapes}; a compressor "
                    "instance serves one model: create a new one for another model")
            return bucket
        for dtype in dtypes:
            check_gradient_dtype(key, dtype)
        sizes = tuple(int(np.prod(s, dtype=np.int64)) for s in shapes)
        numel = sum(sizes)
        if numel == 0:
            raise UnsupportedTensorError(f"bucket {key!r} is empty: nothing to sparsify")
        residual_dtype = "float64" if "float64" in dtypes else "float32"
        like = tensors[0]
        bucket = Bucket(key=key, shapes=shapes, dtypes=dtypes, numel=numel,
                        residual=b.zeros(numel, residual_dtype, like=like),
                        value_dtype=value_dtype_for(dtypes), index_dtype=index_dtype_for(numel),
                        sizes=sizes)
        self.buckets[key] = bucket
        if key in self._restored:
            self._restore(bucket, self._restored.pop(key), like)
        return bucket

    # --- statistics and checkpoints --------------------------------------------------------------
    def stats(self) -> dict:
        """The last step, summed over buckets (see engine/stats.py for the fields)."""
        latest = [bk.stats for bk in self.buckets.values() if bk.stats is not None]
        out = summarize(latest, self.algorithm.density)
        out.update(self.algorithm.model_stats({key: bk.control for key, bk in self.buckets.items()}))
        return out

    def state_dict(self) -> dict:
        """This rank's state: residuals (as NumPy) and the rank-consistent control state."""
        b = self.backend
        return {
            "format": STATE_FORMAT,
            "algorithm": self.algorithm.name,
            "hyperparameters": self.algorithm.describe(),
            "rank": self.rank,
            "size": self.size,
            "buckets": {
                key: {"shapes": bk.shapes, "step": bk.step, "residual": b.to_numpy(bk.residual).copy(),
                      "control": self.algorithm.control_state(bk.control)}
                for key, bk in self.buckets.items()
            },
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore a checkpoint taken by ``state_dict`` on this rank. At another world size, load
        any rank's file on every rank (e.g. that of rank ``r % old_size``): residuals are reset,
        the step and control state carry over. Buckets not created yet are restored when they
        first appear."""
        if state.get("format") != STATE_FORMAT:
            raise ConfigurationError(f"unknown checkpoint format {state.get('format')!r}")
        if state["algorithm"] != self.algorithm.name:
            raise ConfigurationError(
                f"checkpoint is from {state['algorithm']!r}, this compressor runs "
                f"{self.algorithm.name!r}: load it into the same method")
        if state["size"] != self.size:
            # Any rank's file will do: residuals are dropped, and the step counter and control
            # state are the same in every rank's file.
            warnings.warn(
                f"hvd_sparse: checkpoint taken at world size {state['size']}, resuming at {self.size}:"
                " residuals are reset and rank-dependent control state is rebuilt", stacklevel=2)
        elif state["rank"] != self.rank:
            raise RankMismatchError(
                f"checkpoint of rank {state['rank']} loaded on rank {self.rank}: residuals are per "
                "rank; save and load one file per rank (e.g. suffix the path with hvd.rank())")
        self._restored_size = state["size"]
        self._restored = dict(state["buckets"])
        for key in list(self._restored):
            if key in self.buckets:
                bucket = self.buckets[key]
                self._restore(bucket, self._restored.pop(key), bucket.residual)

    def agreed_state(self, state: dict | None = None) -> dict:
        """The rank-independent part of ``state`` (default: this engine's ``state_dict``): no
        residuals, each bucket's step and ``Algorithm.agreed_control``. What every process adopts
        from one rank on an elastic reset (``adopt``)."""
        state = self.state_dict() if state is None else state
        return {**{k: v for k, v in state.items() if k not in ("buckets", "rank")},
                "buckets": {key: {"shapes": saved["shapes"], "step": saved["step"],
                                  "control": self.algorithm.agreed_control(saved["control"])}
                            for key, saved in state["buckets"].items()}}

    def adopt(self, agreed: dict, residuals: dict[str, np.ndarray] | None = None) -> None:
        """Continue, at this engine's rank and size, from ``agreed`` (``agreed_state`` of the rank
        every process takes it from, at any world size) and this process's own ``residuals``
        (bucket -> NumPy; None or missing: zeros). A residual stays valid at any world size: it
        is this process's unsent gradient. World-size and rank dependent control state
        (partitions, bins, neighbour layout) is rebuilt by ``Algorithm.load_control``."""
        if agreed["algorithm"] != self.algorithm.name:
            raise ConfigurationError(
                f"state of {agreed['algorithm']!r} adopted by a compressor running "
                f"{self.algorithm.name!r}: every rank must run the same method")
        own = residuals or {}
        self._restored_size = agreed["size"]
        self._restored = {key: {**saved, "residual": own.get(key), "own_residual": True}
                          for key, saved in agreed["buckets"].items()}
        for key in list(self._restored):
            if key in self.buckets:
                bucket = self.buckets[key]
                self._restore(bucket, self._restored.pop(key), bucket.residual)

    def _restore(self, bucket: Bucket, saved: dict, like: Any) -> None:
        if tuple(map(tuple, saved["shapes"])) != bucket.shapes:
            raise ConfigurationError(
                f"checkpoint bucket {bucket.key!r} has shapes {saved['shapes']}, the model has "
                f"{bucket.shapes}")
        bucket.step = int(saved["step"])
        same_world = self._restored_size == self.size
        if saved["residual"] is not None and (same_world or saved.get("own_residual")):
            residual = saved["residual"].astype(self.backend.dtype_name(bucket.residual))
            bucket.residual = self.backend.from_numpy(residual, like=like)
        ctx = StepContext(self.rank, self.size, bucket.step, bucket.key, bucket.numel, self.backend,
                          f"{self.prefix}.{bucket.key}", bucket.sizes)
        with warnings.catch_warnings():
            if saved.get("own_residual"):   # an elastic reset: "rebuilt for N ranks" is expected
                warnings.simplefilter("ignore")
            bucket.control = self.algorithm.load_control(saved["control"], ctx, self._restored_size)
