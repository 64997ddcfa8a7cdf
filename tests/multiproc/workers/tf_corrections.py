"""Worker: every method with the corrections (momentum, nesterov, dense_steps, warmup_steps,
dense_below) through stock horovod.tensorflow, checked on every rank and every step; then what
the TensorFlow face refuses, a checkpoint resume with momentum, nonfinite="raise" with momentum,
and the warning about a second momentum in a Keras optimizer.

Run by tests/multiproc/test_horovod_corrections.py. Each configuration of ``CONFIGS`` trains a
three-layer MLP for ``STEPS`` steps with ``hvd_sparse.tensorflow.DistributedGradientTape`` inside
``tf.function`` and, after every step, checks every bucket on every rank as the PyTorch worker does
(correction_checks.py), then identical weights (``CHECKED tf/<config> rank=<r>``). The TensorFlow
face runs a whole-model scope -- the model and its ``dense_below`` bucket -- in one py_function
with eager collectives, merged LAGS groups as phased graphs (or in one py_function where
``dense_steps`` changes their collectives), per-tensor scopes as phased graphs, where
``dense_steps`` is refused (``REFUSED tf/dense-steps-per-tensor``). Then:

* ``resume/exdyna``: a run checkpointed after 4 of 8 steps and resumed by a new model, step
  function and compressor applies bit for bit the same gradients;
* ``nonfinite/exdyna``: ``nonfinite="raise"`` with a NaN in the last bias (the ``dense_below``
  bucket, which runs after the model's) on rank 1: every rank raises, the model bucket takes its
  finished step back, both buckets' step counters are as before, and their residuals and
  velocities hold all they accumulated, unmasked (``check_raised``); training goes on to
  identical weights;
* ``warning``: Horovod's Keras optimizer with momentum under a compressor with momentum warns
  once (seen while Keras traces its train function), as does
  ``hvd_sparse.tensorflow.keras.DistributedOptimizer`` with Adam; an optimizer without momentum
  does not.
"""

from __future__ import annotations

import math
import pickle
import sys
import warnings

import numpy as np
import tensorflow as tf
from checks import by_tensor, check_identical
from correction_checks import check_corrected_bucket, check_raised, target_density
from tf_common import LOSS, allgather_rows, hvd
from tf_common import make_model as _make_model

import hvd_sparse.tensorflow as hs
from hvd_sparse import ConfigurationError
from hvd_sparse.engine.planning import plan_buckets
from hvd_sparse.tensorflow import keras as hs_keras

STEPS = 8
DENSITY = 0.1
SMALL = 30   # dense_below: the biases (24, 24 and 5 entries) are averaged densely

# label -> (method, options, selection re-derived as in torch_corrections.py)
CONFIGS = {
    "exdyna/model/union": ("ExDyna", {"momentum": 0.9, "nesterov": True, "dense_steps": 2,
                                      "warmup_steps": 3}, None),
    "topk/model/union": ("TopK", {"scope": "model", "pattern": "union", "momentum": 0.9, "dense_steps": 2,
                                  "dense_below": SMALL}, "topk"),
    "deft/model/union": ("DEFT", {"momentum": 0.9, "dense_steps": 1, "dense_below": SMALL}, None),
    "lags/groups/gather": ("LAGS", {"merge_threshold": 500, "momentum": 0.9, "nesterov": True,
                                    "warmup_steps": 3, "dense_below": SMALL}, "topk"),
    "lags/groups/dense-steps": ("LAGS", {"merge_threshold": 500, "momentum": 0.9, "dense_steps": 2}, "topk"),
    "topk/tensor/gather": ("TopK", {"momentum": 0.9, "warmup_steps": 3, "dense_below": SMALL}, "topk"),
    "randomk/model/shared": ("RandomK", {"scope": "model", "shared_seed": True, "seed": 2, "momentum": 0.9,
                                         "warmup_steps": 3, "dense_below": SMALL}, "shared"),
    "threshold/tensor/union": ("Threshold", {"scope": "tensor", "pattern": "union", "momentum": 0.9,
                                             "nesterov": True, "warmup_steps": 3}, "threshold"),
    "gaussiank/tensor/gather": ("GaussianK", {"momentum": 0.9, "dense_below": SMALL}, None),
    "dgc/tensor/gather": ("DGC", {"nesterov": True, "warmup_steps": 3}, None),
    "micro/model/union": ("MiCRO", {"momentum": 0.9, "dense_steps": 1, "warmup_steps": 2}, None),
}
NAN_STEP = {"topk/tensor/gather": 5}   # rank 1's input is NaN there (nonfinite="skip")


def make_model() -> tf.keras.Model:
    """16 -> 24 -> 24 -> 5 (tanh): variables of 384, 24, 576, 24, 120 and 5 entries."""
    return _make_model(hidden_layers=2)


def batches(steps: int = STEPS, nan_step: int | None = None) -> list:
    rng = np.random.default_rng(1000 + hvd.rank())
    out = []
    for step in range(steps):
        x = rng.standard_normal((12, 16)).astype(np.float32)
        if step == nan_step and hvd.rank() == 1:
            x[0, 0] = np.nan
        out.append((tf.constant(x), tf.constant(rng.integers(0, 5, 12).astype(np.int32))))
    return out


