"""What the TensorFlow workers share: the loss, the small model, per-rank batches, allgather."""

from __future__ import annotations

import os

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

LOSS = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def tape_step(model, optimizer, compression):
    """A tf.function training step through hvd_sparse's DistributedGradientTape."""
    import hvd_sparse.tensorflow as hs

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = LOSS(y, model(x, training=True))
        tape = hs.DistributedGradientTape(tape, compression=compression)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        return loss

    return step


def allgather_rows(vector: np.ndarray, name: str) -> np.ndarray:
    """(N, ...) every rank's copy of ``vector``, by rank."""
    return hvd.allgather(tf.constant(np.ascontiguousarray(vector))[None], name=name).numpy()


def make_model(hidden_layers: int = 1) -> tf.keras.Model:
    """16 -> 24 (tanh) x hidden_layers -> 5, identical on every rank."""
    tf.random.set_seed(0)
    layers = [tf.keras.layers.Dense(24, activation="tanh", input_shape=(16,))]
    layers += [tf.keras.layers.Dense(24, activation="tanh") for _ in range(hidden_layers - 1)]
    model = tf.keras.Sequential([*layers, tf.keras.layers.Dense(5)])
    hvd.broadcast_variables(model.variables, root_rank=0)
    return model


def batches(steps: int, rank_scaled: bool = False):
    """Each rank its own batches (inputs scaled by rank + 1 to unbalance the ranks' loads)."""
    rng = np.random.default_rng(1000 + hvd.rank())
    for _ in range(steps):
        x = rng.standard_normal((12, 16)).astype(np.float32)
        if rank_scaled:
            x *= 1 + hvd.rank()
        yield x, rng.integers(0, 5, 12).astype(np.int32)


