"""A Keras callback that drives a compressor's epoch schedule and logs its statistics.

    compression = hs.DGC(0.001, warmup_epochs=4)
    model.compile(optimizer=hs.keras.DistributedOptimizer(opt, compression), loss=...)
    model.fit(x, y, epochs=10,
              callbacks=[hs.CompressionCallback(compression, every=50, jsonl="sparsity.jsonl")])

Every rank runs ``model.fit`` and so every rank runs this callback: ``set_epoch`` at the start of
each epoch (DGC's warm-up; other methods ignore it) and, every ``every`` batches, the statistics
averaged over ranks with one collective (see ``hvd_sparse.monitor.StatsLogger``), printed and
written by rank 0 (JSON lines; TensorBoard scalars through ``tf.summary`` with ``tensorboard=``).
Needs Keras 2 (tf-keras), like Horovod's Keras support.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from ..monitor import DEFAULT_KEYS, StatsLogger


class CompressionCallback(tf.keras.callbacks.Callback):
    """``set_epoch`` on every epoch, and statistics every ``every`` batches (None: never).

    Args:
        compression: the hvd_sparse TensorFlow compressor given to the optimizer.
        every: log every this many training batches (counted over the whole fit), or None.
        keys, jsonl, tensorboard, stdout, average: as ``hvd_sparse.monitor.StatsLogger``.
    """

    def __init__(self, compression: Any, every: int | None = 100, keys: Sequence[str] = DEFAULT_KEYS, *,
                 jsonl: str | os.PathLike | None = None, tensorboard: str | os.PathLike | None = None,
                 stdout: bool = True, average: bool = True):
        super().__init__()
        self.compression = compression
        self.logger = None if every is None else StatsLogger(
            compression, every, keys, jsonl=jsonl, tensorboard=tensorboard, stdout=stdout,
            average=average)
        self.batches = 0

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        """Tell the compressor the epoch (``set_epoch``)."""
        self.compression.set_epoch(epoch)

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        """Count the batch; log every ``every`` batches."""
        self.batches += 1
        if self.logger is not None:
            self.logger(self.batches)  # logged after batches every, 2*every, ...

    def on_train_end(self, logs: dict | None = None) -> None:
        """Close the logger."""
        if self.logger is not None:
            self.logger.close()
