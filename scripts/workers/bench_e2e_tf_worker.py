"""One rank of the TensorFlow end-to-end benchmark (started by scripts/bench_e2e.py with
``--framework tensorflow``, one process per rank; or by hand under horovodrun).

The TensorFlow twin of scripts/workers/bench_e2e_worker.py, shaped like Horovod's
``examples/tensorflow2/tensorflow2_synthetic_benchmark.py``: a tf-keras model on synthetic data,
one ``tf.function`` step that opens a ``GradientTape``, wraps it in a distributed tape
(``hvd.DistributedGradientTape`` for dense and fp16, ``hvd_sparse.tensorflow.DistributedGradientTape``
-- every gradient in one Horovod group -- for the sparsifiers) and applies the averaged gradients.
Every configuration of the PyTorch worker's ``CONFIGS`` (and ``topk-model``: top-k over the whole
model) runs in the one job, on the same schedules: ``blocks`` (per repeat each configuration in
turn, built afresh, in ``block_order``) or ``interleaved`` (every configuration alive, one timed
step each per round). ``local`` computes the same step without any communication. A timed step
starts after a barrier and ends when the step's loss is on the host; the job's step time is the
slowest rank's. A raw Horovod allreduce (``--probe-mb``, fp32 and fp16) measures the network first.

Rank 0 writes the job in the PyTorch worker's format (``--out``, JSON: settings, probe, one merged
record per configuration and visit), which bench_e2e.py summarises into the same tables, with the
TensorFlow targets (seed methods at >= 0.9x dense's throughput, TopK at >= 0.7x, on loopback).

    TF_USE_LEGACY_KERAS=1 OMP_NUM_THREADS=1 horovodrun --gloo -np 2 -H localhost:2 \\
        env PYTHONPATH=scripts python scripts/workers/bench_e2e_tf_worker.py \\
        --configs dense,local,exdyna-tracking,topk --out r.json

Models: ``mobilenetv2`` (tf.keras.applications, weights=None, 1000 classes, like Horovod's
script), or any model of scripts/models/e2e_models.py (``build(name, "tensorflow")``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from typing import Any

from models.e2e_models import MODELS, build, describe
from workers.bench_e2e_worker import (
    ADAM_PATH,
    STAT_KEYS,
    agree_on_rank0,
    bandwidth_probe,
    block_order,
    method_options,
    settle,
    visit_stats,
)
from workers.bench_e2e_worker import known as known_shared
from workers.bench_e2e_worker import resolve as resolve_shared

MOBILENET = "mobilenetv2"
MOBILENET_SIZE = 128   # the default image side of MobileNetV2 here (Horovod's script uses 224)
# Beside the shared configurations: top-k over the whole model (one bucket; "topk" is per tensor).
TF_CONFIGS: dict[str, tuple[str, dict]] = {"topk-model": ("topk", {"scope": "model"})}


def resolve(config: str) -> tuple[str, dict, str]:
    """(method or Horovod compression, options, kernel mode) of a configuration name; KeyError
    when it names none."""
    if config in TF_CONFIGS:
        return (*TF_CONFIGS[config], "auto")
    if ADAM_PATH in config:   # the torch worker's (--optimizer adamw)
        raise KeyError(config)
    return resolve_shared(config)


def known(config: str) -> bool:
    """Whether ``config`` names a configuration of this worker."""
    return known_shared(config, resolve)


def build_parser() -> argparse.ArgumentParser:
    """The worker's command line (bench_e2e.py builds it)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=(MOBILENET, *MODELS), default=MOBILENET)
    parser.add_argument("--image-size", type=int, default=None,
                        help=f"image side (default: the zoo model's; {MOBILENET_SIZE} for MobileNetV2)")
    parser.add_argument("--batch", type=int, default=8, help="samples per rank per step")
    parser.add_argument("--configs", default="dense,fp16,local,exdyna-tracking,micro,deft,lags,topk")
    parser.add_argument("--density", type=float, default=0.001)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps (the first traces)")
    parser.add_argument("--sparse-warmup", type=int, default=8,
                        help="untimed steps of a sparsifier (the first traces; thresholds settle)")
    parser.add_argument("--settle", type=int, default=0,
                        help="after --sparse-warmup, at most this many more untimed steps of a "
                             "sparsifier whose aggregate density is not yet settled")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--stat-steps", type=int, default=1,
                        help="untimed steps after the timed ones, each followed by stats()")
    parser.add_argument("--schedule", choices=("blocks", "interleaved"), default="blocks")
    parser.add_argument("--probe-mb", type=float, default=32.0)
    parser.add_argument("--optimizer", choices=("sgd",), default="sgd",
                        help="plain SGD (AdamW and the Adam path: the PyTorch worker)")
    parser.add_argument("--out", default=None, help="the job's JSON (rank 0)")
    return parser


