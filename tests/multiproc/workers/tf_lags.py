"""Worker: stock horovod.tensorflow with hvd_sparse LAGS, checked every step.

Configurations (tape in ``tf.function`` unless "eager"):
* "merged": merge_threshold=100, three groups of two tensors through
  ``hvd_sparse.tensorflow.DistributedGradientTape`` (num_groups=1): one phased graph per group.
* "one-group": every tensor in one group, stock tape with num_groups=1: one blocking py_function.
* "per-tensor" (function and eager): merge_threshold=0 with the stock tape and no grouping.
* "adaptive": adaptive=True cannot measure anything in TensorFlow: it must warn and stay uniform.
And a stock tape without num_groups under merged groups must be refused with the fix named.

After every step, every rank allgathers every rank's accumulated vector per group and checks the
applied gradient, its new residual and error feedback against an independent reference; at the
end, that all ranks hold identical weights.
"""

from __future__ import annotations

import os
import sys
import warnings

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf
from checks import check_identical, check_topk_step
from tf_common import LOSS, allgather_rows
from tf_common import batches as _batches
from tf_common import make_model as _make_model

import hvd_sparse.tensorflow as hs
from hvd_sparse import ConfigurationError
from hvd_sparse.engine.planning import plan_buckets

STEPS = int(sys.argv[1]) if len(sys.argv) > 1 else 20
DENSITY = 0.05


def batches():
    return _batches(STEPS)


def make_model():
    # Variables 384, 24 | 576, 24 | 120, 5: with merge_threshold=100, three groups of two.
    return _make_model(hidden_layers=2)


def run(label: str, tape_kind: str, graph: bool = True, **options) -> None:
    label = f"tf/{'function' if graph else 'eager'}/{label}"
    model = make_model()
    variables = model.trainable_variables
    optimizer = tf.keras.optimizers.SGD(0.1)
    compressor = hs.LAGS(DENSITY, prefix=f"hs.{label}", **options)
    keys = [f"g{i}" for i in range(len(variables))]
    if compressor.algorithm.scope == "tensor":
        plan = [(key, [key]) for key in keys]   # the TF face's per-tensor buckets
    else:
        plan = plan_buckets(compressor.algorithm, keys, [int(np.prod(v.shape)) for v in variables])
    position = {key: i for i, key in enumerate(keys)}

    def distributed(tape):
        if tape_kind == "hvd_sparse":
            return hs.DistributedGradientTape(tape, compression=compressor)
        if tape_kind == "grouped":
            return hvd.DistributedGradientTape(tape, compression=compressor, num_groups=1)
        return hvd.DistributedGradientTape(tape, compression=compressor)

    def train_step(x, y):
        with tf.GradientTape(persistent=True) as tape:
            loss = LOSS(y, model(x, training=True))
        raw = tape.gradient(loss, variables)
        applied = distributed(tape).gradient(loss, variables)
        optimizer.apply_gradients(zip(applied, variables, strict=True))
        return raw, applied

    step_fn = tf.function(train_step) if graph else train_step
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step, (x, y) in enumerate(batches()):
            old = compressor.state_dict()["buckets"]
            raw, applied = step_fn(tf.constant(x), tf.constant(y))
            raw, applied = [g.numpy() for g in raw], [g.numpy() for g in applied]
            new = compressor.state_dict()["buckets"]
            for group, members in plan:
                flat_raw = np.concatenate([raw[position[k]].reshape(-1) for k in members])
                acc = flat_raw + (old[group]["residual"] if group in old else 0)
                accs = allgather_rows(acc.astype(np.float32), f"test.{label}.{group}.{step}")
                flat_applied = np.concatenate([applied[position[k]].reshape(-1) for k in members])
                check_topk_step(hvd.rank(), accs, flat_applied, new[group]["residual"], DENSITY, "gather",
                                f"{label} step {step} {group}")
    untimed = [w for w in caught if "only the PyTorch face" in str(w.message)]
    stats = compressor.stats()
    assert stats["step"] == STEPS and stats["buckets"] == len(plan), stats
    assert set(stats["group_densities"]) == {g for g, _ in plan}, stats
    assert set(stats["group_densities"].values()) == {DENSITY}, stats
    if compressor.algorithm.adaptive:
        assert stats["adaptive_state"] == "uniform" and len(untimed) == 1, (stats, caught)
    else:
        assert stats["adaptive_state"] == "off" and not untimed, stats
    weights = np.concatenate([v.numpy().reshape(-1) for v in variables])
    check_identical(allgather_rows(weights, f"test.{label}.weights"), f"{label} weights")
    print(f"CHECKED {label} rank={hvd.rank()} steps={STEPS} groups={len(plan)} "
          f"density={stats['density_actual']:.4f}", flush=True)


def refuses_ungrouped_merged_groups() -> None:
    model = make_model()
    compressor = hs.LAGS(DENSITY, merge_threshold=100, prefix="hs.refused")

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = LOSS(y, model(x, training=True))
        return hvd.DistributedGradientTape(tape, compression=compressor).gradient(
            loss, model.trainable_variables)

    x, y = next(batches())
    try:
        step(tf.constant(x), tf.constant(y))
    except Exception as error:  # inside tf.function, TensorFlow re-raises it as a StagingError
        assert ConfigurationError.__name__ in str(error) and "num_groups=1" in str(error), error
    else:
        raise AssertionError("merged LAGS groups under an ungrouped tape were not refused")


def main() -> None:
    hvd.init()
    run("merged", "hvd_sparse", merge_threshold=100)
    run("one-group", "grouped", merge_threshold=10**6)
    run("per-tensor", "stock", merge_threshold=0)
    run("per-tensor", "stock", graph=False, merge_threshold=0)
    run("adaptive", "hvd_sparse", merge_threshold=100, adaptive=True, profile_steps=3)
    refuses_ungrouped_merged_groups()
    print(f"PASSED rank={hvd.rank()} size={hvd.size()}", flush=True)


if __name__ == "__main__":
    main()
