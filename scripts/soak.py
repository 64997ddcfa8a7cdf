"""Soak: a long real Horovod job, checked for what only shows after thousands of steps.

    OMP_NUM_THREADS=1 python scripts/soak.py [--steps 3000] [--methods exdyna-tracking deft]

Starts ``horovodrun --gloo -np 2`` on this machine; each rank trains the digits CNN
(hvd_sparse/sim/tasks.py, its own minibatches) through stock ``hvd.DistributedOptimizer`` with each
method in turn, for ``--steps`` steps, recording every step the achieved density and every 10 the
residual norm and the process's resident memory (RSS). Then it judges, per method:

* weights identical on every rank at the end (bitwise);
* residual norm bounded: its maximum over the last third of the run at most 2x its maximum over
  the middle third (error feedback that leaks would grow it);
* density within 5% of the target after warm-up (``--warmup`` steps): every window of 100 steps
  has a mean achieved density in [0.95, 1.05] x target;
* no memory growth after warm-up: the least-squares slope of RSS against the step, on every rank,
  below 1 MB per 1000 steps.

Writes ``soak.json`` and ``soak.md`` (and ``soak.png`` where matplotlib is installed) into
``--out`` (default ``bench/``) and exits non-zero when a target is missed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]

METHODS = {"exdyna-tracking": ("exdyna", {"threshold_scaling": "tracking"}), "deft": ("deft", {}),
           "exdyna": ("exdyna", {}), "topk": ("topk", {})}
WINDOW = 100                 # steps per density window
DENSITY_TOLERANCE = 0.05
RSS_SLOPE_LIMIT_MB = 1.0     # per 1000 steps
RESIDUAL_GROWTH_LIMIT = 2.0
SAMPLE_EVERY = 10


def rss_mb() -> float:
    """This process's resident set size, MB (Linux)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024.0
    return float("nan")


# --- one rank ------------------------------------------------------------------------------------
def worker(args: argparse.Namespace) -> None:
    import horovod.torch as hvd
    import torch

    import hvd_sparse
    from hvd_sparse.sim.tasks import digits_task

    hvd.init()
    torch.set_num_threads(1)
    rank = hvd.rank()
    runs = {}
    for label in args.methods:
        method, options = METHODS[label]
        task = digits_task(batch_size=args.batch_size, seed=0)
        model = task.model
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        named = list(model.named_parameters())
        compression = hvd_sparse.create(method, framework="torch", density=args.density,
                                        named_parameters=named, prefix=f"soak.{label}", **options)
        optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9),
                                             named_parameters=named, compression=compression)
        density, samples, losses = [], [], []
        started = time.perf_counter()
        for step in range(args.steps):
            optimizer.zero_grad()
            loss = task.loss(model, task.batch(rank, step))
            loss.backward()
            optimizer.step()
            stats = compression.stats()
            density.append(stats["density_actual"])
            if step % SAMPLE_EVERY == 0 or step == args.steps - 1:
                samples.append((step, stats["residual_norm"], rss_mb()))
                losses.append((step, loss.item()))
        seconds = time.perf_counter() - started
        weights = b"".join(p.detach().numpy().tobytes() for p in model.parameters())
        runs[label] = {"density": density, "samples": samples, "loss": losses, "seconds": seconds,
                       "weights": weights.hex() if rank == 0 else None,
                       "weights_digest": hash_bytes(weights), "accuracy": task.evaluate(model)["accuracy"]}
        if rank == 0:
            print(f"{label}: {args.steps} steps in {seconds:.0f} s", flush=True)
    everyone = hvd.allgather_object(runs, name="soak.records")
    if rank == 0:
        Path(args.records).write_text(json.dumps(everyone))


def hash_bytes(data: bytes) -> str:
    import hashlib

    return hashlib.sha256(data).hexdigest()


# --- judging -------------------------------------------------------------------------------------
def judge(label: str, ranks: list[dict], density_target: float, warmup: int) -> dict:
    """The figures and verdicts of one method (see the module docstring)."""
    steps = len(ranks[0]["density"])
    digests = {r["weights_digest"] for r in ranks}
    density = np.asarray(ranks[0]["density"], dtype=np.float64)
    windows = [float(density[lo:lo + WINDOW].mean()) / density_target
               for lo in range(warmup, steps - WINDOW + 1, WINDOW)]
    samples = [np.asarray(r["samples"], dtype=np.float64) for r in ranks]
    third = steps // 3
    residual = {}
    slopes = []
    for rank, s in enumerate(samples):
        step, norm, rss = s[:, 0], s[:, 1], s[:, 2]
        middle, last = norm[(step >= third) & (step < 2 * third)], norm[step >= 2 * third]
        residual[rank] = {"max_middle": float(middle.max()), "max_last": float(last.max()),
                          "growth": float(last.max() / middle.max()) if middle.max() > 0 else float("inf")}
        after = step >= warmup
        slope = np.polyfit(step[after], rss[after], 1)[0] * 1000.0
        slopes.append({"rank": rank, "slope_mb_per_1000": float(slope), "rss_start_mb": float(rss[after][0]),
                       "rss_end_mb": float(rss[-1]), "rss_max_mb": float(rss.max())})
    out = {
        "steps": steps, "seconds": max(r["seconds"] for r in ranks),
        "accuracy": [r["accuracy"] for r in ranks],
        "final_loss_rank0": ranks[0]["loss"][-1][1],
        "identical_weights": len(digests) == 1,
        "density_mean_after_warmup": float(density[warmup:].mean()) / density_target,
        "density_windows_min": min(windows), "density_windows_max": max(windows),
        "density_windows_outside": sum(1 for w in windows if abs(w - 1.0) > DENSITY_TOLERANCE),
        "density_windows": len(windows),
        "residual": residual, "rss": slopes,
    }
    out["targets"] = {
        "identical weights": out["identical_weights"],
        "residual norm bounded (last third max <= 2x middle third max)":
            all(v["growth"] <= RESIDUAL_GROWTH_LIMIT for v in residual.values()),
        f"density within {DENSITY_TOLERANCE:.0%} of target in every {WINDOW}-step window after warm-up":
            out["density_windows_outside"] == 0,
        f"RSS slope < {RSS_SLOPE_LIMIT_MB} MB / 1000 steps after warm-up":
            all(s["slope_mb_per_1000"] < RSS_SLOPE_LIMIT_MB for s in slopes),
    }
    return out


