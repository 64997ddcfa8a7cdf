"""Worker: the baseline sparsifiers through stock horovod.tensorflow, checked every step, then every
error a user can cause, on every rank.

Configurations run ``DistributedGradientTape`` inside ``tf.function`` (per tensor and whole
model), with bf16 gradients, with ``backward_passes_per_step=2`` and with a non-finite gradient;
one trains DGC with Keras ``model.fit`` and ``CompressionCallback`` (warm-up through set_epoch,
statistics to JSON lines and TensorBoard). After every tape step every rank checks the applied
gradient and its residual against a reference built from every rank's allgathered vectors
(baseline_checks.py); at the end, identical weights. Then each refused input, printing
``REFUSED <what> rank=<r>`` where every rank raised; the job ends with a collective.
``argv[1]``: a directory for the statistics log.
"""

from __future__ import annotations

import json
import math
import os
import sys

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf
from baseline_checks import check_step, cleared, threshold_selection, topk_indices
from checks import by_tensor, check_identical

import hvd_sparse.tensorflow as hs
from hvd_sparse import ConfigurationError, UnsupportedTensorError
from hvd_sparse.monitor import stat_vector
from hvd_sparse.tensorflow import keras as hs_keras
from tests.reference.engine import expected_step

STEPS = 8
LOG_DIR = sys.argv[1] if len(sys.argv) > 1 else "."
LOSS = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def allgather_rows(vector: np.ndarray, name: str) -> np.ndarray:
    return hvd.allgather(tf.constant(np.ascontiguousarray(vector, dtype=np.float32))[None], name=name).numpy()


def make_model(dtype: str = "float32") -> tf.keras.Model:
    def build(dtype):
        tf.random.set_seed(0)
        return tf.keras.Sequential([
            tf.keras.layers.Dense(24, activation="tanh", input_shape=(16,), dtype=dtype),
            tf.keras.layers.Dense(5, dtype=dtype)])

    model = build("float32")
    hvd.broadcast_variables(model.variables, root_rank=0)
    if dtype == "float32":
        return model
    converted = build(dtype)  # Horovod cannot broadcast bf16: broadcast in fp32, then cast
    for target, source in zip(converted.variables, model.variables, strict=True):
        target.assign(tf.cast(source, target.dtype))
    return converted


def batches(steps: int = STEPS, nan_step: int | None = None):
    rng = np.random.default_rng(1000 + hvd.rank())
    for step in range(steps):
        x = rng.standard_normal((12, 16)).astype(np.float32)
        if step == nan_step and hvd.rank() == 1:
            x[0, 0] = np.nan
        yield x, rng.integers(0, 5, 12).astype(np.int32)


def finish(label: str, model: tf.keras.Model, compressor, steps: int = STEPS) -> None:
    stats = compressor.stats()
    assert stats["step"] == steps, (label, stats["step"], steps)
    weights = np.concatenate([v.numpy().astype(np.float32).reshape(-1) for v in model.trainable_variables])
    check_identical(allgather_rows(weights, f"test.{label}.weights"), f"{label} weights")
    print(f"CHECKED tf/{label} rank={hvd.rank()} density={stats['density_actual']:.4f} "
          f"buildup={stats['buildup']:.3f}", flush=True)


