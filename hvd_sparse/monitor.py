"""Watching a sparsifier during training: statistics averaged over ranks, printed and written.

``compression.stats()`` describes the last step on *this* rank. To see the job as a whole, each
face offers ``compression.average_stats(keys)``: one named allreduce of the chosen statistics,
issued only when asked and by every rank (a collective that some ranks skip would hang the
others), returning the mean over ranks on every rank.

``StatsLogger`` does that every N steps and, on rank 0, prints a line, appends a JSON object to
a file and writes TensorBoard scalars: through ``torch.utils.tensorboard`` for PyTorch when
TensorBoard is installed, through ``tf.summary`` for TensorFlow (which writes event files
without the tensorboard package). Call it on every rank after every optimizer step:

    logger = StatsLogger(compression, every=50, jsonl="sparsity.jsonl", tensorboard="runs/x")
    for step, batch in enumerate(loader):
        ...
        optimizer.step()
        logger(step)

Keras users get the same through ``hvd_sparse.tensorflow.CompressionCallback``.

This module imports no framework; TensorBoard writers are opened lazily.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from .errors import ConfigurationError

DEFAULT_KEYS = ("density_target", "density_actual", "buildup", "bytes_sent", "bytes_received",
                "select_seconds", "residual_norm")


def stat_vector(stats: dict, keys: Sequence[str]) -> list[float]:
    """The chosen scalar statistics as floats, in ``keys`` order (what one collective carries).
    A statistic this method does not report (e.g. ``threshold`` for top-k) raises, naming those
    it does."""
    values = []
    for key in keys:
        value = stats.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            scalars = sorted(k for k, v in stats.items() if isinstance(v, (int, float))
                             and not isinstance(v, bool))
            raise ConfigurationError(
                f"statistic {key!r} is not a number this compressor reports; choose among {scalars}")
        values.append(float(value))
    return values


def mean_over_ranks(keys: Sequence[str], summed: Iterable[float], size: int) -> dict[str, float]:
    """The per-rank mean of each statistic from their sum over ``size`` ranks."""
    return {key: float(total) / size for key, total in zip(keys, summed, strict=True)}


def average_rows(rows: Sequence[dict], keys: Sequence[str]) -> dict[str, float]:
    """The mean over ranks of the chosen statistics, from every rank's ``stats()`` (the same
    result ``average_stats`` computes with one collective; for simulations and tests)."""
    if not rows:
        raise ConfigurationError("average_rows needs at least one rank's statistics")
    summed = [sum(column) for column in zip(*(stat_vector(row, keys) for row in rows), strict=True)]
    return mean_over_ranks(keys, summed, len(rows))


class StatsLogger:
    """Every ``every`` steps: average the chosen statistics over ranks (one collective, issued by
    every rank) and, on rank 0, print them, append them to a JSON-lines file and write them as
    TensorBoard scalars.

    Args:
        compression: an hvd_sparse compressor of either face (anything with ``stats()``,
            ``average_stats(keys)``, ``rank`` and ``framework``).
        every: log on steps that are multiples of ``every`` (step 0 included).
        keys: statistics to log (docs/usage.md#statistics).
        jsonl: path of a JSON-lines file (one object per logged step), or None.
        tensorboard: a log directory for TensorBoard scalars (tag ``hvd_sparse/<key>``), or None.
            Skipped with one warning when TensorBoard is not installed.
        stdout: print one line per logged step.
        average: average over ranks (one collective); False logs rank 0's own statistics and
            issues no collective.
    """

    def __init__(self, compression: Any, every: int = 100, keys: Sequence[str] = DEFAULT_KEYS, *,
                 jsonl: str | os.PathLike | None = None, tensorboard: str | os.PathLike | None = None,
                 stdout: bool = True, average: bool = True, printer: Callable[[str], None] = print):
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ConfigurationError(f"every must be a positive integer (steps), got {every!r}")
        self.compression = compression
        self.every = every
        self.keys = tuple(keys)
        self.jsonl = jsonl
        self.tensorboard = tensorboard
        self.stdout = stdout
        self.average = average
        self.printer = printer
        self._writer: Any = None
        self._writer_failed = False
        self._count = 0

    def __call__(self, step: int | None = None) -> dict[str, float] | None:
        """Log if ``step`` (default: the number of calls so far) is due; returns what was logged
        (on every rank when averaging), else None."""
        if step is None:
            step = self._count
        self._count += 1
        if step % self.every:
            return None
        return self.log(step)

    def log(self, step: int) -> dict[str, float]:
        """Log now, whatever the step (every rank must call it when averaging)."""
        if self.average:
            values = self.compression.average_stats(self.keys)
        else:
            values = dict(zip(self.keys, stat_vector(self.compression.stats(), self.keys), strict=True))
        if self.compression.rank == 0:
            self._write(step, values)
        return values

    def close(self) -> None:
        """Close the TensorBoard writer, if any."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def _write(self, step: int, values: dict[str, float]) -> None:
        if self.stdout:
            shown = " ".join(f"{key}={_short(value)}" for key, value in values.items())
            self.printer(f"hvd_sparse step {step}: {shown}")
        if self.jsonl is not None:
            with open(self.jsonl, "a", encoding="utf-8") as out:
                out.write(json.dumps({"step": step, **values}) + "\n")
        if self.tensorboard is not None and not self._writer_failed:
            if self._writer is None:
                self._writer = open_tensorboard(str(self.tensorboard), self.compression.framework)
                self._writer_failed = self._writer is None
            if self._writer is not None:
                for key, value in values.items():
                    self._writer.scalar(f"hvd_sparse/{key}", value, step)
                self._writer.flush()


def _short(value: float) -> str:
    if value == int(value) and abs(value) < 1e15:
        return str(int(value))
    return f"{value:.4g}" if math.isfinite(value) else str(value)


class _TorchBoard:
    def __init__(self, logdir: str):
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(logdir)

    def scalar(self, tag: str, value: float, step: int) -> None:
        self._writer.add_scalar(tag, value, step)

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class _TFBoard:
    """Scalars through ``tf.summary.write`` with the scalar plugin's metadata: what
    ``tf.summary.scalar`` writes, without needing the tensorboard package in the training job."""

    def __init__(self, logdir: str):
        import tensorflow as tf
        from tensorflow.core.framework import summary_pb2

        self._tf = tf
        self._writer = tf.summary.create_file_writer(logdir)
        self._metadata = summary_pb2.SummaryMetadata(
            plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name="scalars"))

    def scalar(self, tag: str, value: float, step: int) -> None:
        with self._writer.as_default():
            self._tf.summary.write(tag, self._tf.constant(value, self._tf.float32), step=step,
                                   metadata=self._metadata)

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


def open_tensorboard(logdir: str, framework: str) -> Any:
    """A TensorBoard scalar writer for ``framework`` ("torch", "ddp" or "tensorflow"), or None
    with a warning when the framework's TensorBoard support is not installed."""
    try:
        return _TorchBoard(logdir) if framework in ("torch", "ddp") else _TFBoard(logdir)
    except ImportError as missing:
        warnings.warn(f"hvd_sparse: TensorBoard is not available ({missing}); statistics go to "
                      "stdout and the JSON-lines file only (pip install tensorboard)", stacklevel=3)
        return None
