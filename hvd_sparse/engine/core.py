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
3. exchanges them with the method's pattern -- gather, union or shared, one object each in
   engine/patterns.py that owns its phases, the bytes it moves and where the average lands,
4. keeps what was not sent as the new residual -- exactly: on every index,
   ``sent + new residual == gradient + old residual`` (values travelling in a lower precision
   than the residual leave their rounding error in the residual),
5. lets the algorithm's controller observe what was exchanged, and records statistics,
6. reconstructs the average over ranks as a dense vector and cuts it back into tensors.

``Engine.step`` is these steps in this order, one line (or helper) each.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..algorithms.base import (
    Algorithm,
    StepContext,
    StepEnd,
    StepOutcome,
    check_choice,
)
from ..algorithms.dense import DenseAverage
from ..backends import Backend, Momentum, index_dtype_for
from ..comm import Protocol, timed
from ..errors import ConfigurationError, RankMismatchError, UnsupportedTensorError
from . import adam, clipping, patterns
from .agreement import Layout, agree, config_fields
from .stats import BucketStats, StepTimes, sum_times, summarize

# Dtypes Horovod 0.28.1 can move in collectives (no bfloat16: docs/architecture.md#transport-dtypes).
_TRANSPORTABLE = ("float16", "float32", "float64")
_FLOATS = ("float16", "bfloat16", "float32", "float64")

STATE_FORMAT = 1
# What a rank does with a NaN/Inf gradient: send zeros and keep its residual ("skip", with a
# warning), make every rank raise ("raise"), or not look (no check at all: "ignore").
NONFINITE_POLICIES = ("skip", "raise", "ignore")
# What selects in the dense steps and dense buckets of the corrections: everything, one allreduce.
_DENSE = DenseAverage()


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
    momentum: Any = None            # the momentum correction's velocity u (None: not started)
    momentum_unmasked: Any = None   # u of the last step before masking (nonfinite="raise": for
                                    # take_back)
    second_moment: Any = None       # the Adam path's v (engine/adam.py; None: not started)
    adam_before: Any = None         # (m, v) before the last dense Adam step (nonfinite="raise": for
                                    # take_back)
    dense: bool = False             # every tensor under ``dense_below``: always averaged densely
    members: tuple[str, ...] = ()   # the tensors' own keys when it packs per-tensor steps
    times: StepTimes | None = None  # where the current (or last) step's host time went


