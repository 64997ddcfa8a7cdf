"""Worker: stock horovod.tensorflow with MiCRO/ExDyna (whole-model scope, one Horovod group),
checked every step like workers/torch_exdyna.py. Configurations: ExDyna exact and neighbour
rebalancers through ``hs.DistributedGradientTape`` in ``tf.function``, ExDyna with the tracking
threshold in eager mode, MiCRO through the Keras optimizer (``train_on_batch``), and the error a
whole-model method raises when Horovod does not group the gradients."""

from __future__ import annotations

import os
import sys

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf
from checks import check_exclusive_step, check_identical
from tf_common import LOSS, allgather_rows, make_model
from tf_common import batches as _batches

import hvd_sparse.tensorflow as hs
from hvd_sparse.tensorflow import keras as hs_keras

STEPS = int(sys.argv[1]) if len(sys.argv) > 1 else 20
DENSITY = 0.05


def batches():
    return _batches(STEPS, rank_scaled=True)


def check(label, step, compressor, old, raw, applied, exact=True):
    stats = compressor.stats()
    flat = np.concatenate([g.reshape(-1) for g in raw])
    acc = (flat + (old["model"]["residual"] if "model" in old else 0)).astype(np.float32)
    accs = allgather_rows(acc, f"test.{label}.acc.{step}")
    views = allgather_rows(np.array([*stats["own_partition"], stats["threshold"]]), f"test.{label}.v.{step}")
    residual = compressor.state_dict()["buckets"]["model"]["residual"]
    applied = np.concatenate([g.reshape(-1) for g in applied])
    if exact:
        check_exclusive_step(hvd.rank(), accs, views, applied, residual, step, f"{label} step {step}")
    if stats.get("partition") is not None:
        table = np.array(stats["partition"], dtype=np.int64)
        check_identical(allgather_rows(table, f"test.{label}.t.{step}"), f"{label} tables")
        assert sum(stats["counts"]) == stats["union"]
    return stats["rebalance_moves"]


def finish(label, model, moves):
    weights = np.concatenate([v.numpy().reshape(-1) for v in model.trainable_variables])
    check_identical(allgather_rows(weights, f"test.{label}.weights"), f"{label} weights")
    moved = int(allgather_rows(np.array([moves]), f"test.{label}.moves").sum())
    print(f"CHECKED {label} rank={hvd.rank()} steps={STEPS} moves={moved}", flush=True)
    return moved


def run_tape(options: dict, graph: bool) -> None:
    label = f"tf/tape-{'function' if graph else 'eager'}/{'-'.join(f'{v}' for v in options.values())}"
    model = make_model()
    variables = model.trainable_variables
    optimizer = tf.keras.optimizers.SGD(0.1)
    compressor = hs.ExDyna(DENSITY, prefix=f"hs.{label}", **options)

    def train_step(x, y):
        with tf.GradientTape(persistent=True) as tape:
            loss = LOSS(y, model(x, training=True))
        raw = tape.gradient(loss, variables)
        applied = hs.DistributedGradientTape(tape, compression=compressor).gradient(loss, variables)
        optimizer.apply_gradients(zip(applied, variables, strict=True))
        return raw, applied

    step_fn = tf.function(train_step) if graph else train_step
    moves = 0
    for step, (x, y) in enumerate(batches()):
        old = compressor.state_dict()["buckets"]
        raw, applied = step_fn(tf.constant(x), tf.constant(y))
        moves += check(label, step, compressor, old, [g.numpy() for g in raw], [g.numpy() for g in applied])
    # Under MPI the neighbour exchange goes over mpi4py (MPI_THREAD_MULTIPLE, ranks mapped); under
    # Gloo over a Horovod alltoall. Decided at the first exchange.
    if options.get("rebalance") == "neighbour":
        assert compressor._comm._mpi_decided and (compressor._comm._mpi is not None) == hvd.mpi_enabled()
    assert finish(label, model, moves) > 0, f"{label}: no boundary ever moved"


def run_keras() -> None:
    label = "tf/keras/micro"
    model = make_model()
    compressor = hs.MiCRO(DENSITY, prefix=f"hs.{label}")
    optimizer = hs_keras.DistributedOptimizer(tf.keras.optimizers.SGD(1.0), compressor)
    model.compile(loss=LOSS, optimizer=optimizer)
    for step, (x, y) in enumerate(batches()):
        old = compressor.state_dict()["buckets"]
        before = [v.numpy() for v in model.trainable_variables]
        model.train_on_batch(x, y)
        applied = [b - v.numpy() for b, v in zip(before, model.trainable_variables, strict=True)]
        # Keras computes its own gradient inside train_on_batch; the applied update must still be
        # non-zero exactly on a union that every rank agrees on.
        union = np.flatnonzero(np.concatenate([a.reshape(-1) for a in applied]))
        summary = np.array([union.size, int(np.sum(union * 7919) % 2**31)], dtype=np.int64)
        check_identical(allgather_rows(summary, f"test.{label}.u.{step}"), f"{label} union")
        stats = compressor.stats()
        assert stats["union"] == sum(stats["counts"]) and union.size <= stats["union"], stats
        del old
    finish(label, model, 0)


def run_ungrouped_is_refused() -> None:
    model = make_model()
    compressor = hs.ExDyna(DENSITY, prefix="hs.ungrouped")

    @tf.function
    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = LOSS(y, model(x, training=True))
        tape = hvd.DistributedGradientTape(tape, compression=compressor)
        return tape.gradient(loss, model.trainable_variables)

    x, y = next(batches())
    try:
        train_step(tf.constant(x), tf.constant(y))
    except Exception as error:  # TF re-raises trace-time errors as its own types
        assert "num_groups=1" in str(error), error
        print(f"CHECKED tf/ungrouped-refused rank={hvd.rank()}", flush=True)
        return
    raise AssertionError("a whole-model method without grouping was not refused")


def main() -> None:
    hvd.init()
    run_tape({"rebalance": "exact"}, graph=True)
    run_tape({"rebalance": "neighbour"}, graph=True)
    run_tape({"threshold_scaling": "tracking"}, graph=False)
    run_keras()
    run_ungrouped_is_refused()
    print(f"PASSED rank={hvd.rank()} size={hvd.size()}", flush=True)


if __name__ == "__main__":
    main()
