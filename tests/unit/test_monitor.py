"""Statistics over ranks, the logger and the Keras callback, without Horovod (fake compressors
stand in for the faces; the faces' one-collective ``average_stats`` runs in the multi-process
tests)."""

from __future__ import annotations

import json
import sys
import types
import warnings

import numpy as np
import pytest

from hvd_sparse import ConfigurationError
from hvd_sparse.algorithms import RandomK, Threshold
from hvd_sparse.backends import get_backend
from hvd_sparse.comm.local import LocalGroup
from hvd_sparse.engine import Engine
from hvd_sparse.monitor import StatsLogger, average_rows, mean_over_ranks, stat_vector


class FakeCompression:
    """What StatsLogger needs from a face; ``average_stats`` counts the collectives it stands for."""

    framework = "torch"

    def __init__(self, rank, rows):
        self.rank, self.rows, self.collectives, self.epochs = rank, rows, 0, []

    def stats(self):
        return self.rows[self.rank]

    def average_stats(self, keys):
        self.collectives += 1
        return average_rows(self.rows, keys)

    def set_epoch(self, epoch):
        self.epochs.append(epoch)


def local_rows(size=3):
    engines = [Engine(Threshold(0.05, scope="tensor"), get_backend("numpy"), r, size) for r in range(size)]
    rng = np.random.default_rng(0)
    LocalGroup(size).run([e.step("w", [rng.standard_normal(400).astype(np.float32) * (r + 1)])
                          for r, e in enumerate(engines)])
    return [e.stats() for e in engines]


def test_stat_vector_picks_numbers_and_names_the_choices():
    rows = local_rows()
    assert stat_vector(rows[0], ["density_actual", "threshold"]) == [
        rows[0]["density_actual"], rows[0]["threshold"]]
    with pytest.raises(ConfigurationError, match=r"'nope' is not a number.*'buildup'"):
        stat_vector(rows[0], ["nope"])


def test_average_rows_is_the_mean_over_ranks():
    rows = local_rows()
    mean = average_rows(rows, ["selected", "bytes_sent", "residual_norm"])
    for key in mean:
        assert mean[key] == pytest.approx(np.mean([row[key] for row in rows]))
    assert mean_over_ranks(["a", "b"], [6.0, 3.0], 3) == {"a": 2.0, "b": 1.0}
    selected = [row["selected"] for row in rows]
    assert len(set(selected)) > 1  # the ranks differ, so the mean is not any one rank's value


