"""Per-rank compression cost versus the memory-bound floor, measured side by side in one run.

For each vector size n and world size N, N simulated ranks (torch backend, one thread, the
engine exactly as in a real job) run a method's step on heavy-tailed per-rank gradients; the
time each rank spends in its own protocol (everything but the simulated collectives: error
feedback, selection, reconstruction, statistics bookkeeping) is compared with the floor measured
in the same process: ``torch.add(g, e, out=a)`` on n floats (read g, read e, write a). Reported
per configuration: median over repeats of the per-rank time, method / floor, method / top-k.

    python scripts/bench_select.py --sizes 1e6 25e6 --world-sizes 4 --methods exdyna topk \\
        --repeats 5 --out bench_select.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

import hvd_sparse
from hvd_sparse.backends import get_backend
from hvd_sparse.comm.local import LocalGroup
from hvd_sparse.engine import Engine

# At the target density: the tracking threshold settles within ~10 steps (paper mode would take
# hundreds, selecting far more meanwhile, which is a different cost).
DEFAULT_OPTIONS = {"topk": {"scope": "model"}, "exdyna": {"threshold": "tracking"},
                   "micro": {"threshold": "tracking"}}
WARMUP = 15


def floor_seconds(n: int, repeats: int) -> float:
    g, e, a = torch.randn(n), torch.randn(n), torch.empty(n)
    times = []
    for _ in range(repeats + 1):
        started = time.perf_counter()
        torch.add(g, e, out=a)
        times.append(time.perf_counter() - started)
    return statistics.median(times[1:])


def method_seconds(method: str, n: int, size: int, density: float, repeats: int, seed: int = 0) -> dict:
    backend = get_backend("torch")
    algorithm = hvd_sparse.create(method, density=density, **DEFAULT_OPTIONS.get(method, {}))
    engines = [Engine(algorithm, backend, rank, size, write_into_inputs=True) for rank in range(size)]
    group = LocalGroup(size, backend)
    generator = torch.Generator().manual_seed(seed)
    # Heavy tails and a few "layers" of different scale, like real gradients.
    scale = torch.exp(torch.randn(64, generator=generator)).repeat_interleave(-(-n // 64))[:n]
    grads = [torch.distributions.StudentT(3.0).sample((n,)) * scale * 1e-3 for _ in range(size)]
    per_step, densities = [], []
    for step in range(repeats + WARMUP):   # warm-up: allocations, threshold settling
        group.seconds = [0.0] * size
        inputs = [g.clone() for g in grads]   # the engine writes the average into its inputs
        group.run([engine.step("model", [inputs[r]]) for r, engine in enumerate(engines)])
        if step >= WARMUP:
            per_step.append(statistics.median(group.seconds))
            densities.append(engines[0].stats()["density_actual"])
    return {"seconds": statistics.median(per_step), "spread": [min(per_step), max(per_step)],
            "density": float(np.mean(densities))}


def memory_overhead(method: str, n: int, size: int, density: float) -> float:
    """Peak resident memory the engines add (residuals and temporaries), per rank, in fp32
    copies of the model; measured from the process's peak RSS, so run it first."""
    import resource

    backend = get_backend("torch")
    grads = [torch.randn(n) * 1e-3 for _ in range(size)]
    inputs = [g.clone() for g in grads]
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    algorithm = hvd_sparse.create(method, density=density, **DEFAULT_OPTIONS.get(method, {}))
    engines = [Engine(algorithm, backend, rank, size, write_into_inputs=True) for rank in range(size)]
    group = LocalGroup(size, backend)
    for _ in range(5):
        for g, x in zip(grads, inputs, strict=True):
            x.copy_(g)
        group.run([engine.step("model", [inputs[r]]) for r, engine in enumerate(engines)])
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return (peak - before) / size / (4 * n)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=float, nargs="+", default=[1e6, 25e6])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[4])
    parser.add_argument("--methods", nargs="+", default=["exdyna", "micro", "topk"])
    parser.add_argument("--density", type=float, default=0.001)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=None)
    parser.add_argument("--memory", action="store_true",
                        help="first measure ExDyna's per-rank memory overhead at the largest size")
    args = parser.parse_args()
    torch.set_num_threads(1)   # one core per rank, as on a real node

    memory = None
    if args.memory:
        n, size = int(max(args.sizes)), max(args.world_sizes)
        memory = memory_overhead("exdyna", n, size, args.density)
        print(f"exdyna memory overhead at n={n:,} N={size}: {memory:.2f} fp32 model copies per rank",
              flush=True)
    results = []
    for n in (int(s) for s in args.sizes):
        floor = floor_seconds(n, args.repeats * 4)
        for size in args.world_sizes:
            row = {"n": n, "world_size": size, "floor_seconds": floor, "methods": {}}
            for method in args.methods:
                row["methods"][method] = method_seconds(method, n, size, args.density, args.repeats)
            baseline = row["methods"].get("topk", {}).get("seconds")
            for method, m in row["methods"].items():
                m["over_floor"] = m["seconds"] / floor
                m["over_topk"] = m["seconds"] / baseline if baseline else None
                print(f"n={n:>11,} N={size:<4} {method:<8} {m['seconds'] * 1e3:9.2f} ms  "
                      f"x floor {m['over_floor']:6.2f}  x topk "
                      f"{m['over_topk'] if m['over_topk'] is None else round(m['over_topk'], 3)}  "
                      f"density {m['density']:.5f}", flush=True)
            print(f"n={n:>11,} N={size:<4} floor    {floor * 1e3:9.2f} ms  (torch.add(g, e, out=a))",
                  flush=True)
            results.append(row)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"density": args.density, "threads": 1, "memory_copies_per_rank": memory,
                       "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
