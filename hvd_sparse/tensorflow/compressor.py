"""The TensorFlow face: a Horovod ``Compressor`` that runs an hvd_sparse method.

Horovod calls ``compress``/``decompress`` while it *traces* its gradient allreduce into a graph
(``tf.function`` in eager mode, HOROVOD.md 1.4), so Python here runs once per trace, not once per
step. The engine's step is ordinary eager Python, so it is embedded with ``tf.py_function``, which
runs it every step; state (residuals, thresholds) stays in Python between steps.

* Scope "tensor": each gradient's step becomes py_function phases joined by Horovod graph ops
  (asynchronous kernels, named by the gradient's position), so tensors may complete in any order.
* Other scopes (the whole model, merged groups): every ``compress`` of the trace stashes its
  gradient; the first ``decompress`` buckets them by the algorithm's plan. One bucket runs in one
  py_function with eager, blocking collectives (one per step per rank, so any protocol works);
  several become phased graphs as above. This needs every gradient in one Horovod group
  (``num_groups=1``); without it each gradient sits in its own ``tf.cond`` and the compressor
  raises a clear error at trace time.
"""

from __future__ import annotations

import functools
import sys
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import horovod.tensorflow as hvd
import tensorflow as tf
from horovod.tensorflow.compression import Compressor
from tensorflow.python.framework.func_graph import FuncGraph

from .. import monitor
from ..algorithms.base import TENSOR, Algorithm, check_choice
from ..backends import get_backend
from ..comm import Collective, run_blocking
from ..comm.horovod_tf import HorovodTFComm
from ..engine import Engine, summarize
from ..engine.core import NONFINITE_POLICIES, check_gradient_dtype
from ..errors import ConfigurationError, RankMismatchError
from .keras import refuse_keras3_under_horovod_keras

_PLACEHOLDER_DTYPES = (tf.float16, tf.float32, tf.float64)
_OP_NAMES = {hvd.Sum: "hvd.Sum", hvd.Adasum: "hvd.Adasum", hvd.Min: "hvd.Min", hvd.Max: "hvd.Max",
             hvd.Product: "hvd.Product"}


def refuse_reduction_op(op: Any) -> None:
    """Raise unless ``op`` (the calling Horovod allreduce's reduction) is Average: a sparsifier
    returns the average over ranks whatever Horovod is told to compute."""
    if op is None or op == hvd.Average:
        return
    if op == hvd.Adasum:
        raise ConfigurationError(
            "op=hvd.Adasum cannot be combined with an hvd_sparse compressor: the Adasum operator "
            "combines whole dense tensors, which a sparse exchange does not compute. Use "
            "op=hvd.Average (the default) with hvd_sparse, or Adasum without compression")
    raise ConfigurationError(
        f"op={_OP_NAMES.get(op, op)} cannot be combined with an hvd_sparse compressor, which always "
        "returns the average over ranks: pass op=hvd.Average (the default); for a sum, scale the "
        "learning rate by hvd.size()")


def _calling_allreduce_op(compressor: Any) -> Any:
    """The reduction op of the Horovod allreduce calling ``compressor.compress``, read from its
    frame (Horovod passes the tensor alone, HOROVOD.md 1.4): the nearest caller whose locals hold
    this compressor as ``compression`` and an ``op`` -- ``hvd.allreduce``/``grouped_allreduce``,
    or the pieces AutoGraph makes of them inside ``tf.function``. None when called otherwise."""
    frame = sys._getframe(2)
    for _ in range(12):
        if frame is None:
            return None
        names = frame.f_locals
        if names.get("compression") is compressor and "op" in names:
            return names["op"]
        frame = frame.f_back
    return None


@dataclass
class _Trace:
    """What one trace of Horovod's allreduce function has seen so far."""

    stash: list = field(default_factory=list)
    outputs: list | None = None


def _root_graph() -> Any:
    """The outermost function graph being traced (cond branches are nested function graphs); in
    TF1-style graph mode, the graph itself."""
    graph = tf.compat.v1.get_default_graph()
    while isinstance(getattr(graph, "outer_graph", None), FuncGraph):
        graph = graph.outer_graph
    return graph


