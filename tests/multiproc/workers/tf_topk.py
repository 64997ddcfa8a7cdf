"""Worker: stock horovod.tensorflow with hvd_sparse TopK, checked every step.

Configurations: ``hvd.DistributedGradientTape`` inside ``tf.function`` (scope x pattern), the tape
in eager mode, and the Keras ``hvd.DistributedOptimizer`` with ``train_on_batch`` (tf-keras).
After every step it allgathers every rank's accumulated vector and checks the applied gradient,
the new residual and error feedback against an independent reference; at the end, that all
ranks hold identical weights. Any failure raises, so the job exits non-zero.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf
from checks import by_tensor, check_identical, check_topk_step
from tf_common import LOSS, allgather_rows, make_model
from tf_common import batches as _batches

import hvd_sparse.tensorflow as hs
from hvd_sparse.tensorflow import keras as hs_keras

STEPS = int(sys.argv[1]) if len(sys.argv) > 1 else 20
DENSITY = 0.05


def batches():
    return _batches(STEPS)


def check_buckets(label, step, scope, old, new, raw, applied, exact=True):
    keys = ["model"] if scope == "model" else [f"g{i}" for i in range(len(raw))]
    groups = [list(range(len(raw)))] if scope == "model" else [[i] for i in range(len(raw))]
    for key, members in zip(keys, groups, strict=True):
        flat_raw = np.concatenate([raw[i].reshape(-1) for i in members])
        acc = flat_raw + (old[key]["residual"] if key in old else 0)
        accs = allgather_rows(acc.astype(np.float32), f"test.{label}.{key}.{step}")
        flat_applied = np.concatenate([applied[i].reshape(-1) for i in members])
        check_topk_step(hvd.rank(), accs, flat_applied, new[key]["residual"], DENSITY,
                        label.split("/")[-1], f"{label} step {step} bucket {key}", exact)


def finish(label, model, compressor):
    stats = compressor.stats()
    assert stats["step"] == STEPS and 0 < stats["density_actual"] <= 1, stats
    weights = np.concatenate([v.numpy().reshape(-1) for v in model.trainable_variables])
    check_identical(allgather_rows(weights, f"test.{label}.weights"), f"{label} weights")
    print(f"CHECKED {label} rank={hvd.rank()} steps={STEPS} density={stats['density_actual']:.4f}",
          flush=True)


def run_tape(scope: str, pattern: str, graph: bool, stock: bool = False) -> None:
    """``stock``: Horovod's own tape with its default grouping (each gradient in its own
    ``tf.cond``, so a per-tensor step builds its phases alone); else hvd_sparse's tape (one
    group: every gradient's phase p in one py_function)."""
    label = f"tf/{'stock-' if stock else ''}tape-{'function' if graph else 'eager'}/{scope}/{pattern}"
    make_tape = hvd.DistributedGradientTape if stock else hs.DistributedGradientTape
    model = make_model()
    variables = model.trainable_variables
    optimizer = tf.keras.optimizers.SGD(0.1)
    compressor = hs.TopK(DENSITY, scope=scope, pattern=pattern, prefix=f"hs.{label}")

    def train_step(x, y):
        with tf.GradientTape(persistent=True) as tape:
            loss = LOSS(y, model(x, training=True))
        raw = tape.gradient(loss, variables)
        applied = make_tape(tape, compression=compressor).gradient(loss, variables)
        optimizer.apply_gradients(zip(applied, variables, strict=True))
        return raw, applied

    step_fn = tf.function(train_step) if graph else train_step
    for step, (x, y) in enumerate(batches()):
        old = by_tensor(compressor.state_dict()["buckets"])
        raw, applied = step_fn(tf.constant(x), tf.constant(y))
        check_buckets(label, step, scope, old, by_tensor(compressor.state_dict()["buckets"]),
                      [g.numpy() for g in raw], [g.numpy() for g in applied])
    finish(label, model, compressor)


def run_keras(scope: str, pattern: str) -> None:
    label = f"tf/keras/{scope}/{pattern}"
    model = make_model()
    compressor = hs.TopK(DENSITY, scope=scope, pattern=pattern, prefix=f"hs.{label}")
    learning_rate = 1.0
    optimizer = hs_keras.DistributedOptimizer(tf.keras.optimizers.SGD(learning_rate), compressor)
    model.compile(loss=LOSS, optimizer=optimizer)
    for step, (x, y) in enumerate(batches()):
        old = by_tensor(compressor.state_dict()["buckets"])
        with tf.GradientTape() as tape:
            loss = LOSS(y, model(x, training=True))
        raw = [g.numpy() for g in tape.gradient(loss, model.trainable_variables)]
        before = [v.numpy() for v in model.trainable_variables]
        model.train_on_batch(x, y)
        applied = [(b - v.numpy()) / learning_rate
                   for b, v in zip(before, model.trainable_variables, strict=True)]
        check_buckets(label, step, scope, old, by_tensor(compressor.state_dict()["buckets"]), raw, applied,
                      exact=False)
    finish(label, model, compressor)


def main() -> None:
    hvd.init()
    for scope, pattern in [("tensor", "gather"), ("tensor", "union"), ("model", "gather"),
                           ("model", "union")]:
        run_tape(scope, pattern, graph=True)
    run_tape("tensor", "gather", graph=True, stock=True)
    run_tape("tensor", "gather", graph=False)
    run_keras("tensor", "gather")
    run_keras("model", "union")
    print(f"PASSED rank={hvd.rank()} size={hvd.size()}", flush=True)


if __name__ == "__main__":
    main()
