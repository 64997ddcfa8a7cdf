"""Elastic TensorFlow job: the torch_elastic.py schedule (elastic_common.py) with ExDyna (the whole
model in one py_function) and TopK (per-tensor phased graphs), each model, optimizer and compressor
in one hvd_sparse.tensorflow.elastic.TensorFlowKerasState, steps in tf.function."""

from __future__ import annotations

import os
import types

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf
from elastic_common import (
    COMMIT_EVERY,
    END,
    N_HIDDEN,
    N_IN,
    N_OUT,
    Sizes,
    check_method,
    data,
    die,
    eval_data,
    is_victim,
    job_arguments,
    report_final,
    wait_a_little,
    world_change_due,
)
from tf_common import LOSS, allgather_rows, tape_step

import hvd_sparse.tensorflow as hs
from hvd_sparse.tensorflow.elastic import TensorFlowKerasState, TensorFlowState, run

METHODS = {
    "exdyna": lambda: hs.ExDyna(0.05, prefix="hs.exdyna"),
    "topk": lambda: hs.TopK(0.05, prefix="hs.topk"),
}
EXCLUSIVE = ("exdyna",)


def make_part(method: str, optimizer):
    tf.random.set_seed(0)
    model = tf.keras.Sequential([tf.keras.layers.Dense(N_HIDDEN, activation="tanh", input_shape=(N_IN,)),
                                 tf.keras.layers.Dense(N_OUT)])
    compression = METHODS[method]()

    train_step = tape_step(model, optimizer, compression)

    return model, compression, train_step


def error_surfaces() -> None:
    """An error raised inside a step's py_function (an UnknownError naming no Horovod op) leaves
    the run function as it is: Horovod's own TensorFlow wrapper would return None instead."""
    def fail(_):
        raise RuntimeError("raised inside the step")

    @run
    def train(state):
        tf.py_function(fail, [tf.constant(0.0)], Tout=tf.float32)
        return "returned"

    try:
        outcome = train(TensorFlowState([tf.Variable([0.0])], step=0))
    except tf.errors.UnknownError as error:
        outcome = f"raised {type(error).__name__}"
    print(f"OUTCOME {outcome}", flush=True)


def train_every_method(parts: dict, step: int, victim: bool, directory: str) -> None:
    """One step of every method on this rank's batch; the victim dies before the last one's step."""
    for method, (_, _, train_step) in parts.items():
        x, y = data(1, step, hvd.rank())
        if victim and method == list(parts)[-1]:
            die(directory)
        try:
            train_step(tf.constant(x), tf.constant(y))
        except tf.errors.OpError as error:
            print(f"STEP FAILED {method} {type(error).__name__}: {str(error.message)[:200]!r}", flush=True)
            raise


def main() -> None:
    args = job_arguments(METHODS, ("--fail", "only check that an error surfaces"))
    hvd.init()
    if args.fail:
        error_surfaces()
        return
    optimizer = tf.keras.optimizers.SGD(0.5)   # no slots: one optimizer serves every model
    parts = {method: make_part(method, optimizer) for method in args.methods.split(",")}
    # The documented line; here the "model" is every method's variables (an object with
    # .variables is all Horovod's state needs), and compression a list.
    models = types.SimpleNamespace(variables=[v for model, _, _ in parts.values() for v in model.variables])
    optimizer.build([v for model, _, _ in parts.values() for v in model.trainable_variables])
    state = TensorFlowKerasState(models, optimizer, compression=[c for _, c, _ in parts.values()], step=0)
    sizes = Sizes()

    @run   # hvd.elastic.run, recovering from a failed grouped allreduce too
    def train(state):
        while state.step < END:
            size, rank = hvd.size(), hvd.rank()
            if world_change_due(state.step, size, args.dir, rank, args.static):
                state.commit()
                wait_a_little()
                continue
            train_every_method(parts, state.step, is_victim(state.step, size, args.static), args.dir)
            for method, (model, compression, _) in parts.items():
                weights = np.concatenate([v.numpy().ravel() for v in model.variables])
                stats = compression.stats()
                check_method(method, weights, stats, allgather_rows, state.step, size, rank,
                             method in EXCLUSIVE and size > 1, sizes.is_new(size),
                             checked=size > 1 or stats["step"] > 0)   # TF skips the compressor at one rank
            sizes.note(size)
            state.step += 1
            if state.step % COMMIT_EVERY == 0:
                state.commit()
        state.commit()   # accounts for ranks that left without a sync

    train(state)
    if hvd.rank() == 0:
        x, y = eval_data()
        for method, (model, compression, _) in parts.items():
            report_final(method, float(LOSS(y, model(x))), state.step, compression.stats())
    print(f"PASSED rank={hvd.rank()} size={hvd.size()} sizes={sizes}", flush=True)


if __name__ == "__main__":
    main()
