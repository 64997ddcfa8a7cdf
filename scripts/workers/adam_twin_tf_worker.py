"""Worker of scripts/adam_twin_tf.py: the transformer task's Keras twin trained by a real Horovod
TensorFlow job with AdamW, densely, with a sparsifier plain, or with it on the Adam path.

One process per rank (``horovodrun --gloo -np N``). The model is ``gpt_tf.keras_gpt`` with the
torch task's initial weights (``gpt.gpt_model(seed)``), the batches are the torch task's
(``words.word_batch`` of the "tree" corpus, seeded by seed, rank and step), a
``tf.GradientTape`` loop in ``tf.function`` under Horovod's or hvd_sparse's
``DistributedGradientTape``:

* ``dense``: Horovod's tape (allreduce), Keras's AdamW;
* ``plain``: hvd_sparse's tape with the method, Keras's AdamW on its sparse average;
* ``adam``: hvd_sparse's tape with the method on the Adam path
  (``hvd_sparse.tensorflow.optimizers.AdamW`` as ``optimizer=``).

Rank 0 writes the training losses, the held-out loss (the torch task's 16 k validation tokens)
and the bytes a rank put into collectives to ``--out`` as JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import time

import numpy as np

EPS = 1e-8   # torch's AdamW default; Keras's is 1e-7


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=("dense", "plain", "adam"), required=True)
    parser.add_argument("--method", default="ExDyna")
    parser.add_argument("--option", action="append", default=[], help="name=value (a Python literal)")
    parser.add_argument("--density", type=float, default=0.01)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--weight-decay", type=float, default=0.01)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True)
    return parser.parse_args()


def options_of(pairs: list[str]) -> dict:
    import ast
    out = {}
    for pair in pairs:
        name, _, value = pair.partition("=")
        try:
            out[name] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            out[name] = value
    return out


def build(args: argparse.Namespace, hvd, tf) -> tuple:
    """(model, its weights in the torch model's order, optimizer, compressor or None): the Keras
    twin with the torch task's initial weights, and the run's exchange."""
    import hvd_sparse.tensorflow as hs
    from hvd_sparse.sim import gpt, gpt_tf
    from hvd_sparse.tensorflow.optimizers import AdamW

    torch_model = gpt.gpt_model(args.seed)
    names = [n for n, _ in torch_model.named_parameters()]
    arrays = [p.detach().numpy() for _, p in torch_model.named_parameters()]
    model = gpt_tf.keras_gpt(args.seed)
    variables = gpt_tf.ordered_weights(model)
    for variable, value in zip(variables, gpt_tf.weights_for_keras(arrays, names), strict=True):
        variable.assign(value)
    compressor = None
    if args.mode == "adam":
        optimizer = AdamW(learning_rate=args.lr, weight_decay=args.weight_decay, epsilon=EPS)
        compressor = getattr(hs, args.method)(args.density, optimizer=optimizer, total_steps=args.steps,
                                              **options_of(args.option))
    else:
        optimizer = tf.keras.optimizers.AdamW(learning_rate=args.lr, weight_decay=args.weight_decay,
                                              epsilon=EPS)
        if args.mode == "plain":
            compressor = getattr(hs, args.method)(args.density, **options_of(args.option))
    return model, variables, optimizer, compressor


def train(args: argparse.Namespace, hvd, tf, model, variables, optimizer, compressor, corpus) -> list[float]:
    """The tape loop over the torch task's batches; this rank's losses."""
    import hvd_sparse.tensorflow as hs
    from hvd_sparse.sim import words

    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x))
        if compressor is None:
            tape = hvd.DistributedGradientTape(tape)
        else:
            tape = hs.DistributedGradientTape(tape, compression=compressor)
        grads = tape.gradient(loss, variables)
        optimizer.apply_gradients(zip(grads, variables, strict=True))
        return loss

    losses = []
    for t in range(args.steps):
        x, y = words.word_batch(corpus.train, hvd.rank(), t, args.batch_size, 32, args.seed)
        losses.append(float(step(tf.constant(x), tf.constant(y))))
    return losses


def heldout_loss(tf, model, corpus) -> float:
    """Mean next-token loss over the torch task's 16 k validation tokens, windows of 64."""
    from hvd_sparse.sim import words

    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    eval_x, eval_y = words.eval_windows(corpus.valid, 64, words.EVAL_TOKENS)
    pieces = max(1, len(eval_x) // 64)
    nats = sum(float(loss_fn(yb, model(xb))) * yb.size
               for xb, yb in zip(np.array_split(eval_x, pieces), np.array_split(eval_y, pieces), strict=True))
    return nats / eval_y.size


def main() -> None:
    args = parse_args()
    import horovod.tensorflow as hvd
    import tensorflow as tf

    from hvd_sparse.sim import gpt, words

    hvd.init()
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    model, variables, optimizer, compressor = build(args, hvd, tf)
    corpus = words.word_corpus(gpt.VOCAB_SIZE, scope=gpt.CORPUS_SCOPE)
    started = time.perf_counter()
    losses = train(args, hvd, tf, model, variables, optimizer, compressor, corpus)
    seconds = time.perf_counter() - started
    mean_losses = hvd.allreduce(tf.constant(losses, tf.float64), op=hvd.Average).numpy()
    dense_bytes = 4.0 * sum(int(np.prod(v.shape)) for v in variables) * args.steps
    stats = compressor.stats() if compressor is not None else {}
    record = {"mode": args.mode, "method": args.method if compressor else "dense", "density": args.density,
              "steps": args.steps, "ranks": hvd.size(), "losses": [float(v) for v in mean_losses],
              "train_loss": float(np.mean(mean_losses[-100:])),
              "heldout_loss": heldout_loss(tf, model, corpus),
              "bytes_sent": float(stats.get("bytes_sent_total", dense_bytes)), "dense_bytes": dense_bytes,
              "seconds": seconds}
    record["perplexity"] = math.exp(record["heldout_loss"])
    if hvd.rank() == 0:
        with open(args.out, "w") as f:
            json.dump(record, f)


if __name__ == "__main__":
    main()