class SparseCompressor(Compressor):
    """Horovod compressor running ``algorithm`` (an ``hvd_sparse.algorithms.Algorithm``).

    Args:
        algorithm: the method and its hyper-parameters.
        process_set: the Horovod process set the gradients are reduced over (default: global).
        prefix: prefix of every collective's name; give two compressors in one job distinct ones.
        nonfinite: what a rank does with a NaN/Inf gradient: "skip" (send zeros this step, keep
            the residual, warn), "raise" (every rank raises FloatingPointError) or "ignore".
    """

    def __init__(self, algorithm: Algorithm, *, process_set: Any = None, prefix: str = "hvd_sparse",
                 nonfinite: str = "skip"):
        self.algorithm = algorithm
        self.process_set = process_set
        self.prefix = prefix
        self.nonfinite = check_choice("nonfinite", nonfinite, NONFINITE_POLICIES)
        self._engine: Engine | None = None
        self._comm: HorovodTFComm | None = None
        self._traces: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._inflight: dict[str, Any] = {}

    framework = "tensorflow"

    # --- Horovod's interface (trace time) -------------------------------------------------------
    @tf.autograph.experimental.do_not_convert  # plain Python that builds the graph
    def compress(self, tensor: tf.Tensor) -> tuple[tf.Tensor, Any]:
        # Everything that cannot work is refused here, at trace time, on every rank: no
        # collective of the step has run yet.
        refuse_reduction_op(_calling_allreduce_op(self))
        if tf.executing_eagerly():
            raise ConfigurationError(
                "hvd_sparse TensorFlow compressors are built into a graph: use them through "
                "hvd.DistributedGradientTape, the Keras DistributedOptimizer, or inside tf.function")
        refuse_keras3_under_horovod_keras()
        self._ensure_engine()
        trace = self._trace()
        check_gradient_dtype(getattr(tensor, "name", f"g{len(trace.stash)}"), tensor.dtype.name)
        dtype = tensor.dtype if tensor.dtype in _PLACEHOLDER_DTYPES else tf.float32
        placeholder = tf.zeros([1], dtype=dtype)
        if self.algorithm.scope == TENSOR:  # works whatever Horovod's grouping
            key = f"g{len(trace.stash)}"
            trace.stash.append(tensor)
            return placeholder, self._phased_graph(key, [tensor])[0]
        if trace.outputs is not None:
            raise ConfigurationError(
                f"{type(self.algorithm).__name__} with scope={self.algorithm.scope!r} needs every "
                "gradient in one Horovod group: pass num_groups=1 to hvd.DistributedGradientTape or "
                "to the Keras hvd.DistributedOptimizer (or use "
                "hvd_sparse.tensorflow.DistributedGradientTape, which does it for you)")
        trace.stash.append(tensor)
        return placeholder, len(trace.stash) - 1

    @tf.autograph.experimental.do_not_convert
    def decompress(self, tensor: tf.Tensor, ctx: Any) -> tf.Tensor:
        if self.algorithm.scope == TENSOR:
            out = ctx
        else:
            trace = self._trace()
            if trace.outputs is None:
                trace.outputs = self._bucket_graphs(trace.stash)
            out = trace.outputs[ctx]
        with tf.control_dependencies([tensor]):  # keep Horovod's placeholder allreduce in the graph
            return tf.identity(out)

    # --- schedules, statistics and checkpoints ---------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Tell a method with an epoch schedule (DGC's density warm-up) that ``epoch`` (0-based)
        starts; call it on every rank (``CompressionCallback`` does for Keras). It takes effect
        at the next step without re-tracing. Methods without a schedule ignore it."""
        hook = getattr(self.algorithm, "set_epoch", None)
        if hook is not None:
            hook(epoch)

    def stats(self) -> dict:
        """Statistics of the last step on this rank (see README, "Statistics")."""
        if self._engine is None:
            return summarize([], self.algorithm.density)
        return self._engine.stats()

    def average_stats(self, keys: Sequence[str] = monitor.DEFAULT_KEYS) -> dict[str, float]:
        """The mean over ranks of the chosen statistics, on every rank. One named allreduce
        (eager, outside ``tf.function``): every rank must call it at the same point."""
        if not tf.executing_eagerly():
            raise ConfigurationError("average_stats runs eagerly: call it outside tf.function")
        values = tf.constant(monitor.stat_vector(self.stats(), keys), dtype=tf.float64)
        self._ensure_engine()
        summed = hvd.allreduce(values, op=hvd.Sum, name=f"{self.prefix}.stats",
                               process_set=self._comm.process_set)
        return monitor.mean_over_ranks(keys, summed.numpy().tolist(), self._comm.size)

    @property
    def rank(self) -> int:
        """This process's rank in the compressor's process set."""
        return self._ensure_engine().rank

    def state_dict(self) -> dict:
        """This rank's state (residuals and control state); save one file per rank."""
        return self._ensure_engine().state_dict()

    def load_state_dict(self, state: dict) -> None:
        self._ensure_engine().load_state_dict(state)

    def __repr__(self) -> str:
        return f"hvd_sparse.tensorflow.{self.algorithm!r}"

    # --- graph construction -----------------------------------------------------------------------
    def _ensure_engine(self) -> Engine:
        if self._engine is None:
            self._comm = HorovodTFComm(self.process_set)
            self._engine = Engine(self.algorithm, get_backend("tensorflow"), self._comm.rank,
                                  self._comm.size, self.prefix, self.nonfinite)
        return self._engine

    def _trace(self) -> _Trace:
        graph = _root_graph()
        if graph not in self._traces:
            self._traces[graph] = _Trace()
        return self._traces[graph]

    def _bucket_graphs(self, grads: list) -> list:
        """Outputs for every stashed gradient, bucketed by the algorithm's plan. A single bucket
        runs in one py_function with blocking collectives (any protocol, e.g. one that selects with
        a broadcast); several run as phased graphs, which may complete in any order."""
        keys = [f"g{i}" for i in range(len(grads))]
        plan = self.algorithm.plan(keys, [g.shape.num_elements() for g in grads])
        position = {key: i for i, key in enumerate(keys)}
        outputs: list = [None] * len(grads)
        for bucket, members in plan:
            tensors = [grads[position[key]] for key in members]
            if len(plan) == 1:
                results = tf.py_function(functools.partial(self._run_blocking, bucket), tensors,
                                         Tout=[t.dtype for t in tensors])
            else:
                results = self._phased_graph(bucket, tensors)
            for key, out, grad in zip(members, results, tensors, strict=True):
                out.set_shape(grad.shape)
                outputs[position[key]] = out
        return outputs

    def _phased_graph(self, key: str, tensors: list) -> list:
        """The bucket's step as py_function phases joined by Horovod graph collectives."""
        engine, comm = self._engine, self._comm
        schedule = engine.schedule(key, sum(t.shape.num_elements() for t in tensors),
                                   tuple(t.dtype.name for t in tensors))
        inputs = list(tensors)
        for position, phase in enumerate(schedule):
            requests = tf.py_function(functools.partial(self._advance, key, position, phase), inputs,
                                      Tout=[dtype for _, _, dtype in phase])
            inputs = [comm.graph_op(op, t, name) for (op, name, _), t in zip(phase, requests, strict=True)]
        outputs = tf.py_function(functools.partial(self._advance, key, len(schedule), None), inputs,
                                 Tout=[t.dtype for t in tensors])
        for out, tensor in zip(outputs, tensors, strict=True):
            out.set_shape(tensor.shape)
        return outputs

    # --- run time (inside tf.py_function, eager) --------------------------------------------------
    def _advance(self, key: str, position: int, expected: list | None, *results) -> list:
        if position == 0:
            protocol = self._engine.step(key, list(results), check_layout=False)
            self._inflight[key] = protocol
            sent = None
        else:
            protocol = self._inflight[key]
            sent = list(results)
        try:
            phase: list[Collective] = next(protocol) if sent is None else protocol.send(sent)
        except StopIteration as done:
            del self._inflight[key]
            return done.value
        if expected is None or [(c.op, c.name) for c in phase] != [(op, n) for op, n, _ in expected]:
            raise RankMismatchError(f"step of {key!r} issued {[c.signature() for c in phase]}, the "
                                    f"graph was built for {expected}")
        return [c.tensor for c in phase]

    def _run_blocking(self, key: str, *grads) -> list:
        return run_blocking(self._engine.step(key, list(grads)), self._comm.execute)


def with_model_grouping(compression: Any, kwargs: dict) -> dict:
    """Horovod keyword arguments with every gradient in one group (``num_groups=1``) when
    ``compression`` buckets several tensors together and the caller chose no grouping."""
    algorithm = getattr(compression, "algorithm", None)
    if algorithm is not None and algorithm.scope != TENSOR and "groups" not in kwargs:
        kwargs = {**kwargs, "num_groups": kwargs.get("num_groups") or 1}
    return kwargs
