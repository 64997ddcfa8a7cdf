"""The TensorFlow face: a Horovod ``Compressor`` that runs an hvd_sparse method.

Horovod calls ``compress``/``decompress`` while it *traces* its gradient allreduce into a graph
(``tf.function`` in eager mode: docs/architecture.md#tensorflow-face), so Python here runs once per
trace, not once per step. The engine's step is ordinary eager Python, so it is embedded with
``tf.py_function``, which runs it every step; state (residuals, thresholds) stays in Python
between steps.

* Scope "tensor": each gradient's step becomes py_function phases joined by Horovod graph ops
  (asynchronous kernels, named by the gradient's position), so tensors may complete in any order.
  The gradients compressed before a ``decompress`` that needs one of them share their
  py_functions (phase p of all of them in one call): with every gradient in one Horovod group
  (``DistributedGradientTape`` here sets it) that is every gradient of the model, which takes
  MobileNetV2's 158 gradients from 474 py_function calls a step to 3; under Horovod's default
  grouping each gradient sits in its own ``tf.cond`` and keeps py_functions of its own. A method
  that packs per-tensor steps (``Algorithm.packs_tensors``: every per-tensor method but LAGS) takes the
  gradients built together in one bucket per dtype and selects in each as in a bucket of its
  own: one engine step and one set of collectives where there were as many as gradients.
* Other scopes (the whole model, merged groups): every ``compress`` of the trace stashes its
  gradient; the first ``decompress`` buckets them by the algorithm's plan. The whole model (with
  its ``dense_below`` bucket, if any) runs in one py_function with eager, blocking collectives
  (one per step per rank, so any protocol works, ``dense_steps`` included); merged groups become
  phased graphs as above where their phases are known in advance, else they too run in one
  py_function. This needs every gradient in one Horovod group
  (``num_groups=1``); without it each gradient sits in its own ``tf.cond`` and the compressor
  raises a clear error at trace time.
* A second momentum: with the momentum correction on (``momentum=``), Horovod's Keras optimizer
  (and ``hvd_sparse.tensorflow.keras.DistributedOptimizer``, at construction) lets the compressor
  see the optimizer, and an optimizer with momentum of its own (``momentum``, ``beta_1``) is
  warned about once. ``DistributedGradientTape`` cannot: the tape hands back reduced gradients
  that the caller's code applies afterwards, with an optimizer no compressor call can see (the
  warning would need the optimizer passed in, which Horovod's tape does not take).
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass, field
from typing import Any

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf
from horovod.tensorflow.compression import Compressor
from tensorflow.python.framework.func_graph import FuncGraph

from ..algorithms.base import MODEL, TENSOR, Algorithm
from ..algorithms.corrections import AdamPath
from ..backends import get_backend
from ..backends.tf_backend import Packed, unpack
from ..comm import Collective, run_blocking
from ..comm.horovod_tf import HorovodTFComm
from ..engine import Engine
from ..engine.buckets import check_gradient_dtype
from ..errors import ConfigurationError, RankMismatchError
from ..faces import FaceBase, refuse_reduction_op
from .horovod_internals import calling_allreduce_op, calling_keras_optimizer
from .keras import optimizer_momentum, refuse_keras3_under_horovod_keras

_PLACEHOLDER_DTYPES = (tf.float16, tf.float32, tf.float64)


@dataclass
class _Trace:
    """What one trace of Horovod's allreduce function has seen so far."""

    stash: list = field(default_factory=list)
    outputs: list | None = None    # scope "tensor": the built ones, growing; else all, at once


@dataclass
class _Step:
    """One training step at run time (inside ``tf.py_function``): the bucket protocols in flight,
    by key. A new one at the first phase of a step's first bucket and at a reset
    (``_forget_step``)."""

    inflight: dict[str, Any] = field(default_factory=dict)


def _refuse_eager_and_keras3() -> None:
    """Refuse an eager call (the compressor builds graphs) and Horovod's Keras optimizer on Keras 3."""
    if tf.executing_eagerly():
        raise ConfigurationError(
            "hvd_sparse TensorFlow compressors are built into a graph: use them through "
            "hvd.DistributedGradientTape, the Keras DistributedOptimizer, or inside tf.function")
    refuse_keras3_under_horovod_keras()


def _root_graph() -> Any:
    """The outermost function graph being traced (cond branches are nested function graphs); in
    TF1-style graph mode, the graph itself."""
    graph = tf.compat.v1.get_default_graph()
    while isinstance(getattr(graph, "outer_graph", None), FuncGraph):
        graph = graph.outer_graph
    return graph