@dataclass(frozen=True)
class Selection:
    """What steps 1 and 2 hand on: this rank's accumulated vector and indices."""

    acc: Any              # gradient + residual (zeros on a non-finite step)
    idx: Any              # this rank's indices, in the bucket's index dtype
    selected: int
    finite: bool          # the gradient was finite (or not checked: nonfinite="ignore")
    cleared: bool         # the fused op already cleared the inputs (write_into_inputs)


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
        # Every step's payload, dense steps and warm-up included, and a dense allreduce's for the
        # same steps (stats(): what the run exchanged so far, against dense).
        self.totals = {"bytes_sent_total": 0, "bytes_received_total": 0, "dense_bytes_total": 0}

    # --- the step ------------------------------------------------------------------------------
    def step(self, key: str, tensors: list[Any], check_layout: bool = True,
             members: tuple[str, ...] = ()) -> Protocol:
        """Protocol of one step of bucket ``key``; returns the averaged tensors, shaped like
        ``tensors`` (the same tensor objects, overwritten, with ``write_into_inputs``).
        ``members``: a key per tensor when the bucket packs per-tensor steps, which the method
        then takes tensor by tensor (``Algorithm.packs_tensors``; they name its checkpoint
        parts, so a checkpoint of unpacked buckets loads into it and back). With
        ``check_layout`` the first step also checks, unless ``agree_on_config`` already covered
        the bucket, that every rank runs the same method and options on a bucket of the same
        layout (one tiny allgather), so a configuration that differs across ranks fails loudly.
        An empty bucket (a zero-size parameter) is returned as it is, without any collective.
        The time each part of the step ran on the host is kept in the bucket's ``StepTimes``."""
        if all(self.backend.numel(t) == 0 for t in tensors):
            return list(tensors)
        bucket = self._bucket(key, tensors, tuple(members))
        bucket.times = times = StepTimes()
        return (yield from timed(self._step(bucket, tensors, check_layout, times), times, "engine"))

    def _step(self, bucket: Bucket, tensors: list[Any], check_layout: bool, times: StepTimes) -> Protocol:
        """Protocol: ``step`` of a known bucket, the steps of the module docstring in order."""
        key = bucket.key
        bucket.sent = bucket.momentum_unmasked = bucket.adam_before = None
        if check_layout and not self._agreed & {key, "*"} and self.size > 1:
            yield from self.agree_on_config(self.layout_of(key, tensors), [key], like=bucket.residual)
        self._agreed.add(key)
        ctx = self._context(bucket)
        method = self._method(bucket)
        if bucket.control is None and method is self.algorithm:
            bucket.control = self.algorithm.init_control(ctx)
        control = bucket.control if method is self.algorithm else None
        # The steps of the module docstring:
        yield from method.prepare(control, ctx)                                     # 0
        clipped = self._clip(bucket, tensors, method, ctx)
        picked = yield from self._accumulate_select(bucket, clipped or tensors, method, ctx,  # 1, 2
                                                    clipped is None and self.write_into_inputs)
        out = yield from timed(self._exchange(method, control, picked, ctx), times, "exchange")  # 3
        began = time.perf_counter()
        self._keep_residual(bucket, picked, out, method, ctx)                       # 4
        self._observe(bucket, picked, out, method, ctx)                             # 5
        out = self._adam_dense(bucket, method, out)
        middle = time.perf_counter()
        result = self._reconstruct(bucket, tensors, picked, out)                    # 6
        times.exchange += middle - began
        times.reconstruct += time.perf_counter() - middle
        return result

    def _method(self, bucket: Bucket) -> Algorithm:
        """Who selects this step: the method, or the plain average for a bucket of small tensors
        (``dense_below``) and during the first ``dense_steps`` (algorithms/corrections.py)."""
        if bucket.dense or self.algorithm.corrections.dense_at(bucket.step):
            return _DENSE
        return self.algorithm

    def _clip(self, bucket: Bucket, tensors: list[Any], method: Algorithm,
              ctx: StepContext) -> list[Any] | None:
        """The ``clip_norm`` correction on a sparse step (engine/clipping.py): the clipped
        gradient to accumulate, or None when nothing is clipped."""
        clip_norm = self.algorithm.corrections.clip_norm
        if clip_norm is None or method is not self.algorithm:
            return None
        return clipping.clip_locally(self.backend, tensors, method.tensor_segments(ctx), clip_norm, ctx.size,
                                     bucket.residual)

    def _accumulate_select(self, bucket: Bucket, tensors: list[Any], method: Algorithm,
                           ctx: StepContext, clear_inputs: bool) -> Protocol:
        """Protocol, steps 1 and 2: ``Selection`` of this rank's indices from gradient + residual.

        A rank whose gradient is not finite still takes part in every collective (skipping one
        would hang the others) but sends zeros -- or NaN, so every rank raises -- and keeps its
        residual as it was: checked before the accumulation writes the residual. Threshold
        methods accumulate and select in one op, which checks first; with ``clear_inputs`` (the
        engine writes the average into the inputs, and ``tensors`` are they) it clears them in
        the same pass, so the reconstruction writes only the selection."""
        b, check, control, times = self.backend, self.nonfinite != "ignore", bucket.control, bucket.times
        if method is not self.algorithm:
            control = None
        started = time.perf_counter()
        fused = method.accumulate_select(bucket.residual, tensors, control, ctx, clear_inputs, check)
        cleared = fused is not None and fused.idx is not None and clear_inputs
        if fused is None:
            acc, idx, finite, cleared = self._accumulate(bucket, tensors, method, control, ctx,
                                                         clear_inputs)
            times.accumulate += time.perf_counter() - started
            started = time.perf_counter()
        else:
            acc, idx, finite = fused.acc, fused.idx, fused.finite
        if ctx.momentum is not None:   # the velocity, updated (or, not finite, left) by the op
            bucket.momentum = ctx.momentum.buffer
            if ctx.momentum.second is not None:   # and the Adam path's v with it
                bucket.second_moment = ctx.momentum.second.buffer
        if not finite:   # select from zeros, as every method does on such a step
            acc, idx = self._skip_nonfinite(bucket), None
        times.select += time.perf_counter() - started
        if idx is None:   # a method's select may do its work when called (Algorithm.select)
            started = time.perf_counter()
            protocol = method.select(acc, control, ctx)
            suspended = time.perf_counter()
            times.select += suspended - started
            ran = times.select
            idx = yield from timed(protocol, times, "select")
            times.select_wait += time.perf_counter() - suspended - (times.select - ran)
        started = time.perf_counter()
        if b.numel(idx) == 0:  # an empty collective can hang: docs/architecture.md#collective-rules
            idx = method.fallback(control, ctx)
            idx = b.from_numpy(b.to_numpy(idx), like=acc)  # on the gradient's device (a GPU)
        picked = Selection(acc, b.cast(idx, bucket.index_dtype), b.numel(idx), finite, cleared)
        times.select += time.perf_counter() - started
        return picked

    def _accumulate(self, bucket: Bucket, tensors: list[Any], method: Algorithm, control: Any,
                    ctx: StepContext, clear: bool) -> tuple[Any, None, bool, bool]:
        """Step 1 alone (the selection is not fused with it): (accumulated vector or None when not
        finite, None, finite, inputs cleared). When the method accumulates plainly
        (``Algorithm.plain_accumulation``), one backend op checks the inputs and accumulates
        (the fused threshold op over an empty range: no selection), and with ``clear`` (the
        engine writes the average into the inputs) it clears them in the same pass too, so
        neither a finite check nor the reconstruction reads or writes them separately; the vector
        is the same."""
        b, check = self.backend, self.nonfinite != "ignore"
        if method.plain_accumulation(control):
            done = b.accumulate_select(bucket.residual, tensors, 0, 0, 0.0, clear_inputs=clear,
                                       check_finite=check, momentum=ctx.momentum)
            return (done.acc if done.finite else None), None, done.finite, done.finite and clear
        finite = not check or b.tensors_finite(tensors)
        acc = method.accumulate(bucket.residual, tensors, control, ctx) if finite else None
        return acc, None, finite, False

    def _skip_nonfinite(self, bucket: Bucket) -> Any:
        """The zeros a rank with a non-finite gradient selects from (warned under "skip")."""
        bucket.nonfinite_steps += 1
        if self.nonfinite == "skip":
            # stacklevel 4: the driver advancing step() (via _accumulate_select)
            warnings.warn(f"hvd_sparse: non-finite gradient in {bucket.key!r} on rank {self.rank} "
                          f"at step {bucket.step}: this rank sends zeros and keeps its residual",
                          RuntimeWarning, stacklevel=4)
        b = self.backend
        return b.zeros(bucket.numel, b.dtype_name(bucket.residual), like=bucket.residual)

    def _exchange(self, method: Algorithm, control: Any, picked: Selection, ctx: StepContext) -> Protocol:
        """Protocol, step 3: the selection through the method's pattern (engine/patterns.py)."""
        index_dtype, value_dtype = self.buckets[ctx.key].index_dtype, self.buckets[ctx.key].value_dtype
        out = patterns.Outgoing(
            picked.acc, picked.idx, index_dtype, value_dtype,
            poison=not picked.finite and self.nonfinite == "raise",
            riders=method.piggyback(control, ctx),
            union=lambda gathered: method.union_indices(gathered, control, ctx))
        return (yield from patterns.BY_NAME[method.pattern].exchange(out, ctx))

    def _keep_residual(self, bucket: Bucket, picked: Selection, out: patterns.Exchanged,
                       method: Algorithm, ctx: StepContext) -> None:
        """Step 4: what was not sent becomes the residual, and the momentum correction's velocity
        is cleared where the residual was (factor masking) -- unless, under nonfinite="raise", a
        non-finite value came back: then every rank raises and keeps all it accumulated (g + e;
        with momentum e + u', u' unmasked: as if nothing had been sent)."""
        if self.nonfinite == "raise" and not self.backend.all_finite(out.received):
            if picked.finite:  # nothing of the step is applied: the residual keeps all of g + e
                bucket.residual = self._put_back(out.residual, out.sent_at, out.values)
            raise FloatingPointError(
                f"hvd_sparse: non-finite gradient in {bucket.key!r} at step {bucket.step} on at least one "
                "rank (raised on every rank; this step was applied nowhere and every rank keeps its "
                "residual, the step counter unchanged). In PyTorch training can go on: catch it "
                "around optimizer.step(), then call optimizer.load_state_dict(optimizer.state_dict()) "
                "and optimizer.zero_grad() (docs/usage.md#non-finite-gradients). Or pass "
                "nonfinite='skip' to drop such a rank's contribution for the step instead")
        if picked.finite:
            bucket.residual = out.residual
            masks = self._masks_momentum(bucket, method, ctx)
            if masks:
                if self.nonfinite == "raise":   # what take_back restores
                    bucket.momentum_unmasked = self.backend.copy(bucket.momentum)
                at = out.sent_at if masks is True else self._in_tensors(out.sent_at, bucket.sizes, masks)
                bucket.momentum = self.backend.zero_at(bucket.momentum, at)
        keep = picked.finite and self.nonfinite == "raise"
        bucket.sent = (out.sent_at, out.values) if keep else None

    def _adam_dense(self, bucket: Bucket, method: Algorithm, out: patterns.Exchanged) -> patterns.Exchanged:
        """The Adam path's dense steps: the average becomes Adam's update of it (engine/adam.py)."""
        path = self.algorithm.corrections.adam
        if path is None or method is not _DENSE:
            return out
        return adam.dense_update(self.backend, bucket, out, path, self.nonfinite == "raise")

    def _masks_momentum(self, bucket: Bucket, method: Algorithm, ctx: StepContext) -> bool | list[bool]:
        """Momentum factor masking applies to sparse steps; a dense step (everything sent) keeps
        the velocity, which makes it plain momentum SGD, as DGC's authors' dense path does. A
        list: whether it applies in each tensor of a bucket packing per-tensor steps. Never on the
        Adam path, whose velocity is Adam's first moment."""
        if (ctx.momentum is None or not self.algorithm.corrections.momentum_masking
                or method is not self.algorithm or self.algorithm.corrections.adam is not None):
            return False
        return method.masks_momentum(bucket.control, ctx)

    def _in_tensors(self, idx: Any, sizes: tuple[int, ...], keep: list[bool]) -> Any:
        """The indices of ``idx`` that fall in the tensors (of ``sizes``) marked in ``keep``."""
        b = self.backend
        host = b.to_numpy(idx)
        tensor = np.searchsorted(np.cumsum(sizes), host, side="right")
        return b.from_numpy(host[np.asarray(keep)[tensor]], like=idx)

    def _unmask_momentum(self, bucket: Bucket) -> None:
        """Undo the factor masking of the last step (take_back: nothing of it was sent)."""
        if bucket.momentum_unmasked is not None:
            bucket.momentum, bucket.momentum_unmasked = bucket.momentum_unmasked, None

    def _observe(self, bucket: Bucket, picked: Selection, out: patterns.Exchanged,
                 method: Algorithm, ctx: StepContext) -> None:
        """Step 5: the controller sees what was exchanged; statistics recorded (engine/stats.py)."""
        control = bucket.control if method is self.algorithm else None
        target_k = method.target_k(control, ctx)
        outcome = StepOutcome(picked.selected, out.union_size, out.gathered, picked.idx, out.riders)
        control = method.observe(control, outcome, ctx)
        if method is self.algorithm:
            bucket.control = control
        bucket.step += 1
        self.totals["bytes_sent_total"] += out.bytes_sent
        self.totals["bytes_received_total"] += out.bytes_received
        self.totals["dense_bytes_total"] += bucket.numel * patterns.ITEMSIZE[bucket.value_dtype]
        bucket.stats = BucketStats(
            step=bucket.step, numel=bucket.numel, k=target_k, selected=picked.selected,
            bytes_sent=out.bytes_sent, bytes_received=out.bytes_received,
            times=bucket.times or StepTimes(), backend=self.backend, residual=bucket.residual,
            union_size=out.union_size,
            gathered_indices=None if out.union_size is not None else out.gathered,
            nonfinite_steps=bucket.nonfinite_steps,
            extra=self.algorithm.control_stats(control) if method is self.algorithm else {})

    def _reconstruct(self, bucket: Bucket, tensors: list[Any], picked: Selection,
                     out: patterns.Exchanged) -> list[Any]:
        """Step 6: the average as dense tensors shaped like ``tensors`` (written into them with
        ``write_into_inputs``, which the fused op may already have cleared)."""
        b = self.backend
        if self.write_into_inputs:
            return b.scatter_into(tensors, out.at, out.average, out.unique, zeroed=picked.cleared)
        return b.scatter_split(bucket.numel, out.at, out.average, tensors, like=out.residual)

    def _context(self, bucket: Bucket) -> StepContext:
        corrections, density = self.algorithm.corrections, None
        if bucket.dense or corrections.dense_steps or corrections.warmup_steps:
            density = 1.0 if bucket.dense else corrections.density_at(self.algorithm.density, bucket.step)
            if density == self.algorithm.density and not bucket.dense:
                density = None   # the schedule is over: the method's own (DGC's epochs)
        return StepContext(self.rank, self.size, bucket.step, bucket.key, bucket.numel, self.backend,
                           f"{self.prefix}.{bucket.key}", bucket.sizes, density, self._momentum(bucket),
                           bucket.members)

    def _momentum(self, bucket: Bucket) -> Momentum | None:
        """The bucket's velocity for this step's accumulation, when the correction is on (the Adam
        path's on its sparse steps: engine/adam.py)."""
        corrections = self.algorithm.corrections
        if corrections.adam is not None:
            if bucket.dense or corrections.dense_at(bucket.step):
                return None
            return adam.sparse_momentum(self.backend, bucket, corrections.adam)
        if corrections.momentum == 0.0:
            return None
        if bucket.momentum is None:
            b = self.backend
            bucket.momentum = b.zeros(bucket.numel, b.dtype_name(bucket.residual), like=bucket.residual)
        return Momentum(bucket.momentum, corrections.momentum, corrections.nesterov)

    def end_step(self, ready: dict[str, float] | None = None) -> Protocol:
        """Protocol to run once per training step, after every bucket's step has finished, on
        every rank and outside the backward pass: the algorithm's cross-bucket decisions
        (``Algorithm.end_step``). ``ready``: per bucket, seconds from the step's first gradient to
        the arrival of the bucket's last one, where the driver can observe it."""
        if not self.buckets:
            return
        buckets = self._sparse_buckets()
        if not buckets:   # dense steps: no method has run yet
            return
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
        return self.algorithm.measuring({key: bk.control for key, bk in self._sparse_buckets().items()})

    def _sparse_buckets(self) -> dict[str, Bucket]:
        """The buckets the method has run on: not the dense ones, and none during the first
        ``dense_steps``."""
        dense_steps = self.algorithm.corrections.dense_steps
        return {key: bk for key, bk in self.buckets.items() if not bk.dense and bk.step > dense_steps}

    def schedule(self, key: str, numel: int, dtypes: tuple[str, ...], sizes: tuple[int, ...] | None = None
                 ) -> list[list[tuple[str, str, str]]]:
        """The phases ``step(..., check_layout=False)`` will yield for a bucket, as
        (op, name, dtype) triples, known before any data is seen: what a graph must be built with
        in advance (TensorFlow per-tensor steps run each phase as graph ops)."""
        if self.algorithm.select_collectives:
            raise ConfigurationError(
                f"{type(self.algorithm).__name__} exchanges messages while selecting and runs "
                "only with scope='model' in TensorFlow")
        if numel == 0:  # an empty bucket is returned as it is (see step)
            return []
        corrections = self.algorithm.corrections
        if sizes is not None and self._is_dense(sizes):
            pattern = _DENSE.pattern
        elif corrections.dense_steps:
            what = ("the Adam path averages its dense steps densely, which changes" if corrections.adam
                    else "dense_steps changes")
            raise ConfigurationError(
                f"{what} the collectives of a step after the first steps, which a TensorFlow graph "
                "built per tensor cannot follow: use scope='model' (one bucket, run eagerly)"
                + ("" if corrections.adam else ", or warmup_steps, which keeps the collectives"))
        else:
            pattern = self.algorithm.pattern
        return patterns.BY_NAME[pattern].schedule(
            f"{self.prefix}.{key}", index_dtype_for(numel), value_dtype_for(dtypes))

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
                self._unmask_momentum(bucket)
                adam.take_back(bucket)

    def _put_back(self, residual: Any, idx: Any, values: Any) -> Any:
        """The residual with the values sent at idx added back (exact: with a lower transport
        precision the residual held the rounding error there)."""
        b = self.backend
        return b.put(residual, idx, b.take(residual, idx) + b.cast(values, b.dtype_name(residual)))

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

    def _bucket(self, key: str, tensors: list[Any], members: tuple[str, ...] = ()) -> Bucket:
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
        algorithm = self.algorithm
        if members and not (algorithm.tensor_packing and len(members) == len(tensors)):
            raise ConfigurationError(
                f"bucket {key!r} packs {len(members)} per-tensor steps for {len(tensors)} tensors with "
                f"{type(algorithm).__name__}(scope={algorithm.scope!r}), which "
                + ("needs a key per tensor" if algorithm.tensor_packing
                   else "selects per tensor only in buckets of its own, and only in scope 'tensor'"))
        sizes = tuple(int(np.prod(s, dtype=np.int64)) for s in shapes)
        numel = sum(sizes)
        if numel == 0:
            raise UnsupportedTensorError(f"bucket {key!r} is empty: nothing to sparsify")
        residual_dtype = "float64" if "float64" in dtypes else "float32"
        like = tensors[0]
        bucket = Bucket(key=key, shapes=shapes, dtypes=dtypes, numel=numel,
                        residual=b.zeros(numel, residual_dtype, like=like),
                        value_dtype=value_dtype_for(dtypes), index_dtype=index_dtype_for(numel),
                        sizes=sizes, dense=self._is_dense(sizes), members=members)
        self.buckets[key] = bucket
        saved = self._saved_for(bucket)
        if saved is not None:
            self._restore(bucket, saved, like)
        return bucket

    def _saved_for(self, bucket: Bucket) -> dict | None:
        """The restored state of a new bucket: its own, or -- across a change of packing
        (``step``'s ``members``) -- its members' states joined, or its part of a packed bucket's."""
        if bucket.key in self._restored:
            return self._restored.pop(bucket.key)
        if bucket.members and all(m in self._restored for m in bucket.members):
            return _joined([self._restored.pop(m) for m in bucket.members])
        for key, saved in self._restored.items():
            if bucket.key in saved.get("members", ()):
                taken = {*saved.get("taken", ()), bucket.key}
                if len(taken) == len(saved["members"]):
                    del self._restored[key]   # every part taken
                else:
                    self._restored[key] = {**saved, "taken": taken}
                return _part_of(saved, saved["members"].index(bucket.key))
        return None

    def _restore_existing(self) -> None:
        """Restore the buckets that exist already from what was just loaded (``_restored``)."""
        for bucket in self.buckets.values():
            saved = self._saved_for(bucket)
            if saved is not None:
                self._restore(bucket, saved, bucket.residual)

    def _is_dense(self, sizes: tuple[int, ...]) -> bool:
        """A bucket of tensors that are all under ``dense_below`` is always averaged densely."""
        return all(self.algorithm.corrections.is_dense_tensor(n) for n in sizes)

    # --- statistics and checkpoints --------------------------------------------------------------
    def stats(self) -> dict:
        """The last step, summed over buckets (see engine/stats.py for the fields)."""
        latest = [bk.stats for bk in self.buckets.values() if bk.stats is not None]
        last = max((bk.step for bk in self.buckets.values()), default=1) - 1
        # the last step's target: during dense steps and a warm-up, the schedule's
        target = self.algorithm.corrections.density_at(self.algorithm.density, max(last, 0))
        out = summarize(latest, target)
        controls = {key: bk.control for key, bk in self._sparse_buckets().items()}
        out.update(self.algorithm.model_stats(controls))
        out.update(self.totals)
        return out

    def step_times(self) -> dict:
        """Where the last step's host time went, summed over buckets (``<part>_seconds`` of
        engine/stats.py ``StepTimes``): cheap, no pass over any data."""
        return sum_times([bk.times for bk in self.buckets.values() if bk.times is not None])

    def state_dict(self) -> dict:
        """This rank's state: residuals (as NumPy) and the rank-consistent control state."""
        b = self.backend
        return {
            "format": STATE_FORMAT,
            "algorithm": self.algorithm.name,
            "hyperparameters": self.algorithm.describe(),
            "rank": self.rank,
            "size": self.size,
            "totals": dict(self.totals),
            "buckets": {
                key: {"shapes": bk.shapes, "step": bk.step, "members": bk.members,
                      "residual": b.to_numpy(bk.residual).copy(),
                      "momentum": None if bk.momentum is None else b.to_numpy(bk.momentum).copy(),
                      "second_moment": None if bk.second_moment is None
                      else b.to_numpy(bk.second_moment).copy(),
                      "control": None if bk.control is None else self.algorithm.control_state(bk.control)}
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
        self.totals.update(state.get("totals", {}))
        self._restore_existing()

    def agreed_state(self, state: dict | None = None) -> dict:
        """The rank-independent part of ``state`` (default: this engine's ``state_dict``): no
        residuals, each bucket's step and ``Algorithm.agreed_control``. What every process adopts
        from one rank on an elastic reset (``adopt``)."""
        state = self.state_dict() if state is None else state
        return {**{k: v for k, v in state.items() if k not in ("buckets", "rank", "totals")},
                "buckets": {key: {"shapes": saved["shapes"], "step": saved["step"],
                                  "members": saved.get("members", ()),
                                  "second_moment": saved.get("second_moment"),
                                  "preconditioner": saved.get("preconditioner"),   # older files
                                  "agreed_momentum": saved.get("momentum") if self._global_momentum(saved)
                                  else None,
                                  "control": None if saved["control"] is None
                                  else self.algorithm.agreed_control(saved["control"])}
                            for key, saved in state["buckets"].items()}}

    def _global_momentum(self, saved: dict) -> bool:
        """Whether a saved bucket's velocity is the same on every rank: the Adam path's m up to its
        first sparse step (the dense steps take it from the average), and always in a bucket of
        ``dense_below`` tensors."""
        corrections = self.algorithm.corrections
        if corrections.adam is None:
            return False
        sizes = tuple(int(np.prod(shape, dtype=np.int64)) for shape in saved["shapes"])
        return saved["step"] <= corrections.dense_steps or self._is_dense(sizes)

    def adopt(self, agreed: dict, residuals: dict[str, np.ndarray] | None = None,
              momenta: dict[str, np.ndarray | None] | None = None) -> None:
        """Continue, at this engine's rank and size, from ``agreed`` (``agreed_state`` of the rank
        every process takes it from, at any world size) and this process's own ``residuals``
        (bucket -> NumPy; None or missing: zeros). A residual stays valid at any world size: it
        is this process's unsent gradient; so is the momentum correction's velocity (``momenta``,
        likewise). World-size and rank dependent control state
        (partitions, bins, neighbour layout) is rebuilt by ``Algorithm.load_control``."""
        if agreed["algorithm"] != self.algorithm.name:
            raise ConfigurationError(
                f"state of {agreed['algorithm']!r} adopted by a compressor running "
                f"{self.algorithm.name!r}: every rank must run the same method")
        own, velocities = residuals or {}, momenta or {}
        self._restored_size = agreed["size"]
        self._restored = {key: {**saved, "residual": own.get(key), "own_residual": True,
                                "momentum": velocities.get(key) if saved.get("agreed_momentum") is None
                                else saved["agreed_momentum"]}
                          for key, saved in agreed["buckets"].items()}
        self._restore_existing()

    def _restore(self, bucket: Bucket, saved: dict, like: Any) -> None:
        if tuple(map(tuple, saved["shapes"])) != bucket.shapes:
            raise ConfigurationError(
                f"checkpoint bucket {bucket.key!r} has shapes {saved['shapes']}, the model has "
                f"{bucket.shapes}")
        bucket.step = int(saved["step"])
        same_world = self._restored_size == self.size
        if same_world or saved.get("own_residual"):   # per process: kept, else restarted
            dtype = self.backend.dtype_name(bucket.residual)
            if saved["residual"] is not None:
                bucket.residual = self.backend.from_numpy(saved["residual"].astype(dtype), like=like)
            # Checkpoints taken before the engine kept DGC's velocity hold it in DGC's control.
            momentum = saved.get("momentum", (saved["control"] or {}).get("momentum")
                                 if isinstance(saved["control"], dict) else None)
            if momentum is not None:
                bucket.momentum = self.backend.from_numpy(np.asarray(momentum).astype(dtype), like=like)
        if saved.get("second_moment") is not None or saved.get("preconditioner") is not None:
            self._restore_adam(bucket, saved, like)
        if saved["control"] is None:   # saved during the dense steps, or a dense bucket
            return
        ctx = self._context(bucket)
        with warnings.catch_warnings():
            if saved.get("own_residual"):   # an elastic reset: "rebuilt for N ranks" is expected
                warnings.simplefilter("ignore")
            bucket.control = self.algorithm.load_control(saved["control"], ctx, self._restored_size)


    def _restore_adam(self, bucket: Bucket, saved: dict, like: Any) -> None:
        """The Adam path's moments at any world size: a rank's own m and v (the same on every rank
        during the dense steps) are a sound start for any process, as the ranks' moments differ
        only by their gradients' noise. Files of the frozen path hold v's preconditioner instead."""
        b, dtype = self.backend, self.backend.dtype_name(bucket.residual)
        corrections = self.algorithm.corrections
        second = adam.saved_second_moment(saved, corrections.adam, corrections.dense_steps)
        for field, value in (("second_moment", second), ("momentum", saved.get("momentum"))):
            if value is not None:
                setattr(bucket, field, b.from_numpy(np.asarray(value).astype(dtype), like=like))


def _joined(parts: list[dict]) -> dict:
    """Saved states of buckets of one tensor each as the state of one bucket packing them: the
    residuals and velocities end to end (zeros where a part has none), the step of the first (every
    rank steps every bucket together), no control state (the packed bucket starts its own)."""
    def joined(field: str) -> np.ndarray | None:
        arrays = [part.get(field) for part in parts]
        if all(a is None for a in arrays):
            return None
        sizes = [int(np.prod(part["shapes"][0], dtype=np.int64)) for part in parts]
        return np.concatenate([np.zeros(n, np.float64) if a is None else np.asarray(a).reshape(-1)
                               for a, n in zip(arrays, sizes, strict=True)])
    return {"shapes": [tuple(part["shapes"][0]) for part in parts], "step": parts[0]["step"],
            "residual": joined("residual"), "momentum": joined("momentum"),
            "second_moment": joined("second_moment"), "preconditioner": joined("preconditioner"),
            "control": None,
            "own_residual": parts[0].get("own_residual", False)}


def _part_of(saved: dict, position: int) -> dict:
    """The saved state of the ``position``-th tensor of a packed bucket as a bucket of its own
    (no control state: it starts its own)."""
    sizes = [int(np.prod(shape, dtype=np.int64)) for shape in saved["shapes"]]
    lo = sum(sizes[:position])

    def part(field: str) -> np.ndarray | None:
        array = saved.get(field)
        return None if array is None else np.asarray(array).reshape(-1)[lo:lo + sizes[position]].copy()
    return {"shapes": [tuple(saved["shapes"][position])], "step": saved["step"], "residual": part("residual"),
            "momentum": part("momentum"), "second_moment": part("second_moment"),
            "preconditioner": part("preconditioner"), "control": None,
            "own_residual": saved.get("own_residual", False)}
