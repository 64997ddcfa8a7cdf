"""What packing TensorFlow's per-tensor steps saves: the exchange alone, side by side.

TopK and DGC per tensor (``scope="tensor"``) run in TensorFlow as one bucket per dtype that
selects in each tensor (docs/architecture.md#tensorflow-face). This script times, in one 2-rank
``horovodrun --gloo`` job on loopback, a training step with no model computation -- the
gradients of ``sum(v * c)`` over variables shaped like ResNet-18's 62 (11.7M entries), through
``hvd_sparse.tensorflow.DistributedGradientTape`` -- so that the step is the exchange: dense
(Horovod's allreduce, one group), each method packed, and each method with a bucket per tensor
(the path before packing, kept reachable by setting the algorithm's ``packs_tensors`` to False on
the instance). Configurations interleave, one step each per round in rotated order, each step
starting with the ranks aligned by an untimed allreduce; figures are medians over rounds and the
quartiles, and each step's ratio to the dense step of its round.

    python scripts/investigations/tf_packing.py --rounds 30 --out-dir bench     # about 3 minutes
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # scripts/: the helpers it builds on
from results import machine_info, output_dir

CONFIGS = ("dense", "topk:packed", "topk:alone", "dgc:packed", "dgc:alone")
DENSITY = 0.001


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--out-dir", type=Path, default=None)
    parser.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)
    return parser.parse_args()


def launch(args: argparse.Namespace) -> None:
    """Run the 2-rank job (this script as its worker), then write the JSON and Markdown."""
    folder = output_dir(args.out_dir, quick=False)
    raw = folder / "tf-packing.raw.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TF_CPP_MIN_LOG_LEVEL": "3", "TF_USE_LEGACY_KERAS": "1"}
    horovodrun = Path(sys.executable).with_name("horovodrun")
    command = [str(horovodrun), "--gloo", "-np", "2", "-H", "localhost:2", sys.executable, __file__,
               "--rounds", str(args.rounds), "--worker", str(raw)]
    started = time.time()
    subprocess.run(command, env=env, check=True, timeout=1800)
    times = json.loads(raw.read_text())
    raw.unlink()
    result = summarize(times, args, time.time() - started)
    (folder / "tf-packing.json").write_text(json.dumps(result, indent=1))
    (folder / "tf-packing.md").write_text(markdown(result))
    print(markdown(result))


def summarize(times: dict[str, list[float]], args: argparse.Namespace, seconds: float) -> dict:
    """Medians, quartiles and ratios to dense's step of the same round (ms)."""
    dense = np.asarray(times["dense"])
    rows = {}
    for config, values in times.items():
        steps, ratios = np.asarray(values) * 1e3, np.asarray(values) / dense
        rows[config] = {"step_ms": [float(np.percentile(steps, q)) for q in (50, 25, 75)],
                        "ratio": [float(np.percentile(ratios, q)) for q in (50, 25, 75)]}
    command = f"python scripts/investigations/tf_packing.py --rounds {args.rounds}"
    return {"command": command, "machine": machine_info(), "seconds": seconds, "rounds": args.rounds,
            "density": DENSITY, "configs": rows}


def markdown(result: dict) -> str:
    lines = [f"Command: `{result['command']}` ({result['rounds']} rounds, {result['seconds']:.0f} s; "
             f"density {result['density']}; 2 ranks, loopback, no model computation: ResNet-18's 62 "
             "gradient shapes, 11.7M entries).", "",
             "| config | step ms | ratio to dense |", "|---|---|---|"]
    for config, row in result["configs"].items():
        (step, s25, s75), (ratio, r25, r75) = row["step_ms"], row["ratio"]
        lines.append(f"| {config} | {step:.1f} [{s25:.1f}–{s75:.1f}] | {ratio:.2f} [{r25:.2f}–{r75:.2f}] |")
    step_of_config = {config: row["step_ms"][0] for config, row in result["configs"].items()}
    packed = {m: step_of_config[f"{m}:alone"] / step_of_config[f"{m}:packed"] for m in ("topk", "dgc")}
    lines += ["", "`packed`: the gradients in one bucket selecting per tensor (what runs now); `alone`: a "
              "bucket per tensor, as before. A bucket per tensor took "
              + " and ".join(f"{ratio:.2f}x the packed step for {m}" for m, ratio in packed.items())
              + " (medians).", ""]
    return "\n".join(lines)


def worker(args: argparse.Namespace) -> None:
    """One rank of the job: every configuration's steps, interleaved; rank 0 writes the times."""
    import horovod.tensorflow as hvd
    import tensorflow as tf
    from models.e2e_models_tf import build_model

    import hvd_sparse.tensorflow as hs

    hvd.init()
    shapes = [tuple(v.shape) for v in build_model("resnet18", (64, 64, 3), 0).trainable_variables]
    variables = [tf.Variable(tf.zeros(shape)) for shape in shapes]
    rng = np.random.default_rng(hvd.rank())
    coefficients = [tf.constant(rng.standard_normal(shape).astype(np.float32)) for shape in shapes]
    steps = {config: step_of(config, variables, hvd, hs, tf) for config in CONFIGS}
    for config in CONFIGS:   # traced, and thresholds past their first steps
        for _ in range(5):
            steps[config](coefficients).numpy()
    times: dict[str, list[float]] = {config: [] for config in CONFIGS}
    for round_ in range(args.rounds):
        shift = round_ % len(CONFIGS)
        for config in CONFIGS[shift:] + CONFIGS[:shift]:
            hvd.allreduce(tf.zeros(1), name=f"align.{round_}.{config}").numpy()
            started = time.perf_counter()
            steps[config](coefficients).numpy()
            times[config].append(time.perf_counter() - started)
    if hvd.rank() == 0:
        args.worker.write_text(json.dumps(times))


def step_of(config: str, variables: list, hvd, hs, tf):
    """The step function of a configuration: the gradients' exchange and a read of each result."""
    compression = None
    if config != "dense":
        method, packing = config.split(":")
        make = hs.TopK if method == "topk" else hs.DGC
        compression = make(DENSITY, prefix=f"hs.{method}_{packing}")
        if packing == "alone":
            compression.algorithm.packs_tensors = False   # a bucket per tensor, as before packing

    @tf.function
    def step(coefficients):
        with tf.GradientTape() as tape:
            loss = tf.add_n([tf.reduce_sum(v * c) for v, c in zip(variables, coefficients, strict=True)])
        if compression is None:
            grads = hvd.DistributedGradientTape(tape, groups=1).gradient(loss, variables)
        else:
            grads = hs.DistributedGradientTape(tape, compression=compression).gradient(loss, variables)
        return tf.add_n([tf.reduce_sum(tf.reshape(g, [-1])[:1]) for g in grads])
    return step


if __name__ == "__main__":
    arguments = parse_args()
    worker(arguments) if arguments.worker else launch(arguments)
