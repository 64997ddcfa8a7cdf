"""Worker: ranks that disagree and a raised non-finite step through stock
horovod.tensorflow.DistributedGradientTape inside tf.function (2 ranks).

Run by tests/multiproc/test_horovod_robustness.py. Prints ``CHECKED mismatch/<case> rank=<r>``
when every rank raised an error naming the difference, ``CHECKED nonfinite/<case> rank=<r>``
when every rank raised at the poisoned step, trained on and ended with identical weights, and
``PASSED rank=<r> size=<N>`` at the end.
"""

from __future__ import annotations

import warnings

import numpy as np
import tensorflow as tf
from checks import outcome
from tf_common import hvd, make_model, tape_step

import hvd_sparse.tensorflow as hs

warnings.simplefilter("ignore")


def train(model, compression, steps: int, nan_at: int | None = None) -> int:
    """``steps`` steps; returns how many raised (a NaN input on rank 1 at step ``nan_at``)."""
    optimizer = tf.keras.optimizers.SGD(0.05)

    step_fn = tape_step(model, optimizer, compression)

    rng = np.random.default_rng(7 + hvd.rank())
    raised = 0
    for step in range(steps):
        x = rng.standard_normal((12, 16)).astype(np.float32)
        if step == nan_at and hvd.rank() == 1:
            x[0, 0] = np.nan
        try:
            step_fn(x, rng.integers(0, 5, 12).astype(np.int32))
        except tf.errors.OpError as error:
            assert "applied nowhere" in str(error), error
            raised += 1
    return raised


def unbroadcast_model(hidden_layers: int) -> tf.keras.Model:
    """tf_common.make_model without its broadcast, which would hang on models that differ."""
    tf.random.set_seed(0)
    layers = [tf.keras.layers.Dense(24, activation="tanh", input_shape=(16,))]
    layers += [tf.keras.layers.Dense(24, activation="tanh") for _ in range(hidden_layers - 1)]
    return tf.keras.Sequential([*layers, tf.keras.layers.Dense(5)])


def mismatch(rank: int) -> None:
    odd = rank == 1
    cases = [
        ("density", lambda: hs.ExDyna(0.02 if odd else 0.01, prefix="mm.d"), 1,
         "density=0.01 on rank 0, 0.02 on rank 1"),
        ("method", lambda: hs.TopK(0.1, prefix="mm.m") if odd else hs.ExDyna(0.1, prefix="mm.m"), 1,
         "rank 0 runs 'exdyna', ranks [1] run 'topk'"),
        ("density-tensor", lambda: hs.TopK(0.2 if odd else 0.1, prefix="mm.t"), 1,
         "density=0.1 on rank 0, 0.2 on rank 1"),
        ("extra-layer-ExDyna", lambda: hs.ExDyna(0.1, prefix="mm.x"), 2 if odd else 1,
         "rank 0 has 4 tensors, rank 1 6"),
    ]
    for label, make, layers, expected in cases:
        print(f"CASE mismatch/{label} rank={rank}", flush=True)
        def body(make=make, layers=layers):
            return train(unbroadcast_model(layers), make(), 2)

        results = outcome(hvd, f"mm.{label}", body)
        for r, (kind, detail) in enumerate(results):
            assert kind != "ok" and expected in detail, f"{label}: rank {r}: {kind}: {detail[-2000:]}"
        print(f"CHECKED mismatch/{label} rank={rank}", flush=True)


def nonfinite(rank: int) -> None:
    for label, make in (("exdyna", hs.ExDyna), ("topk-tensor", hs.TopK)):
        model = make_model()
        compression = make(0.1, nonfinite="raise", prefix=f"nf.{label}")
        raised = train(model, compression, 6, nan_at=2)
        assert raised == 1, f"{label}: raised {raised} times"
        assert len(compression.state_dict()["buckets"]) == 1, label   # TopK: its steps packed
        weights = np.concatenate([v.numpy().ravel() for v in model.trainable_variables])
        everyone = hvd.allgather_object((weights.tobytes(), compression.stats()["step"]), name=f"nf.{label}")
        assert all(e == everyone[0] for e in everyone), f"{label}: ranks differ after the raised step"
        assert everyone[0][1] == 5, everyone[0][1]
        print(f"CHECKED nonfinite/{label} rank={rank}", flush=True)


def main() -> None:
    hvd.init()
    rank = hvd.rank()
    nonfinite(rank)
    mismatch(rank)
    hvd.allreduce(tf.ones(1), name="final")
    print(f"PASSED rank={rank} size={hvd.size()}", flush=True)


if __name__ == "__main__":
    main()
