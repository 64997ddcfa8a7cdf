"""Elastic Horovod in TensorFlow: Horovod's elastic states with a ``compression=`` keyword.

    state = hvd_sparse.tensorflow.elastic.TensorFlowKerasState(model, optimizer,
                                                               compression=compression, epoch=0)

    @hvd_sparse.tensorflow.elastic.run      # hvd.elastic.run, recovering from every Horovod op
    def train(state): ...

Horovod's TensorFlow states have no handler registry: every extra keyword is a plain object that
``sync()`` replaces with rank 0's (pickled), which would hand every rank rank 0's residuals and
leave the compressor the optimizer uses untouched. These subclasses take ``compression`` (one
compressor or a list) out of the keywords and commit, roll back, reset and synchronize it with the
model (``hvd_sparse.elastic.ElasticCompressor``); everything else is Horovod's.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import horovod.tensorflow as hvd
import tensorflow as tf
from horovod.common.elastic import run_fn
from horovod.common.exceptions import HorovodInternalError
from horovod.tensorflow import elastic as horovod_elastic
from horovod.tensorflow.functions import broadcast_object

from ..elastic import ElasticCompressor

if TYPE_CHECKING:   # the mixin's super() is Horovod's State; at run time the subclasses bring it
    from horovod.common.elastic import State as _State
else:
    _State = object


class _WithCompression(_State):
    """Mixin over a Horovod ObjectState: the compressors' save/restore/sync/reset around its own.
    The compressors save first (their commit runs one collective; if it fails, nothing of this
    commit is kept, model included)."""

    _compressors: list[ElasticCompressor]

    def _track(self, compression: Any) -> None:
        items = compression if isinstance(compression, (list, tuple)) else [compression]
        self._compressors = [ElasticCompressor(c) for c in items if c is not None]

    def save(self) -> None:
        for compressor in self._compressors:
            compressor.save()
        super().save()

    def restore(self) -> None:
        super().restore()
        for compressor in self._compressors:
            compressor.restore()

    def reset(self) -> None:
        super().reset()
        for compressor in self._compressors:
            compressor.reset()

    def sync(self) -> None:
        super().sync()
        for compressor in self._compressors:
            compressor.sync(broadcast_object)


class TensorFlowKerasState(_WithCompression, horovod_elastic.TensorFlowKerasState):
    """``hvd.elastic.TensorFlowKerasState`` that also tracks ``compression``."""

    def __init__(self, model: Any, optimizer: Any = None, backend: Any = None, *, compression: Any = None,
                 **kwargs: Any):
        self._track(compression)
        super().__init__(model, optimizer=optimizer, backend=backend, **kwargs)


class TensorFlowState(_WithCompression, horovod_elastic.TensorFlowState):
    """``hvd.elastic.TensorFlowState`` (a list of variables) that also tracks ``compression``."""

    def __init__(self, variables: Any = None, session: Any = None, *, compression: Any = None,
                 **kwargs: Any):
        self._track(compression)
        super().__init__(variables=variables, session=session, **kwargs)


def run(func: Callable) -> Callable:
    """``hvd.elastic.run`` for TensorFlow that recovers from a failed grouped allreduce and lets
    every other error through.

    Horovod 0.28.1's TensorFlow wrapper turns an ``UnknownError`` into ``HorovodInternalError``
    (rollback and reset) only when its message names HorovodAllreduce, HorovodAllgather or
    HorovodBroadcast, and swallows any other: the run function then returns None as if training
    had ended. A worker's death is reported by whichever Horovod op was in flight -- with
    whole-model methods (``num_groups=1``) often HorovodGroupedAllreduce -- and an error raised
    inside the compressor's ``tf.py_function`` (ranks that disagree, ``nonfinite="raise"``) is an
    ``UnknownError`` too. This runs Horovod's elastic loop (``run_fn``, with its TensorFlow reset)
    around a wrapper that treats every ``UnknownError`` naming a Horovod op as
    ``HorovodInternalError`` and raises any other."""

    @functools.wraps(func)
    def wrapper(state: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return func(state, *args, **kwargs)
        except tf.errors.UnknownError as error:
            if "Horovod" in str(error.message):
                raise HorovodInternalError(error) from error
            raise

    return run_fn(wrapper, _restart_horovod)


def _restart_horovod() -> None:
    """Horovod's TensorFlow reset between elastic rounds: a new Horovod for the new world."""
    hvd.shutdown()
    hvd.init()


__all__ = ["TensorFlowKerasState", "TensorFlowState", "run"]
