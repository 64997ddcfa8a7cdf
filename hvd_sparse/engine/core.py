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
from ..backends import Backend, Momentum
from ..comm import Protocol, timed
from ..errors import ConfigurationError
from . import adam, checkpoint, clipping, patterns
from .agreement import Layout, agree, config_fields, layout_of
from .buckets import Bucket, Selection, new_bucket
from .stats import BucketStats, StepTimes, last_step_stats, sum_times

# What a rank does with a NaN/Inf gradient: send zeros and keep its residual ("skip", with a
# warning), make every rank raise ("raise"), or not look (no check at all: "ignore").
NONFINITE_POLICIES = ("skip", "raise", "ignore")
# What selects in the dense steps and dense buckets of the corrections: everything, one allreduce.
_DENSE = DenseAverage()


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
        bucket.sent = bucket.momentum_unmasked = bucket.adam_before = bucket.refreshed = None
        if check_layout and not self._agreed & {key, "*"} and self.size > 1:
            layout = layout_of(self.backend, key, tensors)
            yield from self.agree_on_config(layout, [key], like=bucket.residual)
        self._agreed.add(key)
        ctx = self._context(bucket)
        method = self._method(bucket)
        if bucket.control is None and method is self.algorithm:
            bucket.control = self.algorithm.init_control(ctx)
        control = bucket.control if method is self.algorithm else None
        # The steps of the module docstring:
        yield from method.prepare(control, ctx)                                     # 0
        clipped = self._clip(bucket, tensors, method, ctx)
        if method is self.algorithm and self.algorithm.corrections.refreshes_at(bucket.step):
            bucket.refreshed = yield from adam.refresh_second_moment(
                self.backend, bucket, clipped or tensors, ctx, self.algorithm.corrections, self.nonfinite)
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
        moved = bucket.refreshed or 0   # the shared second moment's refresh (engine/adam.py)
        sent, received = out.bytes_sent + moved, out.bytes_received + moved
        self.totals["bytes_sent_total"] += sent
        self.totals["bytes_received_total"] += received
        self.totals["dense_bytes_total"] += bucket.numel * patterns.ITEMSIZE[bucket.value_dtype]
        bucket.stats = BucketStats(
            step=bucket.step, numel=bucket.numel, k=target_k, selected=picked.selected,
            bytes_sent=sent, bytes_received=received,
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
            return adam.sparse_momentum(self.backend, bucket, corrections)
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
        (op, name, dtype) triples, known before any data is seen (patterns.graph_schedule)."""
        dense = _DENSE.pattern if sizes is not None and self.is_dense(sizes) else None
        return patterns.graph_schedule(self.algorithm, f"{self.prefix}.{key}", numel, dtypes, dense)

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

    def agree_on_config(self, layout: Layout, buckets: list[str] | None = None,
                        like: Any = None) -> Protocol:
        """Protocol: check, once, that every rank runs the same method with the same hyper-parameters
        and options on the same ``layout`` (name, shape, dtype of each tensor, in order; None where
        the caller cannot know it yet), raising ``RankMismatchError`` on every rank, naming what
        differs, otherwise (engine/agreement.py). ``buckets``: the bucket keys the check covers
        (``step`` then skips its own); None: every bucket, once the layout is known."""
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
        """The bucket ``key`` of these tensors: the existing one (same shapes), else a new one
        (``buckets.new_bucket``), restored from a loaded checkpoint where it holds it."""
        shapes = tuple(tuple(int(d) for d in t.shape) for t in tensors)
        bucket = self.buckets.get(key)
        if bucket is not None:
            if bucket.shapes != shapes:
                raise ConfigurationError(
                    f"bucket {key!r} changed shape from {bucket.shapes} to {shapes}; a compressor "
                    "instance serves one model: create a new one for another model")
            return bucket
        bucket = self.buckets[key] = new_bucket(key, tensors, members, self.algorithm, self.backend,
                                                self.is_dense)
        saved = checkpoint.take_saved(self._restored, bucket)
        if saved is not None:
            checkpoint.restore(self, bucket, saved, tensors[0])
        return bucket

    def _restore_existing(self) -> None:
        """Restore the buckets that exist already from what was just loaded (``_restored``)."""
        for bucket in self.buckets.values():
            saved = checkpoint.take_saved(self._restored, bucket)
            if saved is not None:
                checkpoint.restore(self, bucket, saved, bucket.residual)

    def is_dense(self, sizes: tuple[int, ...]) -> bool:
        """A bucket of tensors that are all under ``dense_below`` is always averaged densely."""
        return all(self.algorithm.corrections.is_dense_tensor(n) for n in sizes)

    # --- statistics and checkpoints (engine/checkpoint.py) ---------------------------------------
    def stats(self) -> dict:
        """The last step, summed over buckets (see engine/stats.py for the fields)."""
        last = max((bk.step for bk in self.buckets.values()), default=1) - 1
        controls = {key: bk.control for key, bk in self._sparse_buckets().items()}
        return {**last_step_stats(self.algorithm, list(self.buckets.values()), last, controls),
                **self.totals}

    def step_times(self) -> dict:
        """Where the last step's host time went, summed over buckets (``<part>_seconds`` of
        engine/stats.py ``StepTimes``): cheap, no pass over any data."""
        return sum_times([bk.times for bk in self.buckets.values() if bk.times is not None])

    def state_dict(self) -> dict:
        """This rank's state: residuals (as NumPy) and the rank-consistent control state
        (engine/checkpoint.py has the format)."""
        return checkpoint.state_of(self)

    def load_state_dict(self, state: dict) -> None:
        """Restore a checkpoint taken by ``state_dict`` on this rank. At another world size, load any
        rank's file on every rank (e.g. that of rank ``r % old_size``): residuals are reset, the
        step and control state carry over. Buckets not created yet are restored when they appear."""
        checkpoint.check_loadable(state, self)
        self._restored_size = state["size"]
        self._restored = dict(state["buckets"])
        self.totals.update(state.get("totals", {}))
        self._restore_existing()

    def agreed_state(self, state: dict | None = None) -> dict:
        """The rank-independent part of ``state`` (default: this engine's ``state_dict``): no
        residuals, each bucket's step and ``Algorithm.agreed_control``. What every process adopts
        from one rank on an elastic reset (``adopt``)."""
        return checkpoint.agreed_part(self, self.state_dict() if state is None else state)

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
        self._restored_size = agreed["size"]
        self._restored = checkpoint.adopted(agreed, residuals or {}, momenta or {})
        self._restore_existing()
