"""Worker: what hvd_sparse/tensorflow/horovod_internals.py reads from Horovod, seen in a real job.

A probe compressor records, inside ``compress``, the op ``calling_allreduce_op`` reads, whether
``called_from_horovod_keras`` sees Horovod's Keras optimizer and the momentum of the optimizer
``calling_keras_optimizer`` finds (none outside Keras), for every way Horovod calls it
(``allreduce``, ``grouped_allreduce``, ``DistributedGradientTape`` traced in ``tf.function``,
eager ``allreduce``, the Keras optimizer in ``model.fit``) and every reduction; each must be
exactly the one given. Then ``hs.TopK`` must be refused under Adasum and other ops. Run by
tests/multiproc/test_horovod_refusals.py; prints ``CHECKED tf/<case> rank=<r>``.
"""

from __future__ import annotations

import contextlib

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf
from checks import check_op_refused
from horovod.tensorflow.compression import Compressor

import hvd_sparse.tensorflow as hs
from hvd_sparse.tensorflow.horovod_internals import (
    called_from_horovod_keras,
    calling_allreduce_op,
    calling_keras_optimizer,
)
from hvd_sparse.tensorflow.keras import optimizer_momentum

OPS = {"Average": hvd.Average, "Sum": hvd.Sum, "Min": hvd.Min, "Max": hvd.Max, "Product": hvd.Product,
       "Adasum": hvd.Adasum}
SPEC = tf.TensorSpec([4], tf.float32)


class ProbeStopError(Exception):
    """Raised by a stopping probe once it has recorded what it read: nothing of Horovod's runs
    after ``compress`` (its Adasum branch of ``grouped_allreduce`` fails to trace in TF 2.21)."""


class Probe(Compressor):
    def __init__(self, stop: bool = True):
        self.seen: list = []
        self.stop = stop

    @tf.autograph.experimental.do_not_convert   # as hvd_sparse's compressor
    def compress(self, tensor):
        optimizer = calling_keras_optimizer()
        self.seen.append((calling_allreduce_op(self), called_from_horovod_keras(),
                          None if optimizer is None else optimizer_momentum(optimizer)))
        if self.stop:
            raise ProbeStopError
        return tensor, None

    @tf.autograph.experimental.do_not_convert
    def decompress(self, tensor, ctx):
        return tensor


def check(case: str, compression: Probe, expected: list) -> None:
    assert compression.seen == expected, f"{case}: read {compression.seen}, expected {expected}"
    print(f"CHECKED tf/{case} rank={hvd.rank()}", flush=True)


def traced_allreduce(compression, op) -> None:
    tf.function(lambda x: hvd.allreduce(x, op=op, compression=compression)).get_concrete_function(SPEC)


def traced_grouped(compression, op) -> None:
    tf.function(lambda x: hvd.grouped_allreduce([x, 2 * x], op=op, compression=compression)
                ).get_concrete_function(SPEC)


def traced_tape(compression, op) -> None:
    variables = [tf.Variable(tf.ones([4])), tf.Variable(tf.ones([2]))]

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(variables[0] * x) + tf.reduce_sum(variables[1] ** 2)
        return hvd.DistributedGradientTape(tape, compression=compression, op=op).gradient(loss, variables)

    step.get_concrete_function(SPEC)


def keras_fit(compression) -> None:
    import horovod.tensorflow.keras as hvd_keras

    model = tf.keras.Sequential([tf.keras.Input((4,)), tf.keras.layers.Dense(1)])
    model.compile(optimizer=hvd_keras.DistributedOptimizer(tf.keras.optimizers.SGD(0.1, momentum=0.5),
                                                           compression=compression), loss="mse")
    model.fit(np.ones((4, 4), np.float32), np.ones((4, 1), np.float32), batch_size=4, epochs=1, verbose=0)


def refused(case: str, run, op) -> None:
    name = {v: k for k, v in OPS.items()}[op]
    check_op_refused(f"tf/{case}", lambda: run(hs.TopK(0.5, prefix=f"refused.{case}"), op), name,
                     hvd.rank())


def main() -> None:
    hvd.init()
    for name, op in OPS.items():
        for kind, run in (("allreduce", traced_allreduce), ("grouped", traced_grouped),
                          ("tape", traced_tape)):
            compression = Probe()
            with contextlib.suppress(ProbeStopError):
                run(compression, op)
            check(f"probe/{kind}/{name}", compression, [(op, False, None)])
    compression = Probe(stop=False)
    hvd.allreduce(tf.ones([4]), op=hvd.Sum, compression=compression, name="probe.eager")
    check("probe/eager/Sum", compression, [(hvd.Sum, False, None)])
    compression = Probe(stop=False)
    keras_fit(compression)
    assert compression.seen and set(compression.seen) == {(hvd.Average, True, "SGD(momentum=0.5)")}, \
        compression.seen
    print(f"CHECKED tf/probe/keras rank={hvd.rank()}", flush=True)
    refused("refused/tape-adasum", traced_tape, hvd.Adasum)
    refused("refused/tape-sum", traced_tape, hvd.Sum)
    refused("refused/grouped-min", traced_grouped, hvd.Min)
    total = hvd.allreduce(tf.ones(1), op=hvd.Sum, name="test.final").numpy()[0]
    assert total == hvd.size()
    print(f"PASSED rank={hvd.rank()} size={hvd.size()}", flush=True)


if __name__ == "__main__":
    main()
