"""The TensorFlow face: a Horovod ``Compressor`` that runs an hvd_sparse method. Horovod calls
``compress``/``decompress`` while it traces its allreduce function, once per trace: ``compress``
stashes each gradient and returns a placeholder for Horovod to allreduce, and the first
``decompress`` that needs a gradient builds the step graphs of those stashed (step_graphs.py;
docs/architecture.md#tensorflow-face). Scope "tensor" builds the gradients compressed since the
last build; other scopes bucket the whole stash by the method's plan, which needs every gradient
in one Horovod group (``groups=1``, which ``hvd_sparse.tensorflow.DistributedGradientTape`` and
the Keras optimizer set), else a clear error at trace time.

With the momentum correction on (``momentum=``), Horovod's Keras optimizer lets the compressor see
the optimizer, and one with momentum of its own is warned about once. ``DistributedGradientTape``
cannot: the caller applies the reduced gradients with an optimizer no compressor call can see.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf
from horovod.tensorflow.compression import Compressor
from tensorflow.python.framework.func_graph import FuncGraph

from ..algorithms.base import TENSOR, Algorithm
from ..algorithms.corrections import AdamPath
from ..backends import get_backend
from ..comm import run_blocking
from ..comm.horovod_tf import HorovodTFComm
from ..engine import Engine
from ..engine.buckets import check_gradient_dtype
from ..errors import ConfigurationError
from ..faces import FaceBase, refuse_reduction_op
from .horovod_internals import calling_allreduce_op, calling_keras_optimizer
from .keras import optimizer_momentum, refuse_keras3_under_horovod_keras
from .step_graphs import StepGraphs

_PLACEHOLDER_DTYPES = (tf.float16, tf.float32, tf.float64)


@dataclass
class _Trace:
    """What one trace of Horovod's allreduce function has seen so far."""

    stash: list = field(default_factory=list)
    outputs: list | None = None    # scope "tensor": the built ones, growing; else all, at once


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
        self._graphs = StepGraphs(algorithm, self._ensure_engine, self._running_comm, self._follow_world)
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
                built += self._graphs.tensor_graphs(trace.stash[len(built):], len(built))
            out = built[ctx]
        else:
            if trace.outputs is None:
                self._agree_on_layout(trace.stash)
                trace.outputs = self._graphs.bucket_graphs(trace.stash)
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

    def _agree_on_layout(self, grads: list) -> None:
        """At the first build of multi-tensor buckets: every rank's gradients, still before
        anything runs (``_agree_on_config_once``)."""
        if not self._layout_checked:
            self._layout_checked = True
            layout = [(f"g{i}", None if g.shape.rank is None else tuple(g.shape.as_list()), g.dtype.name)
                      for i, g in enumerate(grads)]
            self._run_out_of_graph(self._ensure_engine().agree_on_config(layout))

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
        process_set = self._running_comm().process_set
        return hvd.allreduce(tf.constant(values), op=hvd.Sum, name=name, process_set=process_set).numpy()

    # --- graph construction -----------------------------------------------------------------------
    def _make_comm(self) -> HorovodTFComm:
        """The collectives' layer: Horovod's (a unit test's threads: comm/threads.py)."""
        return HorovodTFComm(self.process_set)

    def _make_engine(self) -> Engine:
        self._comm = self._make_comm()
        return Engine(self.algorithm, get_backend("tensorflow"), self._comm.rank, self._comm.size,
                      self.prefix, self.nonfinite)

    def _current_world(self) -> tuple[int, int]:
        process_set = self.process_set if self.process_set is not None else hvd.global_process_set
        return process_set.rank(), process_set.size()

    def _forget_step(self) -> None:
        """A reset (elastic): the step in flight is abandoned."""
        self._graphs.forget()

    def _running_comm(self) -> HorovodTFComm:
        """The communication layer of the current engine (made with it)."""
        self._ensure_engine()
        assert self._comm is not None, "_make_engine makes it"
        return self._comm

    def _trace(self) -> _Trace:
        return self._traces.setdefault(_root_graph(), _Trace())