def _specs(tensors: list) -> tuple:
    """The specs of a bucket's gradients (what the engine reads of each: shape and dtype)."""
    return tuple(tf.TensorSpec(t.shape, t.dtype) for t in tensors)


def _parts_of(average: Any, inputs: Any) -> list:
    """A bucket step's average (fp32), one tensor per gradient, any shape (the graph's ``unpack``
    shapes them): ``Packed.parts``, or the inputs themselves for a bucket the engine returned
    untouched (every tensor empty). No eager op where the part is fp32 already."""
    parts = average.parts if isinstance(average, Packed) else inputs
    return [p if p.dtype == tf.float32 else tf.cast(p, tf.float32) for p in parts]


def _placeholder(tensor: tf.Tensor, dtype: tf.DType) -> tf.Tensor:
    """What Horovod allreduces in a gradient's place (its result is only waited for): one number
    read from the gradient. Not a constant: Grappler's constant folding would run Horovod's
    allreduce of a constant while it optimizes the traced function, a collective outside any
    step that only processes optimizing at that moment meet in -- a worker that joins an elastic
    job later would wait there for ever."""
    first = tf.reshape(tensor, [-1])[:1]
    return tf.cast(tf.reduce_sum(first, keepdims=True), dtype)


class SparseCompressor(FaceBase, Compressor):
    """Horovod compressor running ``algorithm`` (an ``hvd_sparse.algorithms.Algorithm``); the
    options are FaceBase's (hvd_sparse/faces.py). ``optimizer=``: the Keras optimizer, whose
    ``hvd_sparse.tensorflow.optimizers.AdamW`` (or ``Adam``) turns the Adam path on
    (docs/methods.md#adam-and-adamw); in TensorFlow the path needs a method whose buckets run as
    one step (``scope="model"``, or LAGS's groups): its dense steps change a step's collectives,
    which a graph built per tensor cannot follow."""

    framework = "tensorflow"

    def __init__(self, algorithm: Algorithm, *, process_set: Any = None, prefix: str = "hvd_sparse",
                 nonfinite: str = "skip", optimizer: Any = None):
        FaceBase.__init__(self, algorithm, process_set=process_set, prefix=prefix, nonfinite=nonfinite,
                          optimizer=optimizer)
        if algorithm.corrections.adam is not None and algorithm.scope == TENSOR:
            raise ConfigurationError(
                f"{type(algorithm).__name__}(scope='tensor') cannot run the Adam path in TensorFlow: "
                "its dense steps average every gradient densely, which changes a step's collectives "
                "after them, and TensorFlow builds a per-tensor step into a graph once. Pass "
                "scope='model' (one bucket, run eagerly every step)")
        self._comm: HorovodTFComm | None = None
        self._traces: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._step = _Step()
        self._members: dict[str, tuple[str, ...]] = {}   # bucket -> its gradients' keys, if it packs them
        self._config_checked = self._layout_checked = False

    # --- Horovod's interface (trace time) -------------------------------------------------------
    @tf.autograph.experimental.do_not_convert  # plain Python that builds the graph
    def compress(self, tensor: tf.Tensor) -> tuple[tf.Tensor, Any]:
        """Horovod's call per gradient, at trace time: refuse what cannot work, then build the tensor's step
        (scope "tensor") or stash the gradient; a one-element placeholder for Horovod's allreduce."""
        # Everything that cannot work is refused here, at trace time, on every rank: no
        # collective of the step has run yet. The caller's op and optimizer are read here, in
        # compress itself (calling_allreduce_op reads the stack from compress's caller).
        refuse_reduction_op(calling_allreduce_op(self), hvd)
        _refuse_eager_and_keras3()
        if not (self._optimizer_seen and self._stock_adam_warned):
            optimizer = calling_keras_optimizer()
            if optimizer is not None:
                self._note_optimizer(optimizer)
        self._agree_on_config_once()
        trace = self._trace()
        check_gradient_dtype(getattr(tensor, "name", f"g{len(trace.stash)}"), tensor.dtype.name)
        dtype = tensor.dtype if tensor.dtype in _PLACEHOLDER_DTYPES else tf.float32
        return _placeholder(tensor, dtype), self._file(trace, tensor)

    def _file(self, trace: _Trace, tensor: tf.Tensor) -> Any:
        """What ``decompress`` receives for the gradient: its position in the trace's stash. Its
        step is built by the first ``decompress`` that needs it: in scope "tensor" together with
        every gradient stashed since the last build (all of them in one Horovod group, only
        itself under Horovod's default grouping), else with the whole stash, bucketed by the
        method's plan, which needs every gradient compressed by then."""
        if self.algorithm.scope != TENSOR and trace.outputs is not None:
            raise ConfigurationError(
                f"{type(self.algorithm).__name__} with scope={self.algorithm.scope!r} needs every "
                "gradient in one Horovod group: pass groups=1 (or the deprecated num_groups=1) to "
                "hvd.DistributedGradientTape or to the Keras hvd.DistributedOptimizer (or use "
                "hvd_sparse.tensorflow.DistributedGradientTape, which does it for you)")
        trace.stash.append(tensor)
        return len(trace.stash) - 1

    @tf.autograph.experimental.do_not_convert
    def decompress(self, tensor: tf.Tensor, ctx: Any) -> tf.Tensor:
        """Horovod's call per gradient after its allreduce: the average over ranks (built, with
        the steps of the gradients stashed alongside it, at the first call that needs it)."""
        trace = self._trace()
        if self._adam_link is not None:   # the optimizer applies this trace's outputs as updates
            self._adam_link.active = True
        if self.algorithm.scope == TENSOR:
            built = trace.outputs = trace.outputs or []
            if ctx >= len(built):   # every gradient compressed since the last build, together
                built += self._tensor_graphs(trace.stash[len(built):], len(built))
            out = built[ctx]
        else:
            if trace.outputs is None:
                trace.outputs = self._bucket_graphs(trace.stash)
            out = trace.outputs[ctx]
        with tf.control_dependencies([tensor]):  # keep Horovod's placeholder allreduce in the graph
            return tf.identity(out)

    def _agree_on_config_once(self) -> None:
        """At the first trace (every rank traces at its first step, before any collective of the
        step runs), check that every rank runs the same method with the same options. The layout
        is checked at the first ``decompress`` of a trace of multi-tensor buckets (every gradient
        is known there, still before anything runs); per-tensor steps never see the whole model
        (docs/usage.md#ranks-that-disagree)."""
        engine = self._ensure_engine()
        if not self._config_checked:
            self._config_checked = True
            self._run_out_of_graph(engine.agree_on_config(None))

    def _agree_at_sync(self) -> None:
        """An elastic job that grows: the survivors' steps were traced before the reset, a
        newcomer traces its own now, so a check made while tracing would be a collective that
        only the newcomer issues (and, eager collectives being matched by order, it would meet
        the survivors' step). From the first sync of a running job on, every process checks the
        method and options here instead, and a whole-model bucket's layout at its first step
        (the engine's own check, every engine being new after a reset)."""
        self._config_checked = self._layout_checked = True
        self._run_out_of_graph(self._ensure_engine().agree_on_config(None))

    def _run_out_of_graph(self, protocol: Any) -> None:
        """Run a protocol eagerly and blocking, also while a graph is traced; in TF1-style graph
        mode there is no eager context: the engine's first step checks instead."""
        with tf.init_scope():
            if tf.executing_eagerly():
                run_blocking(protocol, self._comm.execute)

    # --- the Adam path's optimizer (hvd_sparse/tensorflow/optimizers.py) ----------------------------
    @classmethod
    def adam_path_of(cls, optimizer: Any) -> Any:
        """``FaceBase.adam_path_of`` for Keras optimizers."""
        if optimizer is None or isinstance(optimizer, AdamPath):
            return optimizer
        from .optimizers import adam_path_of
        return adam_path_of(optimizer)

    def _link_optimizer(self, optimizer: Any, path: Any) -> Any:
        from .optimizers import link
        return link(optimizer, path, self._current_world) if hasattr(optimizer, "get_config") else None

    def _momentum_of(self, optimizer: Any) -> str | None:
        return optimizer_momentum(optimizer)

    def _is_stock_adam(self, optimizer: Any) -> bool:
        from .optimizers import is_stock_adam
        return is_stock_adam(optimizer)

    def _sum_over_ranks(self, values: np.ndarray, name: str) -> np.ndarray:
        if not tf.executing_eagerly():
            raise ConfigurationError("average_stats runs eagerly: call it outside tf.function")
        assert self._comm is not None, "made with the engine, which every caller has"
        summed = hvd.allreduce(tf.constant(values), op=hvd.Sum, name=name,
                               process_set=self._comm.process_set)
        return summed.numpy()

    # --- graph construction -----------------------------------------------------------------------
    def _make_engine(self) -> Engine:
        self._comm = HorovodTFComm(self.process_set)
        return Engine(self.algorithm, get_backend("tensorflow"), self._comm.rank, self._comm.size,
                      self.prefix, self.nonfinite)

    def _current_world(self) -> tuple[int, int]:
        process_set = self.process_set if self.process_set is not None else hvd.global_process_set
        return process_set.rank(), process_set.size()

    def _forget_step(self) -> None:
        """A reset (elastic): the step in flight is abandoned."""
        self._step = _Step()

    def _trace(self) -> _Trace:
        graph = _root_graph()
        if graph not in self._traces:
            self._traces[graph] = _Trace()
        return self._traces[graph]

    def _bucket_graphs(self, grads: list) -> list:
        """Outputs for every stashed gradient, bucketed by the algorithm's plan. Whole-model
        scope -- one bucket, or the model and the ``dense_below`` bucket -- runs in one
        py_function with blocking collectives, bucket after bucket: any protocol works there (one
        that selects with a broadcast, or averages densely for its first ``dense_steps``), and a
        step that raises is taken back whole. Merged groups run as phased graphs, which may
        complete in any order, unless some group's phases are not known before it runs; then
        they too run in one py_function."""
        keys = [f"g{i}" for i in range(len(grads))]
        if not self._layout_checked:
            self._layout_checked = True
            layout = [(key, None if g.shape.rank is None else tuple(g.shape.as_list()), g.dtype.name)
                      for key, g in zip(keys, grads, strict=True)]
            self._run_out_of_graph(self._engine.agree_on_config(layout))
        plan = self.algorithm.plan(keys, [g.shape.num_elements() for g in grads])
        position = {key: i for i, key in enumerate(keys)}
        buckets = [(bucket, [grads[position[key]] for key in members]) for bucket, members in plan]
        if self.algorithm.scope == MODEL or len(plan) == 1 or not self._phases_known(buckets):
            inputs = [t for _, tensors in buckets for t in tensors]
            averages = tf.py_function(
                functools.partial(self._run_blocking, [(bucket, _specs(ts)) for bucket, ts in buckets]),
                inputs, Tout=[tf.float32] * len(inputs))   # the average is fp32 (engine/patterns.py)
            results, offset = [], 0
            for _, tensors in buckets:
                results.append(unpack(averages[offset:offset + len(tensors)], _specs(tensors)))
                offset += len(tensors)
        else:
            results = self._phased_graphs(buckets)
        outputs: list = [None] * len(grads)
        for (_, members), (_, tensors), outs in zip(plan, buckets, results, strict=True):
            for key, out, grad in zip(members, outs, tensors, strict=True):
                out.set_shape(grad.shape)
                outputs[position[key]] = out
        return outputs

    def _tensor_graphs(self, grads: list, first: int) -> list:
        """Scope "tensor": the outputs of ``grads`` (the stash's from position ``first`` on), their
        steps built as phased graphs. A method that packs per-tensor steps
        (``Algorithm.packs_tensors``) takes the gradients of each dtype in one bucket
        (``Algorithm.pack`` without a limit), selecting in each as in a bucket of its own: a step's
        cost in the graph and in the engine is per bucket, and a bucket per gradient cost
        ResNet-18 a tenth of its step on loopback (docs/architecture.md#tensorflow-face).
        Gradients under ``dense_below`` (averaged densely) and empty ones keep buckets of their
        own, as does every gradient otherwise."""
        keys = [f"g{p}" for p in range(first, first + len(grads))]
        by_key = dict(zip(keys, grads, strict=True))
        plan = self.algorithm.pack([(key, [key]) for key in keys],
                                   {key: g.shape.num_elements() for key, g in by_key.items()},
                                   {key: g.dtype.name for key, g in by_key.items()})
        for bucket, members in plan:
            self._members[bucket] = self.algorithm.step_members(members)
        outputs = self._phased_graphs([(bucket, [by_key[k] for k in members]) for bucket, members in plan])
        position = {key: i for i, key in enumerate(keys)}
        result: list = [None] * len(grads)
        for (_, members), outs in zip(plan, outputs, strict=True):
            for key, out in zip(members, outs, strict=True):
                result[position[key]] = out
        return result

    def _phases_known(self, buckets: list) -> bool:
        """Whether every bucket's phases are known before it runs (``Engine.schedule``), so that
        it can be built as a phased graph: not with ``dense_steps`` (the collectives change after
        them) or a method that exchanges messages while selecting."""
        try:
            for bucket, tensors in buckets:
                sizes = tuple(t.shape.num_elements() for t in tensors)
                self._engine.schedule(bucket, sum(sizes), tuple(t.dtype.name for t in tensors), sizes)
        except ConfigurationError:
            return False
        return True

    def _phased_graphs(self, buckets: list) -> list:
        """The steps of ``buckets`` ((key, tensors), in plan order) as phased graphs, every
        bucket's phase p in one py_function (a bucket whose schedule is shorter finishes in the
        py_function after its last phase), joined by each phase's Horovod graph collectives, which
        Horovod matches by name; each bucket's averaged tensors."""
        schedules = [self._engine.schedule(key, sum(t.shape.num_elements() for t in ts),
                                           tuple(t.dtype.name for t in ts),
                                           tuple(t.shape.num_elements() for t in ts))
                     for key, ts in buckets]
        specs = [_specs(ts) for _, ts in buckets]
        inputs: list = [list(ts) for _, ts in buckets]
        outputs: list = [None] * len(buckets)
        for position in range(max(len(s) for s in schedules) + 1):
            active = [i for i, s in enumerate(schedules) if position <= len(s)]
            plan = [(buckets[i][0], schedules[i][position] if position < len(schedules[i]) else None,
                     specs[i], len(inputs[i])) for i in active]
            tout = [dtype for _, phase, specs_i, _ in plan
                    for _, _, dtype in phase or [(None, None, tf.float32)] * len(specs_i)]
            flat = tf.py_function(functools.partial(self._advance_all, position, plan),
                                  [t for i in active for t in inputs[i]], Tout=tout)
            offset = 0
            for i, (_, phase, _, _) in zip(active, plan, strict=True):
                if phase is None:   # finished: the fp32 average, a tensor per gradient (engine/patterns.py)
                    outputs[i] = unpack(flat[offset:offset + len(specs[i])], specs[i])
                    offset += len(specs[i])
                    continue
                inputs[i] = [self._comm.graph_op(op, t, name) for (op, name, _), t in
                             zip(phase, flat[offset:offset + len(phase)], strict=True)]
                offset += len(phase)
        for outs, (_, tensors) in zip(outputs, buckets, strict=True):
            for out, tensor in zip(outs, tensors, strict=True):
                out.set_shape(tensor.shape)
        return outputs

    # --- run time (inside tf.py_function, eager) --------------------------------------------------
    def _advance_all(self, position: int, plan: list, *results) -> list:
        """Phase ``position`` of every bucket of ``plan`` ((key, expected phase, specs, number of
        inputs), in plan order), run by one ``tf.py_function``: ``_advance`` of each, on its share
        of ``results``; their outputs, concatenated."""
        out, offset = [], 0
        for key, expected, specs, count in plan:
            out += self._advance(key, position, expected, specs, *results[offset:offset + count])
            offset += count
        return out

    def _advance(self, key: str, position: int, expected: list | None, specs: tuple, *results) -> list:
        """Phase ``position`` of bucket ``key``'s step, run by its ``tf.py_function``: the tensors
        of the next phase's collectives (checked against ``expected``, what the graph was built
        for), or the bucket's average after the last (a tensor per gradient). ``results`` are
        the gradients (``specs``: theirs) at position 0, else what the last phase's collectives
        returned."""
        if position == 0:
            if not self._step.inflight:   # the first phase of a step's first tensor
                self._follow_world()
                self._step = _Step()
            protocol = self._engine.step(key, Packed(specs, results), check_layout=False,
                                         members=self._members.get(key, ()))
            self._step.inflight[key] = protocol
            sent = None
        else:
            protocol = self._step.inflight[key]
            sent = list(results)
        try:
            phase: list[Collective] = next(protocol) if sent is None else protocol.send(sent)
        except StopIteration as done:
            del self._step.inflight[key]
            return _parts_of(done.value, results)
        if expected is None or [(c.op, c.name) for c in phase] != [(op, n) for op, n, _ in expected]:
            raise RankMismatchError(f"step of {key!r} issued {[c.signature() for c in phase]}, the "
                                    f"graph was built for {expected}")
        return [c.tensor for c in phase]

    def _run_blocking(self, layout: list[tuple[str, tuple]], *grads) -> list:
        """Every bucket of ``layout`` ((bucket, its tensors' specs), in plan order, the same on
        every rank) one after the other, with eager blocking collectives; ``grads``: every
        bucket's gradients, in order. Every bucket's average, a tensor per gradient."""
        self._follow_world()
        engine, outputs, done = self._engine, [], []
        try:
            offset = 0
            for key, specs in layout:
                tensors = grads[offset:offset + len(specs)]
                offset += len(specs)
                average = run_blocking(engine.step(key, Packed(specs, tensors)), self._comm.execute)
                outputs += _parts_of(average, tensors)
                done.append(key)
        except FloatingPointError:
            # Raised on every rank at the same bucket (nonfinite="raise"): the buckets that
            # finished take their step back, so the step is applied nowhere
            # (docs/usage.md#non-finite-gradients); the later ones have not started on any rank.
            engine.take_back(done)
            raise
        return outputs