def train_step(model, compressor, poisoned=None, keep=None):
    """A tf.function step returning (raw gradients, applied gradients); ``poisoned``: a variable
    whose gradient gets ``poison`` added (NaN to poison it, else 0); ``keep``: variables the raw
    gradients are written to before the compressor runs (readable after a step that raised: an
    outside tape would differ in the last bits)."""
    variables = model.trainable_variables
    optimizer = tf.keras.optimizers.SGD(0.1)

    @tf.function
    def step(x, y, poison):
        with tf.GradientTape(persistent=True) as tape:
            loss = LOSS(y, model(x, training=True))
            if poisoned is not None:
                loss = loss + poison * tf.reduce_sum(poisoned)
        raw = tape.gradient(loss, variables)
        for kept, g in zip(keep or [], raw, strict=False):
            kept.assign(g)   # before the step's py_function, in program order
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
    compressor = getattr(hs, method)(DENSITY, prefix=f"hs.{label}", **options)
    algorithm, rank = compressor.algorithm, hvd.rank()
    corrections = algorithm.corrections
    keys = [f"g{i}" for i in range(len(model.trainable_variables))]
    sizes = [int(np.prod(v.shape)) for v in model.trainable_variables]
    plan = [(bucket, [keys.index(m) for m in members])
            for bucket, members in plan_buckets(algorithm, keys, sizes)]
    step_fn = train_step(model, compressor)
    for step, (x, y) in enumerate(batches(nan_step=NAN_STEP.get(label))):
        old = by_tensor(compressor.state_dict()["buckets"])
        raw, applied = step_fn(x, y, tf.constant(0.0))
        new = by_tensor(compressor.state_dict()["buckets"])
        assert sorted(new) == sorted(b for b, _ in plan), (label, sorted(new), plan)
        density = target_density(DENSITY, corrections.dense_steps, corrections.warmup_steps, step)
        reported = compressor.stats()["density_target"]
        assert math.isclose(reported, density, rel_tol=1e-12), (label, step, reported, density)
        for bucket, members in plan:
            where = f"{label} step {step} bucket {bucket}"
            if not check_corrected_bucket(rank, step, algorithm, kind, flat(raw, members),
                                          flat(applied, members), old.get(bucket), new[bucket],
                                          [sizes[i] for i in members], allgather_rows, where):
                print(f"SKIPPED {label} step {step} rank={rank}", flush=True)
    stats = compressor.stats()
    assert stats["step"] == STEPS, (label, stats["step"])
    check_identical(allgather_rows(weights_of(model), f"test.{label}.weights"), f"{label} weights")
    print(f"CHECKED tf/{label} rank={rank} density={stats['density_actual']:.4f} buckets={len(plan)}",
          flush=True)


def refuse_dense_steps_per_tensor() -> None:
    """Per-tensor graphs fix their collectives when built: dense_steps is refused at trace time,
    on every rank, naming the fix."""
    model = make_model()
    step_fn = train_step(model, hs.TopK(DENSITY, momentum=0.9, dense_steps=2, prefix="hs.refused"))
    x, y = batches(1)[0]
    try:
        step_fn(x, y, tf.constant(0.0))
    except Exception as raised:   # AutoGraph may wrap it (StagingError): search the chain
        chain = [raised]
        while chain[-1].__cause__ or chain[-1].__context__:
            chain.append(chain[-1].__cause__ or chain[-1].__context__)
        assert any(isinstance(e, ConfigurationError) for e in chain), chain
        assert "dense_steps changes the collectives" in str(raised) and "scope='model'" in str(raised), raised
        print(f"REFUSED tf/dense-steps-per-tensor rank={hvd.rank()}", flush=True)
        return
    raise AssertionError("dense_steps with per-tensor graphs was not refused")


def resume() -> None:
    """ExDyna with momentum, a warm-up and a dense_below bucket (two buckets in one
    py_function): 8 steps in one go, checkpointed after 4; a new model, step function and
    compressor resumed from the checkpoint apply the same gradients, bit for bit."""
    options = {"momentum": 0.9, "nesterov": True, "warmup_steps": 6, "dense_below": SMALL}
    data, first = batches(), STEPS // 2
    model = make_model()
    compressor = hs.ExDyna(DENSITY, prefix="hs.resume.a", **options)
    step_fn = train_step(model, compressor)
    for x, y in data[:first]:
        step_fn(x, y, tf.constant(0.0))
    saved = pickle.dumps((compressor.state_dict(), model.get_weights()))
    straight = [flat(step_fn(x, y, tf.constant(0.0))[1], range(6)) for x, y in data[first:]]
    end = by_tensor(compressor.state_dict()["buckets"])

    model = make_model()
    state, weights = pickle.loads(saved)
    model.set_weights(weights)
    compressor = hs.ExDyna(DENSITY, prefix="hs.resume.b", **options)
    compressor.load_state_dict(state)
    step_fn = train_step(model, compressor)
    resumed = [flat(step_fn(x, y, tf.constant(0.0))[1], range(6)) for x, y in data[first:]]
    for step, (a, b) in enumerate(zip(straight, resumed, strict=True)):
        np.testing.assert_array_equal(b, a, err_msg=f"resume: step {first + step} differs")
    again = by_tensor(compressor.state_dict()["buckets"])
    assert sorted(again) == sorted(end) == ["dense_below", "model"], sorted(again)
    for key, bucket in end.items():
        assert again[key]["step"] == bucket["step"] == STEPS, key
        for field in ("residual", "momentum"):
            np.testing.assert_array_equal(again[key][field], bucket[field], err_msg=f"resume: {key} {field}")
    check_identical(allgather_rows(weights_of(model), "test.resume.weights"), "resume")
    print(f"CHECKED resume/exdyna rank={hvd.rank()}", flush=True)


