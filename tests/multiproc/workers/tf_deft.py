"""Worker: stock horovod.tensorflow with hvd_sparse DEFT, checked every step.

Configurations: Horovod's own ``hvd.DistributedGradientTape(..., num_groups=1)`` inside
``tf.function`` (paper mode); ``hvd_sparse.tensorflow.DistributedGradientTape`` in eager mode
(agreed_k, heap packing); the tape in ``tf.function`` at a high density, where bins run empty and
ranks send their fallback index; the Keras ``DistributedOptimizer`` with ``train_on_batch``
(tf-keras). In each, the whole-model step runs in one blocking ``tf.py_function`` per step, with
the master's broadcasts inside it. After every step each rank checks the applied gradient, its
residual and the statistics: against an independent re-derivation of the step from every rank's
accumulated vector for the tapes, from the ranks' residuals for Keras (whose gradient is computed
inside ``train_on_batch``). Finally, a tape left ungrouped must be refused at trace time with the
fix named. Any failure raises, so the job exits non-zero.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf
from checks import check_identical
from deft_checks import check_deft_step, check_deft_step_from_residuals
from tf_common import LOSS, allgather_rows, make_model
from tf_common import batches as _batches

import hvd_sparse.tensorflow as hs
from hvd_sparse.tensorflow import keras as hs_keras

STEPS = int(sys.argv[1]) if len(sys.argv) > 1 else 20


def batches():
    return _batches(STEPS)


def flat(tensors) -> np.ndarray:
    return np.concatenate([np.asarray(t).reshape(-1) for t in tensors])


def finish(label, model, compressor, extra=""):
    stats = compressor.stats()
    assert stats["step"] == STEPS and len(stats["counts"]) == hvd.size(), stats
    weights = flat([v.numpy() for v in model.trainable_variables])
    check_identical(allgather_rows(weights, f"test.{label}.weights"), f"{label} weights")
    print(f"CHECKED {label} rank={hvd.rank()} steps={STEPS} density={stats['density_actual']:.4f} "
          f"imbalance={stats['imbalance']:.3f}{extra}", flush=True)


def run_tape(name: str, density: float, agreed_k: bool, packing: str, graph: bool, stock: bool) -> None:
    label = f"tf/tape-{'function' if graph else 'eager'}/{name}"
    model = make_model()
    variables = model.trainable_variables
    sizes = [int(np.prod(v.shape)) for v in variables]
    optimizer = tf.keras.optimizers.SGD(0.1)
    compressor = hs.DEFT(density, agreed_k=agreed_k, packing=packing, prefix=f"hs.{label}")

    def train_step(x, y):
        with tf.GradientTape(persistent=True) as tape:
            loss = LOSS(y, model(x, training=True))
        raw = tape.gradient(loss, variables)
        if stock:   # Horovod's own tape, every gradient in one group
            tape = hvd.DistributedGradientTape(tape, compression=compressor, num_groups=1)
        else:
            tape = hs.DistributedGradientTape(tape, compression=compressor)
        applied = tape.gradient(loss, variables)
        optimizer.apply_gradients(zip(applied, variables, strict=True))
        return raw, applied

    step_fn = tf.function(train_step) if graph else train_step
    fallbacks = 0
    for step, (x, y) in enumerate(batches()):
        old = compressor.state_dict()["buckets"]
        raw, applied = step_fn(tf.constant(x), tf.constant(y))
        acc = flat([g.numpy() for g in raw]) + (old["model"]["residual"] if "model" in old else 0)
        accs = allgather_rows(acc.astype(np.float32), f"test.{label}.{step}")
        fallbacks += check_deft_step(hvd.rank(), accs, flat([g.numpy() for g in applied]),
                                     compressor.state_dict()["buckets"]["model"]["residual"], sizes,
                                     density, step, agreed_k, compressor.stats(), f"{label} step {step}")
    finish(label, model, compressor, f" fallbacks={fallbacks}")


def run_keras() -> None:
    label = "tf/keras/paper"
    model = make_model()
    compressor = hs.DEFT(0.05, prefix=f"hs.{label}")
    learning_rate = 1.0
    optimizer = hs_keras.DistributedOptimizer(tf.keras.optimizers.SGD(learning_rate), compressor)
    model.compile(loss=LOSS, optimizer=optimizer)
    for step, (x, y) in enumerate(batches()):
        old = compressor.state_dict()["buckets"]
        with tf.GradientTape() as tape:
            loss = LOSS(y, model(x, training=True))
        raw = flat([g.numpy() for g in tape.gradient(loss, model.trainable_variables)])
        before = [v.numpy() for v in model.trainable_variables]
        model.train_on_batch(x, y)
        applied = flat([(b - v.numpy()) / learning_rate
                        for b, v in zip(before, model.trainable_variables, strict=True)])
        acc = raw + (old["model"]["residual"] if "model" in old else 0)
        accs = allgather_rows(acc.astype(np.float32), f"test.{label}.acc.{step}")
        residuals = allgather_rows(compressor.state_dict()["buckets"]["model"]["residual"],
                                   f"test.{label}.res.{step}")
        check_deft_step_from_residuals(hvd.rank(), accs, applied, residuals, compressor.stats(),
                                       f"{label} step {step}")
    finish(label, model, compressor)


def refuse_ungrouped_tape() -> None:
    """Without num_groups=1 Horovod reduces each gradient on its own: DEFT cannot see the model."""
    model = make_model()
    compressor = hs.DEFT(0.05, prefix="hs.refused")

    @tf.function
    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = LOSS(y, model(x, training=True))
        return hvd.DistributedGradientTape(tape, compression=compressor).gradient(
            loss, model.trainable_variables)

    x, y = next(batches())
    try:
        train_step(tf.constant(x), tf.constant(y))
    except Exception as error:  # inside tf.function autograph re-raises it as a StagingError
        assert "ConfigurationError" in f"{type(error).__name__}: {error}", error
        assert "num_groups=1" in str(error), error
        print(f"REFUSED tf/ungrouped-tape rank={hvd.rank()}", flush=True)
    else:
        raise AssertionError("an ungrouped tape was accepted")


def main() -> None:
    hvd.init()
    run_tape("paper", 0.05, agreed_k=False, packing="linear", graph=True, stock=True)
    run_tape("agreed-heap", 0.05, agreed_k=True, packing="heap", graph=False, stock=False)
    run_tape("dense-fallback", 1.0, agreed_k=False, packing="linear", graph=True, stock=False)
    run_keras()
    refuse_ungrouped_tape()
    print(f"PASSED rank={hvd.rank()} size={hvd.size()}", flush=True)


if __name__ == "__main__":
    main()