def run_tape(label: str, compressor, check, *, dtype: str = "float32", steps_per_epoch: int | None = None,
             nan_step: int | None = None):
    """STEPS tape steps inside tf.function; after each, ``check(step, raw, applied, old, new,
    label)`` on every bucket (``old``/``new``: the bucket's state before and after)."""
    model = make_model(dtype)
    variables = model.trainable_variables
    optimizer = tf.keras.optimizers.SGD(0.1)
    scope = compressor.algorithm.scope

    @tf.function
    def train_step(x, y):
        with tf.GradientTape(persistent=True) as tape:
            loss = LOSS(y, tf.cast(model(tf.cast(x, dtype), training=True), tf.float32))
        raw = tape.gradient(loss, variables)
        applied = hs.DistributedGradientTape(tape, compression=compressor).gradient(loss, variables)
        optimizer.apply_gradients(zip(applied, variables, strict=True))
        return raw, applied

    groups = [("model", list(range(len(variables))))] if scope == "model" else \
        [(f"g{i}", [i]) for i in range(len(variables))]
    for step, (x, y) in enumerate(batches(nan_step=nan_step)):
        if steps_per_epoch:
            compressor.set_epoch(step // steps_per_epoch)
        old = by_tensor(compressor.state_dict()["buckets"])
        raw, applied = train_step(tf.constant(x), tf.constant(y))
        raw = [g.numpy().astype(np.float32) for g in raw]
        applied = [g.numpy().astype(np.float32) for g in applied]
        new = by_tensor(compressor.state_dict()["buckets"])
        for key, members in groups:
            flat_raw = np.concatenate([raw[i].reshape(-1) for i in members])
            flat_applied = np.concatenate([applied[i].reshape(-1) for i in members])
            check(step, flat_raw, flat_applied, old.get(key), new[key], f"{label} step {step} bucket {key}")
    finish(label, model, compressor)
    return compressor


def run_keras_bpps(label: str, compressor, density: float) -> None:
    """backward_passes_per_step=2 through the Keras optimizer (Horovod 0.28.1's tape has no such
    option): Horovod sums two passes locally and calls the compressor once per round, inside its
    tf.cond; weights move only on the second pass, by the compressed sum."""
    model = make_model()
    learning_rate = 0.5
    optimizer = hs_keras.DistributedOptimizer(tf.keras.optimizers.SGD(learning_rate), compressor,
                                              backward_passes_per_step=2)
    model.compile(loss=LOSS, optimizer=optimizer)
    total, rounds = None, 0
    for step, (x, y) in enumerate(batches(2 * STEPS)):
        old = by_tensor(compressor.state_dict()["buckets"])
        with tf.GradientTape() as tape:
            loss = LOSS(y, model(x, training=True))
        raw = [g.numpy() for g in tape.gradient(loss, model.trainable_variables)]
        total = raw if total is None else [t + r for t, r in zip(total, raw, strict=True)]
        before = [v.numpy() for v in model.trainable_variables]
        model.train_on_batch(x, y)
        after = [v.numpy() for v in model.trainable_variables]
        if step % 2 == 0:  # first pass of the round: nothing communicated, nothing applied
            assert compressor.stats()["step"] == rounds, (label, step, compressor.stats()["step"])
            assert all(np.array_equal(b, a) for b, a in zip(before, after, strict=True)), label
            continue
        new = by_tensor(compressor.state_dict()["buckets"])
        check = check_topk(density)
        for i, (b, a) in enumerate(zip(before, after, strict=True)):
            applied = ((b - a) / learning_rate).reshape(-1)
            check(rounds, total[i].reshape(-1), applied, old.get(f"g{i}"), new[f"g{i}"],
                  f"{label} step {rounds} bucket g{i}", rtol=1e-4)
        rounds += 1
        total = None
    finish(label, model, compressor)


def gathered(label, acc, new):
    return allgather_rows(acc, f"test.{label}.acc"), allgather_rows(new["residual"], f"test.{label}.res")


def plain_acc(raw, old):
    return raw + (old["residual"] if old is not None else 0)


# --- per-method checks (the same as the torch worker's) ----------------------------------------------
def check_randomk(density: float, shared: bool):
    def check(step, raw, applied, old, new, label):
        accs, residuals = gathered(label, plain_acc(raw, old), new)
        sent = cleared(accs, residuals)
        k = max(1, int(density * raw.size))
        assert all(s.size == k for s in sent), (label, [s.size for s in sent], k)
        if shared:
            assert all(np.array_equal(s, sent[0]) for s in sent), f"{label}: ranks drew different indices"
        elif raw.size > 20:
            assert not np.array_equal(sent[0], sent[1]), f"{label}: independent draws coincide"
        check_step(hvd.rank(), accs, residuals, applied, sent, "gather", label)
    return check


def check_threshold(density: float, lam: float | None, pattern: str):
    def check(step, raw, applied, old, new, label):
        accs, residuals = gathered(label, plain_acc(raw, old), new)
        threshold = lam if lam is not None else 1 / (2 * math.sqrt(max(1, int(density * raw.size))))
        selections = [threshold_selection(acc, threshold, step) for acc in accs]
        check_step(hvd.rank(), accs, residuals, applied, selections, pattern, label)
    return check


def check_cleared():
    def check(step, raw, applied, old, new, label):
        accs, residuals = gathered(label, plain_acc(raw, old), new)
        sent = cleared(accs, residuals)
        assert all(s.size >= 1 for s in sent), label
        check_step(hvd.rank(), accs, residuals, applied, sent, "gather", label)
    return check


def check_dgc(density, momentum, warmup_epochs, steps_per_epoch, clip_norm=None):
    """Momentum correction, clipping (each tensor's own norm, also when its step is packed with
    others'), masking and the warm-up k, against a NumPy re-computation."""
    from tests.reference.dgc import dgc_density

    def check(step, raw, applied, old, new, label):
        u = np.zeros_like(raw) if old is None else old["momentum"]
        v = np.zeros_like(raw) if old is None else old["residual"]
        grad = raw
        if clip_norm is not None:
            norm = float(np.linalg.norm(raw.astype(np.float64)))
            coefficient = clip_norm / math.sqrt(hvd.size()) / (norm + 1e-6)
            grad = raw * np.float32(coefficient) if coefficient < 1 else raw
        u = u * np.float32(momentum) + grad
        accs, residuals = gathered(label, v + u, new)
        sent = cleared(accs, residuals)
        k = math.ceil(raw.size * dgc_density(density, warmup_epochs, step // steps_per_epoch))
        assert all(1 <= s.size <= k for s in sent), (label, [s.size for s in sent], k)
        check_step(hvd.rank(), accs, residuals, applied, sent, "gather", label, exact=False)
        u[sent[hvd.rank()]] = 0
        np.testing.assert_allclose(new["momentum"], u, rtol=1e-5, atol=1e-7,
                                   err_msg=f"{label}: momentum buffer differs (correction or masking)")
    return check


def check_topk(density: float):
    def check(step, raw, applied, old, new, label, rtol=1e-5):
        old_residual = old["residual"] if old is not None else np.zeros_like(raw)
        finite = bool(np.isfinite(raw).all())
        acc = old_residual + raw if finite else np.zeros_like(raw)
        accs, residuals = gathered(label, acc, new)
        selections = [topk_indices(a, max(1, int(density * raw.size))) for a in accs]
        if finite:
            check_step(hvd.rank(), accs, residuals, applied, selections, "gather", label, rtol=rtol,
                       exact=rtol <= 1e-5)
        else:
            average, _, _ = expected_step(list(accs), selections, "gather")
            np.testing.assert_allclose(applied, average, rtol=1e-5, atol=1e-7, err_msg=label)
            np.testing.assert_array_equal(new["residual"], old_residual,
                                          err_msg=f"{label}: a skipped rank's residual moved")
            print(f"SKIPPED {label} rank={hvd.rank()}", flush=True)
    return check


def check_bfloat16(density: float):
    """bf16 gradients: values travel in fp32, so what was sent is where the residual was cleared."""
    def check(step, raw, applied, old, new, label):
        accs, residuals = gathered(label, plain_acc(raw, old), new)
        sent = cleared(accs, residuals)
        assert all(s.size <= max(1, int(density * raw.size)) for s in sent), label
        average, expected_residuals, _ = expected_step(list(accs), sent, "gather")
        np.testing.assert_allclose(applied, average, rtol=1e-2, atol=1e-2 * np.abs(average).max(),
                                   err_msg=label)  # the applied gradient is bf16
        np.testing.assert_array_equal(residuals[hvd.rank()], expected_residuals[hvd.rank()], label)
    return check


# --- Keras: DGC with the callback ---------------------------------------------------------------
def run_keras_dgc() -> None:
    label = "keras/dgc"
    model = make_model()
    compressor = hs.DGC(0.05, warmup_epochs=2, prefix="hs.keras.dgc")
    optimizer = hs_keras.DistributedOptimizer(tf.keras.optimizers.SGD(0.05), compressor)
    model.compile(loss=LOSS, optimizer=optimizer)
    densities = []

    class Record(tf.keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            densities.append(compressor.stats()["density_target"])

    x, y = next(batches(1))
    x = np.repeat(x, 4, axis=0)
    y = np.repeat(y, 4, axis=0)
    callback = hs.CompressionCallback(compressor, every=2,
                                      keys=("density_target", "density_actual", "buildup"),
                                      jsonl=os.path.join(LOG_DIR, "keras_stats.jsonl"),
                                      tensorboard=os.path.join(LOG_DIR, "tensorboard"))
    model.fit(x, y, batch_size=12, epochs=3, shuffle=False, verbose=0, callbacks=[callback, Record()])
    expected = [max(0.05 ** ((e + 1) / 3), 0.05) if e < 2 else 0.05 for e in range(3)]
    assert np.allclose(densities, expected), (densities, expected)
    finish(label, model, compressor, steps=12)


# --- errors ---------------------------------------------------------------------------------------
def expect_refusal(what: str, action, error, fragment: str) -> None:
    """``action`` must raise ``error`` -- directly, or as the cause AutoGraph wraps when it is
    raised while tracing a tf.function -- with ``fragment`` in its message."""
    try:
        action()
    except Exception as raised:
        chain, cause = [], raised
        while cause is not None:
            chain.append(cause)
            cause = cause.__cause__ or cause.__context__
        matching = [e for e in chain if isinstance(e, error)]
        assert matching, f"{what}: expected {error}, got {[type(e).__name__ for e in chain]}: {raised}"
        message = getattr(matching[0], "message", None) or str(matching[0])
        assert fragment in message, f"{what}: unexpected message {message}"
        first = next(line for line in message.splitlines() if fragment in line).strip()[:300]
        print(f"REFUSED {what} rank={hvd.rank()}: {type(matching[0]).__name__}: {first}", flush=True)
        return
    raise AssertionError(f"{what}: no error was raised")


def tape_with(compressor, tape_factory=None, **tape_options):
    def action():
        model = make_model()
        variables = model.trainable_variables

        @tf.function
        def step(x):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(model(x))
            factory = tape_factory or hvd.DistributedGradientTape
            return factory(tape, compression=compressor, **tape_options).gradient(loss, variables)

        step(tf.ones((2, 16)))
    return action


def complex_gradient():
    variable = tf.Variable(tf.complex(tf.ones(4), tf.ones(4)))

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.abs(variable) ** 2)
        return hvd.DistributedGradientTape(tape, compression=hs.TopK(0.5, prefix="err.complex")).gradient(
            loss, [variable])

    step()


def nonfinite_raise():
    variable = tf.Variable(tf.ones(8))

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(variable * x)
        return hvd.DistributedGradientTape(
            tape, compression=hs.TopK(0.5, nonfinite="raise", prefix="err.nan")).gradient(loss, [variable])

    x = np.ones(8, np.float32)
    if hvd.rank() == 0:
        x[0] = np.inf
    step(tf.constant(x))[0].numpy()


def main() -> None:
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    run_tape("randomk/tensor/gather", hs.RandomK(0.1, seed=1, prefix="hs.rk.t"), check_randomk(0.1, False))
    shared = run_tape("randomk/model/shared",
                      hs.RandomK(0.1, seed=2, shared_seed=True, scope="model", prefix="hs.rk.m"),
                      check_randomk(0.1, True))
    run_tape("threshold/model/union", hs.Threshold(0.05, pattern="union", prefix="hs.th.m"),
             check_threshold(0.05, None, "union"))
    run_tape("threshold/tensor/gather", hs.Threshold(threshold=0.02, scope="tensor", prefix="hs.th.t"),
             check_threshold(0.01, 0.02, "gather"))
    run_tape("gaussiank/tensor/gather", hs.GaussianK(0.1, prefix="hs.gk"), check_cleared())
    run_tape("dgc/tensor/gather", hs.DGC(0.1, momentum=0.9, clip_norm=0.1, warmup_epochs=2, prefix="hs.dgc"),
             check_dgc(0.1, 0.9, 2, 3, clip_norm=0.1), steps_per_epoch=3)
    run_tape("topk/bfloat16", hs.TopK(0.1, prefix="hs.bf16"), check_bfloat16(0.1), dtype="bfloat16")
    run_tape("topk/nan-skip", hs.TopK(0.1, prefix="hs.nan"), check_topk(0.1), nan_step=3)
    run_keras_bpps("keras/topk/bpps2", hs.TopK(0.1, prefix="hs.bpps"), 0.1)
    run_keras_dgc()

    keys = ("density_actual", "buildup", "bytes_sent", "residual_norm")
    averaged = shared.average_stats(keys)  # one named allreduce, on every rank
    rows = allgather_rows(np.array(stat_vector(shared.stats(), keys)), "test.stats.rows")
    assert np.allclose([averaged[k] for k in keys], rows.mean(axis=0), rtol=1e-6), (averaged, rows)
    print(f"AVERAGED rank={rank} {averaged}", flush=True)

    expect_refusal("adasum", tape_with(hs.TopK(0.1, prefix="err.adasum"), op=hvd.Adasum),
                   ConfigurationError, "op=hvd.Adasum")
    expect_refusal("sum", tape_with(hs.TopK(0.1, prefix="err.sum"), op=hvd.Sum),
                   ConfigurationError, "op=hvd.Sum")
    expect_refusal("grouping", tape_with(hs.TopK(0.1, scope="model", prefix="err.groups")),
                   ConfigurationError, "num_groups=1")
    expect_refusal("complex", complex_gradient, UnsupportedTensorError, "complex64")
    expect_refusal("nan-raise", nonfinite_raise, tf.errors.OpError, "raised on every rank")
    total = hvd.allreduce(tf.ones(1), op=hvd.Sum, name="test.final").numpy()[0]
    assert total == size
    if rank == 0:
        with open(os.path.join(LOG_DIR, "keras_stats.jsonl")) as log:
            lines = log.read().splitlines()
        assert [json.loads(line)["step"] for line in lines] == [2, 4, 6, 8, 10, 12], lines
    print(f"PASSED rank={rank} size={size}", flush=True)


if __name__ == "__main__":
    main()