def model_spec(args: argparse.Namespace, with_model: bool = False):
    """The zoo's ``ModelSpec`` (MobileNetV2: an image spec of 1000 classes at its side), with the
    model from seed 0 on every rank (identical weights, no broadcast) when asked."""
    import tensorflow as tf

    if args.model != MOBILENET:
        return build(args.model, "tensorflow", image_size=args.image_size, with_model=with_model)
    spec = describe("resnet18", "tensorflow", image_size=args.image_size or MOBILENET_SIZE)
    spec.name = MOBILENET
    if with_model:
        tf.keras.utils.set_random_seed(0)
        spec.model = tf.keras.applications.MobileNetV2(
            weights=None, input_shape=spec.input_shape, classes=spec.classes,
            classifier_activation=None)   # logits, like the zoo's models
    return spec


class Trainer:
    """One configuration: a fresh model, plain SGD and its distributed tape in a traced step."""

    def __init__(self, config: str, args: argparse.Namespace, hvd: Any, tf: Any, hvd_sparse: Any):
        import hvd_sparse.tensorflow as hs

        method, self.options, self.kernels = resolve(config)
        self.config, self.method, self.hvd_sparse = config, method, hvd_sparse
        spec = model_spec(args, with_model=True)
        model = spec.model
        self.numel = int(sum(v.shape.num_elements() for v in model.trainable_variables))
        opt = tf.keras.optimizers.SGD(0.01)
        self.compression = None
        if method == "horovod":
            wrap = getattr(hvd.Compression, self.options["compression"])

            def distribute(tape):
                return hvd.DistributedGradientTape(tape, compression=wrap)
        elif method == "local":
            def distribute(tape):
                return tape
        else:
            options, packs = method_options(self.options)
            algorithm = hvd_sparse.create(method, density=args.density, **options)
            algorithm.packs_tensors &= packs
            self.compression = hs.SparseCompressor(algorithm)

            def distribute(tape):
                return hs.DistributedGradientTape(tape, self.compression)

        @tf.function
        def step(x, y):
            with tf.GradientTape() as tape:
                loss = spec.loss(model(x, training=True), y)
            grads = distribute(tape).gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables, strict=True))
            return loss

        self._step = step
        self.warmup = args.warmup if method in ("horovod", "local") else args.sparse_warmup
        self.settle: dict | None = None   # what --settle did (warm_up)

    def step(self, x: Any, y: Any) -> float:
        """One training step, until its loss is on the host; seconds."""
        self.hvd_sparse.set_kernels(self.kernels)   # configurations may take turns step by step
        began = time.perf_counter()
        self._step(x, y).numpy()
        return time.perf_counter() - began

    def record(self, repeat: int, seconds: list[float], batches: list, stat_steps: int) -> dict:
        """This rank's record of a visit; statistics from ``stat_steps`` further untimed steps."""
        stats = visit_stats(self.step, self.compression, self.method, self.options, self.numel,
                            batches, stat_steps)
        return {"config": self.config, "repeat": repeat, "numel": self.numel, "seconds": seconds,
                "traces": self._step.experimental_get_tracing_count(), **stats,
                **({"settle": self.settle} if self.settle is not None else {})}


def warm_up(trainer: Trainer, args: argparse.Namespace, batches: list, hvd: Any) -> None:
    """The configuration's untimed steps, then ``--settle``'s (bench_e2e_worker.settle)."""
    for i in range(trainer.warmup):
        trainer.step(*batches[i % len(batches)])
    trainer.settle = settle(trainer.step, trainer.compression, batches, trainer.warmup, args,
                            hvd.size(), agree_on_rank0(hvd, trainer.config))


def barrier(hvd: Any, tf: Any) -> None:
    """Align the ranks (horovod.tensorflow 0.28 has no barrier: a one-element allreduce)."""
    hvd.allreduce(tf.zeros([1]), name="tf_e2e.barrier").numpy()


def timed_steps(trainer: Trainer, batches: list, count: int, first: int, hvd: Any, tf: Any) -> list[float]:
    """``count`` timed steps, each after a barrier (the ranks start aligned)."""
    seconds = []
    for i in range(count):
        barrier(hvd, tf)
        seconds.append(trainer.step(*batches[(first + i) % len(batches)]))
    return seconds


def run_blocks(args, configs, batches, hvd, tf, hvd_sparse) -> list[dict]:
    """Per repeat, each configuration in turn, built afresh, warmed up, then timed."""
    records = []
    for repeat in range(args.repeats):
        for config in block_order(configs, repeat):
            trainer = Trainer(config, args, hvd, tf, hvd_sparse)
            warm_up(trainer, args, batches, hvd)
            seconds = timed_steps(trainer, batches, args.steps, 0, hvd, tf)
            records.append(trainer.record(repeat, seconds, batches, args.stat_steps))
            if hvd.rank() == 0:
                print(f"[tf-e2e] repeat {repeat} {config}: "
                      f"{statistics.median(seconds) * 1e3:.0f} ms/step", flush=True)
    return records


