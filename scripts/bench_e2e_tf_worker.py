"""One rank of the TensorFlow end-to-end benchmark (one process per rank, under horovodrun).

The TensorFlow twin of scripts/bench_e2e_worker.py, shaped like Horovod's
``examples/tensorflow2/tensorflow2_synthetic_benchmark.py``: a tf-keras model on synthetic images,
one ``tf.function`` step that opens a ``GradientTape``, wraps it in a distributed tape
(``hvd.DistributedGradientTape`` for dense and fp16, ``hvd_sparse.tensorflow.DistributedGradientTape``
-- every gradient in one Horovod group -- for the sparsifiers) and applies the averaged gradients.
Every configuration of the PyTorch worker's ``CONFIGS`` runs in the one job, side by side, in the
same rotated block order (``block_order``); ``local`` computes the same step without any
communication. Each block builds a fresh model from the same seed and a fresh compressor, runs
untimed warm-up steps (the first traces the step), then ``--steps`` timed steps, each after a
barrier; a step's time is the slowest rank's. Rank 0 prints images per second per rank and each
configuration's ratio to dense, and writes the records to ``--out`` (JSON) and their table, with
the targets (seed methods at >= 0.9x dense's throughput, TopK at >= 0.7x), beside it (.md).

    TF_USE_LEGACY_KERAS=1 OMP_NUM_THREADS=1 horovodrun --gloo -np 2 -H localhost:2 \\
        python scripts/bench_e2e_tf_worker.py --configs dense,local,exdyna-tracking,topk

Models: ``mobilenetv2`` (tf.keras.applications, weights=None), or any name that
scripts/e2e_models.py's ``build(name, "tensorflow")`` knows, where that module exists.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

from bench_e2e_worker import block_order
from bench_e2e_worker import resolve as resolve_shared

# Beside the shared configurations: top-k over the whole model (one bucket; "topk" is per tensor).
TF_CONFIGS: dict[str, tuple[str, dict]] = {"topk-model": ("topk", {"scope": "model"})}


def resolve(config: str) -> tuple[str, dict, str]:
    """(method or Horovod compression, options, kernel mode) of a configuration name; KeyError
    when it names none."""
    if config in TF_CONFIGS:
        return (*TF_CONFIGS[config], "auto")
    return resolve_shared(config)


def build_parser() -> argparse.ArgumentParser:
    """The worker's command line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="mobilenetv2")
    parser.add_argument("--image-size", type=int, default=128)
    parser.add_argument("--classes", type=int, default=1000)
    parser.add_argument("--batch", type=int, default=8, help="images per rank per step")
    parser.add_argument("--configs", default="dense,fp16,local,exdyna-tracking,micro,deft,lags,topk")
    parser.add_argument("--density", type=float, default=0.001)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps (the first traces)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", default=None)
    return parser


def build_model(args: argparse.Namespace) -> tuple[Any, bool]:
    """The model from seed 0 on every rank (identical weights, no broadcast needed), and whether
    it outputs logits (the zoo's models) rather than probabilities (Keras's MobileNetV2)."""
    import tensorflow as tf

    tf.keras.utils.set_random_seed(0)
    if args.model == "mobilenetv2":
        return tf.keras.applications.MobileNetV2(
            weights=None, input_shape=(args.image_size, args.image_size, 3), classes=args.classes), False
    import e2e_models  # the shared builders (scripts/e2e_models.py)

    spec = e2e_models.build(args.model, "tensorflow", image_size=args.image_size)
    if spec.kind != "image" or spec.classes != args.classes:
        raise SystemExit(f"--model {args.model}: this worker feeds images of {args.classes} classes")
    return spec.model, True


def make_step(config: str, args: argparse.Namespace, model: Any, logits: bool) -> tuple[Any, Any]:
    """(the traced training step, the compressor or None) of one configuration."""
    import horovod.tensorflow as hvd
    import tensorflow as tf

    import hvd_sparse
    import hvd_sparse.tensorflow as hs

    method, options, kernels = resolve(config)
    hvd_sparse.set_kernels(kernels)
    opt = tf.keras.optimizers.SGD(0.01)
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=logits)
    compression = None
    if method == "horovod":
        wrap = {"none": hvd.Compression.none, "fp16": hvd.Compression.fp16}[options["compression"]]

        def distribute(tape):
            return hvd.DistributedGradientTape(tape, compression=wrap)
    elif method == "local":
        def distribute(tape):
            return tape
    else:
        compression = hs.SparseCompressor(hvd_sparse.create(method, density=args.density, **options))

        def distribute(tape):
            return hs.DistributedGradientTape(tape, compression)

    @tf.function
    def step(images, labels):
        with tf.GradientTape() as tape:
            loss = loss_fn(labels, model(images, training=True))
        grads = distribute(tape).gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        return loss

    return step, compression