def markdown(report: dict) -> str:
    lines = ["# Soak", "",
             f"`{report['command']}` on {report['machine'].get('cpus')} CPUs "
             f"({report['machine'].get('cpu_model')}), {report['size']} ranks (Gloo, localhost), "
             f"digits CNN, density {report['density']}, {report['steps']} steps per method, "
             f"warm-up {report['warmup']} steps.", "",
             "| method | s | identical weights | density / target after warm-up (mean; 100-step "
             "windows min-max, outside 5%) | residual norm max, middle third -> last third (rank 0) "
             "| RSS slope MB/1000 steps (per rank) | RSS after warm-up -> end MB (rank 0) "
             "| test accuracy |",
             "|---|---|---|---|---|---|---|---|"]
    for label, r in report["methods"].items():
        res = r["residual"]["0"] if "0" in r["residual"] else r["residual"][0]
        rss0 = r["rss"][0]
        slopes = ", ".join(f"{s['slope_mb_per_1000']:+.3f}" for s in r["rss"])
        lines.append(
            f"| {label} | {r['seconds']:.0f} | {r['identical_weights']} | "
            f"{r['density_mean_after_warmup']:.3f}; "
            f"{r['density_windows_min']:.3f}-{r['density_windows_max']:.3f}, "
            f"{r['density_windows_outside']}/{r['density_windows']} | "
            f"{res['max_middle']:.4g} -> {res['max_last']:.4g} | "
            f"{slopes} | "
            f"{rss0['rss_start_mb']:.1f} -> {rss0['rss_end_mb']:.1f} | {r['accuracy'][0]:.3f} |")
    lines += ["", "## Targets", ""]
    for label, r in report["methods"].items():
        for target, met in r["targets"].items():
            lines.append(f"- {label}: {target}: **{'met' if met else 'MISSED'}**")
    return "\n".join(lines) + "\n"


def plot(records: list[dict], methods: list[str], density: float, out: Path) -> str | None:
    from results import pyplot, save

    plt = pyplot()
    if plt is None:
        return None
    figure, axes = plt.subplots(len(methods), 3, figsize=(13, 3.2 * len(methods)), squeeze=False)
    for row, label in enumerate(methods):
        d = np.asarray(records[0][label]["density"]) / density
        smooth = np.convolve(d, np.ones(WINDOW) / WINDOW, mode="valid")
        axes[row][0].plot(smooth)
        axes[row][0].axhspan(1 - DENSITY_TOLERANCE, 1 + DENSITY_TOLERANCE, color="green", alpha=0.15)
        axes[row][0].set(title=f"{label}: density / target ({WINDOW}-step mean)", xlabel="step")
        for rank, rec in enumerate(records):
            s = np.asarray(rec[label]["samples"])
            axes[row][1].plot(s[:, 0], s[:, 1], label=f"rank {rank}")
            axes[row][2].plot(s[:, 0], s[:, 2], label=f"rank {rank}")
        axes[row][1].set(title=f"{label}: residual norm", xlabel="step")
        axes[row][2].set(title=f"{label}: RSS (MB)", xlabel="step")
        axes[row][2].legend()
    return save(figure, out / "soak.png")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--warmup", type=int, default=500)
    parser.add_argument("--methods", nargs="+", default=["exdyna-tracking", "deft"], choices=sorted(METHODS))
    parser.add_argument("--density", type=float, default=0.01)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.02)
    parser.add_argument("--size", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--records", help=argparse.SUPPRESS)
    parser.add_argument("--timeout", type=float, default=7200)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return

    from results import machine_info, output_dir

    out = output_dir(args.out, quick=False)
    command = "python scripts/soak.py " + " ".join(sys.argv[1:])
    with tempfile.TemporaryDirectory() as tmp:
        records_path = Path(tmp) / "records.json"
        cmd = [str(Path(sys.executable).parent / "horovodrun"), "--gloo", "-np", str(args.size),
               "-H", f"localhost:{args.size}", sys.executable, str(Path(__file__).resolve()), "--worker",
               "--records", str(records_path), "--steps", str(args.steps), "--methods", *args.methods,
               "--density", str(args.density), "--batch-size", str(args.batch_size), "--lr", str(args.lr)]
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
                   PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
        started = time.time()
        subprocess.run(cmd, env=env, cwd=REPO, check=True, timeout=args.timeout)
        records = json.loads(records_path.read_text())
    report = {"command": command, "machine": machine_info(), "size": args.size, "steps": args.steps,
              "warmup": args.warmup, "density": args.density, "wall_seconds": time.time() - started,
              "methods": {label: judge(label, [rec[label] for rec in records], args.density, args.warmup)
                          for label in args.methods}}
    report["figure"] = plot(records, args.methods, args.density, out)
    (out / "soak.json").write_text(json.dumps(report, indent=1))
    (out / "soak.md").write_text(markdown(report))
    print(markdown(report))
    missed = [(label, t) for label, r in report["methods"].items()
              for t, ok in r["targets"].items() if not ok]
    sys.exit(1 if missed else 0)


if __name__ == "__main__":
    main()