def run_interleaved(args, configs, batches, hvd, tf, hvd_sparse) -> list[dict]:
    """Every configuration alive; one timed step of each per round (``--repeats`` rounds)."""
    trainers = {config: Trainer(config, args, hvd, tf, hvd_sparse) for config in configs}
    for trainer in trainers.values():
        warm_up(trainer, args, batches, hvd)
    timed: dict[str, list[tuple[int, float]]] = {config: [] for config in configs}
    for repeat in range(args.repeats):
        for config in block_order(configs, repeat):
            timed[config].append((repeat, timed_steps(trainers[config], batches, 1, repeat, hvd, tf)[0]))
        if hvd.rank() == 0 and repeat % 5 == 4:
            print(f"[tf-e2e] round {repeat + 1}/{args.repeats}", flush=True)
    records = []
    for config, trainer in trainers.items():
        stats = trainer.record(0, [], batches, args.stat_steps)
        records += [{**stats, "repeat": repeat, "seconds": [s]} for repeat, s in timed[config]]
    return records


def merge(per_rank: list[list[dict]]) -> list[dict]:
    """One record per visit: each timed step's slowest rank, the visit's step time their mean;
    statistics averaged over ranks."""
    merged = []
    for records in zip(*per_rank, strict=True):
        step_times = [max(s) for s in zip(*(r["seconds"] for r in records), strict=True)]
        out = {key: records[0][key] for key in ("config", "repeat", "numel")}
        out.update(step_seconds=statistics.fmean(step_times), step_times=step_times,
                   traces=max(r["traces"] for r in records))
        for key in STAT_KEYS:
            out[key] = statistics.fmean(r[key] for r in records)
        if "settle" in records[0]:
            out["settle"] = records[0]["settle"]
        merged.append(out)
    return merged


def tf_probe(hvd: Any, tf: Any, megabytes: float, size: int) -> dict:
    """bench_e2e_worker's bandwidth probe through Horovod's TensorFlow allreduce."""
    def allreduce(numel: int, label: str, i: int) -> None:
        dtype = tf.float32 if label == "fp32" else tf.float16
        hvd.allreduce(tf.ones([numel], dtype=dtype), name=f"tf_e2e.probe.{label}.{i}", op=hvd.Sum).numpy()

    return bandwidth_probe(allreduce, lambda: barrier(hvd, tf), megabytes, size)


def main() -> None:
    """Measure every configuration on this rank; rank 0 prints and writes the merged records."""
    args = build_parser().parse_args()
    os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
    import horovod.tensorflow as hvd
    import tensorflow as tf

    import hvd_sparse

    tf.config.threading.set_intra_op_parallelism_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    tf.config.threading.set_inter_op_parallelism_threads(1)
    hvd.init()
    from hvd_sparse import kernels
    tf_kernels = kernels.tensorflow_ops() is not None   # else every configuration runs the reference path
    if not tf_kernels and hvd.rank() == 0:
        print("[tf-e2e] WARNING: the TensorFlow op library is not usable here (see the warning above): "
              "every configuration runs the reference path", file=sys.stderr, flush=True)
    configs = args.configs.split(",")
    unknown = [c for c in configs if not known(c)]
    if unknown:
        raise SystemExit(f"unknown configurations {unknown}")
    probe = tf_probe(hvd, tf, args.probe_mb, hvd.size())
    spec = model_spec(args)
    generator = spec.generator(1000 + hvd.rank())
    batches = [spec.make_batch(args.batch, generator) for _ in range(4)]
    run = run_blocks if args.schedule == "blocks" else run_interleaved
    merged = merge(hvd.allgather_object(run(args, configs, batches, hvd, tf, hvd_sparse)))
    if hvd.rank() != 0:
        return
    for config in configs:
        step = statistics.median(s for r in merged if r["config"] == config for s in r["step_times"])
        print(f"[tf-e2e] {config:<22} {spec.items(args.batch) / step:9.1f} {spec.unit} per rank", flush=True)
    if args.out:
        job = {"framework": "tensorflow", "model": args.model, "numel": merged[0]["numel"],
               "input_shape": list(spec.input_shape), "unit": spec.unit,
               "items_per_sample": spec.items_per_sample, "batch_per_rank": args.batch,
               "size": hvd.size(), "density": args.density, "schedule": args.schedule,
               "repeats": args.repeats, "warmup": args.warmup, "sparse_warmup": args.sparse_warmup,
               "settle": args.settle, "steps": args.steps if args.schedule == "blocks" else 1,
               "stat_steps": args.stat_steps, "configs": configs, "probe": probe, "records": merged,
               "tf_kernels": tf_kernels,
               "rank_env": {k: os.environ.get(k) for k in ("HOROVOD_HOSTNAME", "HOROVOD_LOCAL_SIZE",
                                                           "HOROVOD_GLOO_IFACE", "OMP_NUM_THREADS")},
               "tensorflow": tf.__version__, "python": platform.python_version()}
        with open(args.out, "w") as f:
            json.dump(job, f, indent=1)


if __name__ == "__main__":
    main()
