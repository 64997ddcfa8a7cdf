"""Worker: methods on the Adam path through stock horovod.tensorflow, checked on every rank and step
as workers/torch_adam.py checks them in PyTorch; then model.fit with the Keras optimizer, what the
TensorFlow face refuses, and the warnings.

Run by tests/multiproc/test_horovod_adam.py. Each configuration of ``CONFIGS`` trains a three-layer
MLP for ``STEPS`` steps with ``hvd_sparse.tensorflow.DistributedGradientTape`` inside
``tf.function`` and ``hvd_sparse.tensorflow.optimizers.AdamW`` linked through ``optimizer=``;
after every step, on every rank: the optimizer applied what the tape delivered as AdamW applies
its own update (variable -= lr * (wd * variable) then lr * delivered, Keras's order), every bucket
as adam_checks.py says, identical weights at the end (``CHECKED tf/<config>``). Then:

* ``fit``: ``model.fit`` through ``hvd_sparse.tensorflow.keras.DistributedOptimizer`` (Horovod's
  Keras optimizer, which rebuilds ours from its config) on the path: the compressor ran its
  dense steps and then sparse ones, identical weights, a loss that fell;
* ``refused``: a per-tensor method on the path (its dense steps would change a graph built per
  tensor) and Keras's own AdamW as ``optimizer=``, each with an error naming the fix;
* ``warning``: Keras's Adam under a compressor without ``optimizer=`` warns once (seen while Keras
  traces its train function).
"""

from __future__ import annotations

import warnings

import numpy as np
import tensorflow as tf
from adam_checks import by_tensor, check_adam_bucket
from checks import check_identical
from tf_common import LOSS, allgather_rows, hvd
from tf_common import make_model as _make_model

import hvd_sparse.tensorflow as hs
from hvd_sparse import ConfigurationError
from hvd_sparse.engine.planning import plan_buckets
from hvd_sparse.tensorflow import keras as hs_keras
from hvd_sparse.tensorflow.optimizers import AdamW

STEPS, DENSE, DENSITY, LR, DECAY = 7, 2, 0.1, 0.01, 0.01
SMALL = 30
CONFIGS = {
    "exdyna/model/union": ("ExDyna", {"threshold_scaling": "tracking", "dense_below": SMALL}, None),
    "deft/model/union": ("DEFT", {}, None),
    "lags/groups/gather": ("LAGS", {"merge_threshold": 500}, "topk"),
    "topk/model/union": ("TopK", {"scope": "model", "pattern": "union"}, "topk"),
    "micro/model/union": ("MiCRO", {}, None),
    "exdyna/model/shared-v": ("ExDyna", {"threshold_scaling": "tracking", "dense_below": SMALL,
                                         "second_moment_refresh": 2}, None),
}


def make_model() -> tf.keras.Model:
    return _make_model(hidden_layers=2)


def batches(steps: int = STEPS) -> list:
    rng = np.random.default_rng(1000 + hvd.rank())
    return [(tf.constant(rng.standard_normal((12, 16)).astype(np.float32)),
             tf.constant(rng.integers(0, 5, 12).astype(np.int32))) for _ in range(steps)]


def train_step(model, compressor, optimizer):
    variables = model.trainable_variables

    @tf.function
    def step(x, y):
        with tf.GradientTape(persistent=True) as tape:
            loss = LOSS(y, model(x, training=True))
        raw = tape.gradient(loss, variables)
        applied = hs.DistributedGradientTape(tape, compression=compressor).gradient(loss, variables)
        optimizer.apply_gradients(zip(applied, variables, strict=True))
        return raw, applied

    return step


def flat(tensors: list, members: list[int]) -> np.ndarray:
    return np.concatenate([tensors[i].numpy().reshape(-1) for i in members]).astype(np.float32)


def weights_of(model) -> np.ndarray:
    return np.concatenate([v.numpy().reshape(-1) for v in model.trainable_variables])


