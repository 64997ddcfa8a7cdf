"""Adam and AdamW for the Adam path (docs/methods.md#adam-and-adamw), under Keras's names and arguments.

    import hvd_sparse.tensorflow as hs
    from hvd_sparse.tensorflow.optimizers import AdamW
    opt = AdamW(learning_rate=1e-3, weight_decay=0.01)
    compression = hs.ExDyna(density=0.01, optimizer=opt)
    model.compile(loss=..., optimizer=hs_keras.DistributedOptimizer(opt, compression))   # or a tape loop

With ``optimizer=`` the compressor computes Adam itself (``hvd_sparse.algorithms.AdamPath``): what
Horovod hands the optimizer is Adam's update m_hat / (sqrt(v_hat) + eps) averaged over ranks, not a
gradient. These classes apply it as AdamW applies its own, ``variable -= learning_rate * update``
(the decoupled weight decay is Keras's own, applied before), wherever the linked compressor delivers
it: in a job of more than one rank, for dense gradients. Elsewhere -- one rank, where Horovod never
runs the compressor, and ``tf.IndexedSlices`` gradients, which Horovod gathers without compressing
-- they are Keras's Adam/AdamW. The Keras ``epsilon`` is the path's eps, added to the
bias-corrected root as PyTorch adds it (Keras adds it before the correction).

Horovod's Keras ``DistributedOptimizer`` rebuilds the optimizer from ``get_config()``: the link
travels there as a token of this process's registry. Keras 2 (tf-keras, ``TF_USE_LEGACY_KERAS=1``)
only, as everything Horovod 0.28.1 does with Keras (docs/architecture.md#keras).
"""

from __future__ import annotations

import itertools
from typing import Any

import tensorflow as tf

from ..algorithms.corrections import AdamPath
from ..errors import ConfigurationError
from .keras import require_legacy_keras

require_legacy_keras()

CONFIG_KEY = "hvd_sparse_link"
_LINKS: dict[str, AdamLink] = {}
_TOKENS = itertools.count()


class AdamLink:
    """Between a compressor on the Adam path and the Keras optimizer applying its updates:
    ``active`` once the compressor built its exchange into a graph (Horovod traces it), and
    ``world`` the compressor's (rank, size) source, so that a job of one rank, where Horovod's
    ``tf.cond`` skips the exchange, applies gradients as Keras's Adam does."""

    def __init__(self, path: AdamPath, world: Any):
        self.path = path
        self.world = world
        self.active = False

    def applies(self) -> bool:
        """Whether the gradients arriving now are the path's updates."""
        if not self.active:
            return False
        _, size = self.world()
        return size > 1


class _AppliesUpdates:
    """The Adam path's update step, before Keras's."""

    def __init__(self, *args: Any, hvd_sparse_link: str | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._hvd_sparse_link = hvd_sparse_link

    def get_config(self) -> dict:
        """Keras's, with the link's token (Horovod rebuilds the optimizer from it)."""
        config = super().get_config()  # type: ignore[misc]  # Keras's: this class mixes into one
        if self._hvd_sparse_link is not None:
            config[CONFIG_KEY] = self._hvd_sparse_link
        return config

    def update_step(self, gradient: Any, variable: Any) -> Any:
        """``variable -= lr * update`` where the linked compressor delivered an update, else Keras's."""
        link = _LINKS.get(self._hvd_sparse_link) if self._hvd_sparse_link is not None else None
        if link is None or isinstance(gradient, tf.IndexedSlices) or not link.applies():
            return super().update_step(gradient, variable)  # type: ignore[misc]  # Keras's
        lr = tf.cast(self.learning_rate, variable.dtype)  # type: ignore[attr-defined]  # Keras's
        return variable.assign_sub(tf.cast(gradient, variable.dtype) * lr)


class Adam(_AppliesUpdates, tf.keras.optimizers.Adam):
    """Keras's Adam (the same arguments) that applies the Adam path's updates: link it with
    ``optimizer=`` of an hvd_sparse compressor."""


class AdamW(_AppliesUpdates, tf.keras.optimizers.AdamW):
    """Keras's AdamW (the same arguments) that applies the Adam path's updates: link it with
    ``optimizer=`` of an hvd_sparse compressor."""


def adam_path_of(optimizer: Any) -> AdamPath | None:
    """The ``AdamPath`` of a Keras optimizer given as ``optimizer=``: one of this module's
    classes; None for one the path does not concern (SGD, RMSprop, ...). Raises
    ``ConfigurationError`` naming what to use for Keras's own Adam-style optimizers."""
    if optimizer is None:
        return None
    with tf.init_scope():
        config = optimizer.get_config() if hasattr(optimizer, "get_config") else None
    if config is None:
        raise ConfigurationError(
            f"optimizer= takes the Keras optimizer the compressor serves, got {optimizer!r}")
    name = type(optimizer).__name__
    if not isinstance(optimizer, _AppliesUpdates):
        if "beta_1" in config:
            target = "AdamW" if "AdamW" in name else "Adam"
            raise ConfigurationError(
                f"optimizer={name}(...) cannot apply the Adam path's updates (Keras's {name} would "
                f"normalise the already normalised update again): build it as "
                f"hvd_sparse.tensorflow.optimizers.{target}(...) with the same arguments")
        return None
    if config.get("amsgrad"):
        raise ConfigurationError(
            f"{name}(amsgrad=True) cannot run the Adam path, which freezes the second moment after its "
            "dense steps: use amsgrad=False")
    return AdamPath(float(config["beta_1"]), float(config["beta_2"]), float(config["epsilon"]))


def link(optimizer: Any, path: AdamPath, world: Any) -> AdamLink:
    """Link ``optimizer`` (one of this module's) to a new ``AdamLink``; ``world()`` gives the
    compressor's (rank, size)."""
    shared = AdamLink(path, world)
    token = f"{next(_TOKENS)}"
    _LINKS[token] = shared
    optimizer._hvd_sparse_link = token
    return shared


def is_stock_adam(optimizer: Any) -> bool:
    """An Adam-style Keras optimizer that steps without the Adam path (read eagerly, also while a
    graph is traced)."""
    try:
        with tf.init_scope():
            config = optimizer.get_config()
    except Exception:   # not a Keras optimizer this check understands
        return False
    if "beta_1" not in config:
        return False
    return not (isinstance(optimizer, _AppliesUpdates) and optimizer._hvd_sparse_link in _LINKS)