def run_block(config: str, args: argparse.Namespace, data: tuple) -> dict:
    """Warm-up and timed steps of one configuration, built afresh; this rank's step seconds."""
    import horovod.tensorflow as hvd
    import tensorflow as tf

    model, logits = build_model(args)
    step, compression = make_step(config, args, model, logits)
    for _ in range(args.warmup):
        step(*data).numpy()
    seconds = []
    for _ in range(args.steps):
        hvd.allreduce(tf.zeros([1]), name="tf_e2e.barrier").numpy()  # ranks start aligned
        started = time.perf_counter()
        step(*data).numpy()
        seconds.append(time.perf_counter() - started)
    stats = compression.stats() if compression is not None else {}
    traces = step.experimental_get_tracing_count()
    return {"config": config, "seconds": seconds, "traces": traces,
            "density_actual": stats.get("density_actual"),
            "numel": int(sum(v.shape.num_elements() for v in model.trainable_variables))}


def merge(per_rank: list[list[dict]]) -> list[dict]:
    """One record per block: each timed step's slowest rank."""
    merged = []
    for blocks in zip(*per_rank, strict=True):
        slowest = [max(s) for s in zip(*(b["seconds"] for b in blocks), strict=True)]
        merged.append({**blocks[0], "seconds": slowest, "rank_seconds": [b["seconds"] for b in blocks]})
    return merged


def report(merged: list[dict], configs: list[str], batch: int) -> list[str]:
    """Lines: images per second per rank (median over every timed step), and the ratio to dense."""
    rates = {c: batch / statistics.median([s for r in merged if r["config"] == c for s in r["seconds"]])
             for c in configs}
    dense = rates.get("dense")
    lines = []
    for config, rate in rates.items():
        ratio = f"  {rate / dense:5.2f}x dense" if dense else ""
        traces = max(r["traces"] for r in merged if r["config"] == config)
        lines.append(f"[tf-e2e] {config:<20} {rate:7.2f} img/s per rank{ratio}  (traces {traces})")
    return lines


SEEDS = ("exdyna-tracking", "micro", "deft", "lags")
TARGETS = {**dict.fromkeys(SEEDS, 0.9), "topk": 0.7, "topk-model": 0.7}   # x dense's img/s


def markdown(merged: list[dict], configs: list[str], args: argparse.Namespace, size: int) -> str:
    """The job's table: img/s per rank (median over timed steps) and the ratio to dense's
    throughput within each repeat (median), with the issue's targets met or not."""
    def rate(records: list[dict]) -> float:
        return args.batch / statistics.median([s for r in records for s in r["seconds"]])

    dense = {r["repeat"]: rate([r]) for r in merged if r["config"] == "dense"}
    lines = [f"TensorFlow, {args.model} at {args.image_size} px, batch {args.batch}/rank, {size} "
             f"ranks, Gloo loopback, density {args.density:g}; {args.repeats} repeats x {args.steps} "
             "timed steps per configuration (blocks, rotated order).", "",
             "| config | img/s per rank | x dense (median of repeats) | target | traces |",
             "|---|---|---|---|---|"]
    for config in configs:
        records = [r for r in merged if r["config"] == config]
        ratios = [rate([r]) / dense[r["repeat"]] for r in records if r["repeat"] in dense]
        ratio = statistics.median(ratios) if ratios else None
        target = TARGETS.get(config)
        verdict = "" if target is None or ratio is None else (
            f"{'met' if ratio >= target else 'NOT met'} (>= {target:g}x)")
        lines.append(f"| {config} | {rate(records):.2f} | "
                     f"{'-' if ratio is None else f'{ratio:.2f}'} | {verdict} | "
                     f"{max(r['traces'] for r in records)} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    """Measure every configuration on this rank; rank 0 prints and writes the merged records."""
    args = build_parser().parse_args()
    import horovod.tensorflow as hvd
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    tf.config.threading.set_inter_op_parallelism_threads(1)
    hvd.init()
    configs = args.configs.split(",")
    for config in configs:
        resolve(config)  # KeyError before any work for a name that is not a configuration
    rng = tf.random.Generator.from_seed(1000 + hvd.rank())
    data = (rng.uniform([args.batch, args.image_size, args.image_size, 3]),
            rng.uniform([args.batch], maxval=args.classes, dtype=tf.int64))
    records = []
    for repeat in range(args.repeats):
        for config in block_order(configs, repeat):
            records.append({**run_block(config, args, data), "repeat": repeat})
            if hvd.rank() == 0:
                print(f"[tf-e2e] repeat {repeat} {config}: "
                      f"{statistics.median(records[-1]['seconds']) * 1e3:.0f} ms/step", flush=True)
    merged = merge(hvd.allgather_object(records))
    if hvd.rank() == 0:
        print("\n".join(report(merged, configs, args.batch)), flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"model": args.model, "image_size": args.image_size, "batch_per_rank": args.batch,
                           "size": hvd.size(), "density": args.density, "records": merged}, f, indent=1)
            with open(os.path.splitext(args.out)[0] + ".md", "w") as f:
                f.write(markdown(merged, configs, args, hvd.size()))


if __name__ == "__main__":
    main()
