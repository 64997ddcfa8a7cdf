"""Keras support, and the guard that keeps it from failing silently.

TF 2.21's default ``tf.keras`` is Keras 3. Horovod 0.28.1 predates it: its Keras
``DistributedOptimizer`` then runs ``model.fit`` without error but never synchronizes the
weights (docs/architecture.md#keras). The supported way is tf-keras with ``TF_USE_LEGACY_KERAS=1`` set before
TensorFlow is imported; everything here refuses Keras 3 with an error that says so.
"""

from __future__ import annotations

import os
from typing import Any

from ..errors import ConfigurationError
from .grouping import with_model_grouping

LEGACY_KERAS_HINT = (
    "TensorFlow's tf.keras is Keras 3 here, and Horovod 0.28.1's Keras DistributedOptimizer does "
    "not synchronize weights under Keras 3 (it trains each rank separately, without an error). "
    "Install tf-keras (pip install tf-keras==<your TF version> --no-deps) and set "
    "TF_USE_LEGACY_KERAS=1 in the environment before TensorFlow is imported.")


def keras_is_legacy() -> bool:
    """True when ``tf.keras`` is Keras 2 (tf-keras), which Horovod 0.28.1 supports."""
    import tensorflow as tf

    if getattr(tf.keras, "__name__", "").startswith("tf_keras"):
        return True  # TF >= 2.16 with TF_USE_LEGACY_KERAS=1
    import keras

    return int(keras.__version__.split(".")[0]) < 3  # TF <= 2.15 ships Keras 2 as tf.keras


def require_legacy_keras() -> None:
    """Raise a ``ConfigurationError`` naming the fix unless ``tf.keras`` is Keras 2."""
    if not keras_is_legacy():
        raise ConfigurationError(LEGACY_KERAS_HINT + f" (TF_USE_LEGACY_KERAS="
                                 f"{os.environ.get('TF_USE_LEGACY_KERAS', '<unset>')})")


def refuse_keras3_under_horovod_keras() -> None:
    """Raise if the caller is Horovod's Keras optimizer running on Keras 3 (checked at trace time)."""
    from .horovod_internals import called_from_horovod_keras

    if called_from_horovod_keras():
        require_legacy_keras()


def optimizer_momentum(optimizer: Any) -> str | None:
    """How a Keras optimizer applies momentum of its own, or None: ``momentum`` > 0 (SGD,
    RMSprop) or ``beta_1`` > 0 (Adam and its kin: beta_1's moving average of the gradient is a
    momentum too), read from its configuration (eagerly, also while a graph is traced). None too
    where the configuration cannot be read."""
    import tensorflow as tf

    try:
        with tf.init_scope():
            config = optimizer.get_config()
        for key in ("momentum", "beta_1"):
            value = config.get(key)
            if value is not None and not isinstance(value, bool) and float(value) > 0:
                return f"{type(optimizer).__name__}({key}={float(value):g})"
    except Exception:   # a configuration this check does not understand: no warning
        return None
    return None


def DistributedOptimizer(optimizer: Any, compression: Any, **kwargs: Any) -> Any:
    """``horovod.tensorflow.keras.DistributedOptimizer`` with an hvd_sparse compressor.

    Refuses Keras 3 (see module docstring) and puts every gradient in one group (``groups=1``;
    whole-model methods need it) unless the caller chose a grouping. Warns once when the
    compressor's momentum correction is on and ``optimizer`` has momentum of its own, and once
    when ``optimizer`` is an Adam that steps without the Adam path (docs/methods.md#adam-and-adamw).
    """
    require_legacy_keras()
    note = getattr(compression, "_note_optimizer", None)
    if note is not None:
        note(optimizer)
    import horovod.tensorflow.keras as hvd_keras

    return hvd_keras.DistributedOptimizer(optimizer, compression=compression,
                                          **with_model_grouping(compression, kwargs))