def run(label: str, method: str, options: dict, kind: str | None) -> None:
    model = make_model()
    optimizer = AdamW(learning_rate=LR, weight_decay=DECAY)
    compressor = getattr(hs, method)(DENSITY, prefix=f"hs.{label}", optimizer=optimizer, dense_steps=DENSE,
                                     **options)
    algorithm, rank = compressor.algorithm, hvd.rank()
    keys = [f"g{i}" for i in range(len(model.trainable_variables))]
    sizes = [int(np.prod(v.shape)) for v in model.trainable_variables]
    plan = [(bucket, [keys.index(m) for m in members])
            for bucket, members in plan_buckets(algorithm, keys, sizes)]
    step_fn = train_step(model, compressor, optimizer)
    for step, (x, y) in enumerate(batches()):
        old = by_tensor(compressor.state_dict()["buckets"])
        before = [v.numpy().copy() for v in model.trainable_variables]
        raw, applied = step_fn(x, y)
        for v, b, a in zip(model.trainable_variables, before, applied, strict=True):
            decayed = b - np.float32(LR * DECAY) * b   # Keras's decoupled decay, then the update
            np.testing.assert_allclose(v.numpy(), decayed - np.float32(LR) * a.numpy(), rtol=1e-6, atol=1e-7,
                                       err_msg=f"{label} step {step}: the delivered update was not applied")
        new = by_tensor(compressor.state_dict()["buckets"])
        for bucket, members in plan:
            check_adam_bucket(rank, step, algorithm, kind, flat(raw, members), flat(applied, members),
                              old.get(bucket), new[bucket], [sizes[i] for i in members], allgather_rows,
                              f"{label} step {step} bucket {bucket}")
    check_identical(allgather_rows(weights_of(model), f"test.{label}.weights"), f"{label} weights")
    print(f"CHECKED tf/{label} rank={rank} density={compressor.stats()['density_actual']:.4f}", flush=True)


def fit() -> None:
    model = make_model()
    rng = np.random.default_rng(2000 + hvd.rank())
    x, y = rng.standard_normal((96, 16)).astype(np.float32), rng.integers(0, 5, 96).astype(np.int32)
    optimizer = AdamW(learning_rate=LR, weight_decay=DECAY)
    compressor = hs.ExDyna(DENSITY, prefix="hs.fit", optimizer=optimizer, dense_steps=DENSE,
                           threshold_scaling="tracking")
    model.compile(loss=LOSS, optimizer=hs_keras.DistributedOptimizer(optimizer, compressor))
    history = model.fit(x, y, batch_size=12, epochs=2, verbose=0)   # make_model broadcast the weights
    stats = compressor.stats()
    assert stats["step"] == 16 and stats["density_actual"] < 0.5, stats            # sparse at the end
    assert 0 < stats["bytes_sent_total"] < stats["dense_bytes_total"], stats
    assert history.history["loss"][-1] < history.history["loss"][0], history.history
    check_identical(allgather_rows(weights_of(model), "test.fit.weights"), "fit weights")
    print(f"CHECKED fit rank={hvd.rank()} loss={history.history['loss'][-1]:.3f}", flush=True)


def refused() -> None:
    try:
        hs.TopK(DENSITY, prefix="hs.refused", optimizer=AdamW(LR))
    except ConfigurationError as error:
        assert "scope='model'" in str(error) and "Adam path" in str(error), error
    else:
        raise AssertionError("a per-tensor method on the Adam path was not refused")
    try:
        hs.ExDyna(DENSITY, optimizer=tf.keras.optimizers.AdamW(LR))
    except ConfigurationError as error:
        assert "hvd_sparse.tensorflow.optimizers.AdamW" in str(error), error
    else:
        raise AssertionError("Keras's AdamW was accepted as optimizer=")
    print(f"CHECKED refused rank={hvd.rank()}", flush=True)


def warning() -> None:
    model = make_model()
    x = np.random.default_rng(hvd.rank()).standard_normal((24, 16)).astype(np.float32)
    y = np.zeros(24, dtype=np.int32)
    compressor = hs.TopK(DENSITY, prefix="hs.warn")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.compile(loss=LOSS, optimizer=hvd.DistributedOptimizer(tf.keras.optimizers.Adam(LR),
                                                                      compression=compressor))
        model.fit(x, y, batch_size=12, epochs=1, verbose=0)
    about = [w for w in caught if "without the Adam path" in str(w.message)]
    assert len(about) == 1, [str(w.message) for w in caught]
    print(f"CHECKED warning rank={hvd.rank()}", flush=True)


def main() -> None:
    hvd.init()
    for label, (method, options, kind) in CONFIGS.items():
        run(label, method, options, kind)
    fit()
    refused()
    warning()
    print(f"PASSED rank={hvd.rank()} size={hvd.size()}", flush=True)


if __name__ == "__main__":
    main()