def nonfinite_raise() -> None:
    model = make_model()
    options = {"momentum": 0.9, "dense_below": SMALL}
    compressor = hs.ExDyna(DENSITY, nonfinite="raise", prefix="hs.nf", **options)
    corrections = compressor.algorithm.corrections
    keep = [tf.Variable(tf.zeros_like(v), trainable=False) for v in model.trainable_variables]
    step_fn = train_step(model, compressor, poisoned=model.trainable_variables[-1], keep=keep)
    keys = [f"g{i}" for i in range(6)]
    sizes = [int(np.prod(v.shape)) for v in model.trainable_variables]
    plan = [(bucket, [keys.index(m) for m in members])
            for bucket, members in plan_buckets(compressor.algorithm, keys, sizes)]
    assert [b for b, _ in plan] == ["model", "dense_below"], plan   # the poisoned bucket runs last
    raised = 0
    for step, (x, y) in enumerate(batches(6)):
        poison = tf.constant(np.nan if step == 2 and hvd.rank() == 1 else 0.0)
        before = by_tensor(compressor.state_dict()["buckets"])
        try:
            step_fn(x, y, poison)
        except tf.errors.OpError as error:
            assert "applied nowhere" in str(error), error
            raised += 1
            raws = {bucket: flat(keep, members) for bucket, members in plan}
            check_raised(before, by_tensor(compressor.state_dict()["buckets"]), raws, corrections.momentum,
                         corrections.nesterov, f"nonfinite/exdyna step {step}")
    assert raised == 1, raised
    assert compressor.stats()["step"] == 5, compressor.stats()["step"]
    check_identical(allgather_rows(weights_of(model), "test.nf.weights"), "nonfinite")
    print(f"CHECKED nonfinite/exdyna rank={hvd.rank()}", flush=True)


def momentum_warnings() -> None:
    def fit(optimizer_for, options, wrapper):
        model = make_model()
        compressor = hs.TopK(DENSITY, prefix=f"hs.warn.{len(seen)}", **options)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            optimizer = wrapper(optimizer_for(), compressor)
            model.compile(loss=LOSS, optimizer=optimizer)
            x, y = batches(1)[0]
            model.fit(np.repeat(x.numpy(), 2, axis=0), np.repeat(y.numpy(), 2, axis=0), batch_size=12,
                      epochs=1, verbose=0)
        seen.append([str(w.message) for w in caught if "momentum twice" in str(w.message)
                     and issubclass(w.category, RuntimeWarning)])

    seen: list = []
    stock = lambda opt, c: hvd.DistributedOptimizer(opt, compression=c)   # noqa: E731
    fit(lambda: tf.keras.optimizers.SGD(0.05, momentum=0.9), {"momentum": 0.9}, stock)
    fit(lambda: tf.keras.optimizers.Adam(0.01), {"momentum": 0.9}, hs_keras.DistributedOptimizer)
    fit(lambda: tf.keras.optimizers.SGD(0.05), {"momentum": 0.9}, stock)
    fit(lambda: tf.keras.optimizers.SGD(0.05, momentum=0.9), {}, stock)
    assert [len(s) for s in seen] == [1, 1, 0, 0], seen
    assert "SGD(momentum=0.9)" in seen[0][0] and "Adam(beta_1=0.9)" in seen[1][0], seen
    print(f"CHECKED warning rank={hvd.rank()}", flush=True)


def main() -> None:
    """``argv[1]`` (optional): a comma-separated list of parts ("configs", "refused", "resume",
    "nonfinite", "warning"); all of them by default."""
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    parts = sys.argv[1].split(",") if len(sys.argv) > 1 else ["configs", "refused", "resume", "nonfinite",
                                                             "warning"]
    if "configs" in parts:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="hvd_sparse: non-finite gradient")
            for label, (method, options, kind) in CONFIGS.items():
                run(label, method, options, kind)
    parts_run = {"refused": refuse_dense_steps_per_tensor, "resume": resume, "nonfinite": nonfinite_raise,
                 "warning": momentum_warnings}
    for part, function in parts_run.items():
        if part in parts:
            function()
    total = hvd.allreduce(tf.ones(1), op=hvd.Sum, name="test.final").numpy()[0]
    assert total == size
    print(f"PASSED rank={rank} size={size}", flush=True)


if __name__ == "__main__":
    main()
