"""How far the N-rank simulator goes on this machine: seconds per step and peak memory for each
model at N = 64, 256, 1024.

Each configuration runs ``python -m hvd_sparse.sim`` in a fresh process (torch on one thread) for
a few steps; its peak resident memory is read from the kernel (``wait4``) and its seconds per step
from the records (the median after the first step, which also builds every rank's buffers). Top-k
(gather pattern) is the memory-heavy case: every simulated rank receives its own copy of
everything gathered, about 8·N²·k bytes for a per-rank count k; ExDyna (union pattern, disjoint
selections) gathers only indices. Configurations whose predicted gathered copies exceed
``--max-gather-gib`` are listed as not run.

    OMP_NUM_THREADS=1 python scripts/sim_scale.py            # full: N = 64, 256, 1024 (~30 min)
    OMP_NUM_THREADS=1 python scripts/sim_scale.py --quick    # N = 16, 64 (a minute or two)

Writes bench/sim_scale.{json,md} (bench/quick/ with --quick).
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
import torch
from results import machine_info, output_dir

from hvd_sparse.sim.tasks import TASKS

ROOT = Path(__file__).resolve().parents[1]

MODELS = ("digits", "digits-mlp", "lstm")
# (method, density, options)
CONFIGS = (("topk", 0.001, []), ("exdyna", 0.001, ["num_blocks=auto"]), ("topk", 0.01, []))
FULL = {"sizes": [64, 256, 1024], "steps": 3}
QUICK = {"sizes": [16, 64], "steps": 2}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out-dir", type=Path, default=None, help="default: bench, or bench/quick")
    parser.add_argument("--max-gather-gib", type=float, default=6.0,
                        help="skip configurations whose gathered copies would exceed this")
    return parser.parse_args()


def run_isolated(argv: list[str], out: Path) -> tuple[dict, float, int]:
    """Run the simulator's command line in a fresh process: (its JSON, wall seconds, peak RSS
    in bytes, as the kernel measured it for that process alone)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    started = time.perf_counter()
    with tempfile.TemporaryFile() as errors:
        process = subprocess.Popen([sys.executable, "-m", "hvd_sparse.sim", *argv, "--out", str(out),
                                    "--log-every", "0"], cwd=ROOT, env=env,
                                   stdout=subprocess.DEVNULL, stderr=errors)
        _, status, usage = os.wait4(process.pid, 0)
        process.returncode = os.waitstatus_to_exitcode(status)
        if process.returncode != 0:
            errors.seek(0)
            raise RuntimeError(f"simulator failed ({process.returncode}): "
                               f"{errors.read().decode(errors='replace')[-2000:]}")
    return json.loads(out.read_text()), time.perf_counter() - started, usage.ru_maxrss * 1024


def per_rank_k(tensor_sizes: list[int], density: float) -> int:
    """Top-k's per-rank count (tensor scope: at least one per tensor)."""
    return sum(max(1, int(density * numel)) for numel in tensor_sizes)


def main() -> None:
    args = parse_args()
    spec = QUICK if args.quick else FULL
    out_dir = output_dir(args.out_dir, args.quick)
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for model in MODELS:
            tensor_sizes = [p.numel() for p in TASKS[model]().model.parameters()]
            numel = sum(tensor_sizes)
            for size in spec["sizes"]:
                for method, density, options in CONFIGS:
                    row = {"model": model, "parameters": numel, "world_size": size, "method": method,
                           "density": density, "options": options}
                    if method == "topk":
                        gathered = 8.0 * size * size * per_rank_k(tensor_sizes, density)
                        row["predicted_gather_gib"] = gathered / 2**30
                        if gathered / 2**30 > args.max_gather_gib:
                            row["skipped"] = f"predicted {gathered / 2**30:.1f} GiB of gathered copies"
                            rows.append(row)
                            print(f"{model} N={size} {method} ρ={density}: {row['skipped']}", flush=True)
                            continue
                    argv = ["--method", method, "--world-size", str(size), "--density", str(density),
                            "--model", model, "--steps", str(spec["steps"])]
                    for option in options:
                        argv += ["--option", option]
                    result, wall, peak = run_isolated(argv, Path(scratch) / "run.json")
                    seconds = [r["seconds"] for r in result["records"]]
                    row.update(seconds_per_step=float(np.median(seconds[1:] or seconds)),
                               first_step_seconds=seconds[0], wall_seconds=wall, peak_rss_gib=peak / 2**30)
                    rows.append(row)
                    print(f"{model} N={size} {method} ρ={density}: {row['seconds_per_step']:.2f} s/step, "
                          f"peak {row['peak_rss_gib']:.2f} GiB", flush=True)
    machine = machine_info()
    report = {"config": {"quick": args.quick, **spec, "cpus": machine["cpus"],
                         "memory_gib": machine.get("memory_gb"), "torch": torch.__version__, "threads": 1},
              "rows": rows}
    (out_dir / "sim_scale.json").write_text(json.dumps(report, indent=1))
    lines = [f"### Simulator scale ({'quick' if args.quick else 'full'} run: {spec['steps']} steps per "
             f"configuration, {report['config']['cpus']} CPUs, {report['config']['memory_gib']:.0f} GiB, "
             "torch on one thread, the machine shared)", "",
             "| model | parameters | N | method | ρ | s/step | peak memory |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        measured = (f"{r['seconds_per_step']:.2f} | {r['peak_rss_gib']:.2f} GiB" if "skipped" not in r
                    else f"not run | {r['skipped']}")
        lines.append(f"| {r['model']} | {r['parameters']} | {r['world_size']} | {r['method']} | "
                     f"{r['density']:g} | {measured} |")
    lines.append("")
    (out_dir / "sim_scale.md").write_text("\n".join(lines))
    print(f"wrote {out_dir / 'sim_scale.json'}, {out_dir / 'sim_scale.md'}")


if __name__ == "__main__":
    main()
