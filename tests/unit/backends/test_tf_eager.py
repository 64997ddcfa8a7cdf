"""The eager TensorFlow helper: cached constants are the values asked for, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

from hvd_sparse.backends.tf_eager import constant  # noqa: E402


def test_constants_are_made_once_per_value_and_dtype():
    assert constant([1, 2, 3], tf.int64) is constant((1, 2, 3), tf.int64)
    assert constant(0.5, tf.float64) is constant(0.5, tf.float64)
    assert constant(1, tf.float64) is not constant(1, tf.int64)
    assert constant(1, tf.float64).dtype == tf.float64 and constant(1, tf.int64).dtype == tf.int64
    negative, positive = constant(-0.0, tf.float64), constant(0.0, tf.float64)
    assert negative is not positive and np.signbit(negative.numpy()) and not np.signbit(positive.numpy())
    assert constant((), tf.float64).shape == (0,) and constant(0.1, tf.float32).shape == ()
    assert constant(0.1, tf.float32).numpy() == np.float32(0.1)
    assert constant([0.1, 0.2], tf.float64).numpy().tolist() == [0.1, 0.2]


def test_inside_a_graph_a_graph_constant_is_made_and_not_kept():
    @tf.function
    def scaled(x):
        return x * constant(3.0, tf.float32)

    assert scaled(tf.constant(2.0)).numpy() == 6.0
    assert constant(3.0, tf.float32).numpy() == 3.0   # an eager tensor, not the graph's