def test_logger_every_n_steps_one_collective_each_rank_zero_writes(tmp_path):
    rows = local_rows(2)
    lines = []
    ranks = [FakeCompression(r, rows) for r in range(2)]
    loggers = [StatsLogger(c, every=3, keys=["density_actual", "buildup"],
                           jsonl=tmp_path / f"r{c.rank}.jsonl", printer=lines.append) for c in ranks]
    for step in range(7):
        for logger in loggers:
            logger(step)
    assert [c.collectives for c in ranks] == [3, 3]            # steps 0, 3, 6, on every rank
    assert not (tmp_path / "r1.jsonl").exists()                # only rank 0 writes
    records = [json.loads(line) for line in (tmp_path / "r0.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 3, 6]
    assert records[0]["buildup"] == pytest.approx(np.mean([row["buildup"] for row in rows]))
    assert len(lines) == 3 and lines[0].startswith("hvd_sparse step 0: density_actual=")


def test_logger_without_averaging_issues_no_collective():
    rows = local_rows(2)
    compression = FakeCompression(0, rows)
    out = StatsLogger(compression, every=1, keys=["selected"], stdout=False, average=False)(0)
    assert compression.collectives == 0 and out == {"selected": float(rows[0]["selected"])}
    with pytest.raises(ConfigurationError, match="every must be a positive integer"):
        StatsLogger(compression, every=0)


def test_logger_writes_torch_tensorboard_when_installed(monkeypatch, tmp_path):
    written = []

    class SummaryWriter:
        def __init__(self, logdir):
            written.append(("open", logdir))

        def add_scalar(self, tag, value, step):
            written.append((tag, value, step))

        def flush(self):
            pass

        def close(self):
            written.append(("close",))

    fake = types.ModuleType("torch.utils.tensorboard")
    fake.SummaryWriter = SummaryWriter
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", fake)
    logger = StatsLogger(FakeCompression(0, local_rows(2)), every=1, keys=["buildup"],
                         tensorboard=tmp_path, stdout=False)
    logger(5)
    logger.close()
    assert written[0] == ("open", str(tmp_path))
    assert written[1][0] == "hvd_sparse/buildup" and written[1][2] == 5 and written[-1] == ("close",)


def test_logger_writes_real_torch_tensorboard_events(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    rows = local_rows(2)
    logger = StatsLogger(FakeCompression(0, rows), every=2, keys=["buildup"], tensorboard=tmp_path,
                         stdout=False)
    for step in range(5):
        logger(step)
    logger.close()
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    scalars = events.Scalars("hvd_sparse/buildup")
    assert [s.step for s in scalars] == [0, 2, 4]
    assert scalars[0].value == pytest.approx(np.mean([row["buildup"] for row in rows]), rel=1e-6)


def test_logger_without_tensorboard_warns_once_and_keeps_logging(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails
    logger = StatsLogger(FakeCompression(0, local_rows(2)), every=1, keys=["buildup"],
                         tensorboard=tmp_path, jsonl=tmp_path / "s.jsonl", stdout=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(3):
            logger(step)
    assert sum("TensorBoard is not available" in str(w.message) for w in caught) == 1
    assert len((tmp_path / "s.jsonl").read_text().splitlines()) == 3


def test_logger_writes_tf_summary_scalars(tmp_path):
    pytest.importorskip("tensorflow")
    from tensorflow.python.summary.summary_iterator import summary_iterator

    rows = local_rows(2)
    compression = FakeCompression(0, rows)
    compression.framework = "tensorflow"
    logger = StatsLogger(compression, every=1, keys=["buildup", "selected"], tensorboard=tmp_path,
                         stdout=False)
    logger(0)
    logger(1)
    logger.close()
    (events,) = tmp_path.glob("events.out.tfevents.*")
    written = [(e.step, v.tag, float(np.frombuffer(v.tensor.tensor_content, np.float32)[0]),
                v.metadata.plugin_data.plugin_name)
               for e in summary_iterator(str(events)) for v in e.summary.value]
    mean_selected = np.mean([row["selected"] for row in rows])
    assert (1, "hvd_sparse/selected", pytest.approx(mean_selected), "scalars") in written
    assert len(written) == 4


def test_keras_callback_sets_epochs_and_logs_every_n_batches(tmp_path):
    pytest.importorskip("tensorflow")
    from hvd_sparse.tensorflow import CompressionCallback

    compression = FakeCompression(0, local_rows(2))
    callback = CompressionCallback(compression, every=2, keys=["buildup"], jsonl=tmp_path / "k.jsonl",
                                   stdout=False)
    for epoch in range(2):
        callback.on_epoch_begin(epoch)
        for batch in range(3):
            callback.on_train_batch_end(batch)
    callback.on_train_end()
    assert compression.epochs == [0, 1]
    steps = [json.loads(line)["step"] for line in (tmp_path / "k.jsonl").read_text().splitlines()]
    assert steps == [2, 4, 6] and compression.collectives == 3


def test_set_epoch_reaches_only_methods_with_a_schedule():
    from hvd_sparse.algorithms import DGC

    dgc = DGC(0.001, warmup_epochs=2)
    dgc.set_epoch(1)
    assert dgc.current_density == pytest.approx(0.001 ** (2 / 3))
    assert not hasattr(RandomK(0.1), "set_epoch")
