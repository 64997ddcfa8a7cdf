"""Describe a job, get each method's projected step (docs/planning.md).

    python -m hvd_sparse.plan --params 25e6 --world-sizes 8 64 256 --bandwidth 25gbit \\
        --compute-ms 100
    python -m hvd_sparse.plan --layers 2359296 2359296 1000 ... --density 0.001 --overhead-us 50

The model: ``--layers`` (tensor sizes in model order), or ``--params`` split into
``--tensors`` equal tensors; one rank's ``--compute-ms`` per step (a third forward, two thirds
backward, spread over the tensors by size); selection at ``--select-ns`` per element accumulated
and per element scanned; the network's bandwidth, latency and fixed cost per collective.
``--second-moment-refresh K``: the methods on the Adam path with a shared second moment, whose
dense allreduce every K steps counts in the mean step. Every figure is a projection of the cost
model, not a measurement.
"""

from __future__ import annotations

import argparse
from typing import Any

from ..algorithms import METHODS, AdamPath
from .network import Network, parse_rate
from .step import ComputeProfile, SelectionCost, step_time
from .traffic import bytes_per_rank, dense_traffic, steady_traffic

DEFAULT_METHODS = ("exdyna", "micro", "deft", "lags", "topk", "dgc")
# Options that make a method what users run: ExDyna with its density-holding threshold.
OPTIONS: dict[str, dict[str, Any]] = {"exdyna": {"threshold_scaling": "tracking"}}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The job's description (module docstring)."""
    parser = argparse.ArgumentParser(prog="python -m hvd_sparse.plan", description=__doc__.split("\n\n")[0])
    model = parser.add_mutually_exclusive_group(required=True)
    model.add_argument("--layers", type=float, nargs="+", help="tensor sizes, in model order")
    model.add_argument("--params", type=float, help="parameter count (with --tensors)")
    parser.add_argument("--tensors", type=int, default=50, help="equal tensors --params is split into")
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[8, 64, 256])
    parser.add_argument("--bandwidth", default="10gbit", help="per rank and direction: 25gbit, 100mbit")
    parser.add_argument("--latency-us", type=float, default=20.0)
    parser.add_argument("--overhead-us", type=float, default=50.0, help="fixed cost per collective")
    parser.add_argument("--allreduce", choices=("ring", "tree"), default="ring")
    parser.add_argument("--compute-ms", type=float, required=True,
                        help="one rank's step without communication")
    parser.add_argument("--select-ns", type=float, default=0.01,
                        help="selection per element accumulated and per element scanned (a GPU at "
                             "2 TB/s: about 0.006; this project's CPU kernels: about 1)")
    parser.add_argument("--density", type=float, default=0.001)
    parser.add_argument("--methods", nargs="+", choices=[cls.name for cls in METHODS],
                        default=list(DEFAULT_METHODS))
    parser.add_argument("--second-moment-refresh", type=int, default=0, metavar="K",
                        help="the Adam path with v shared by the ranks, refreshed every K steps "
                             "(docs/methods.md#adam-and-adamw); 0: each rank's own v, no extra traffic")
    args = parser.parse_args(argv)
    if args.second_moment_refresh < 0:
        parser.error(f"--second-moment-refresh must be 0 or a positive number of steps, got "
                     f"{args.second_moment_refresh}")
    return args


def options_of(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """The options ``name`` runs with: its usual ones, on the Adam path with ``--second-moment-refresh``."""
    options = dict(OPTIONS.get(name, {}))
    if args.second_moment_refresh:
        options.update(adam=AdamPath(), second_moment_refresh=args.second_moment_refresh)
    return options


def sizes_of(args: argparse.Namespace) -> list[int]:
    """The tensor sizes the arguments describe."""
    if args.layers:
        return [int(s) for s in args.layers]
    share = int(args.params) // args.tensors
    return [share] * (args.tensors - 1) + [int(args.params) - share * (args.tensors - 1)]


def rows(args: argparse.Namespace, world: int) -> list[tuple[str, Any, float]]:
    """(configuration, StepTime, bytes a rank sends) at ``world`` ranks, dense and fp16 first."""
    sizes = sizes_of(args)
    network = Network(parse_rate(args.bandwidth), args.latency_us * 1e-6, args.overhead_us * 1e-6,
                      args.allreduce)
    compute = args.compute_ms * 1e-3
    profile = ComputeProfile.proportional(sizes, compute / 3, 2 * compute / 3)
    out = []
    for name, itemsize in (("dense", 4), ("fp16", 2)):
        traffic = dense_traffic(sizes, world, itemsize)
        out.append((name, step_time(profile, traffic, network), bytes_per_rank(traffic)))
    selection = SelectionCost(args.select_ns * 1e-9, args.select_ns * 1e-9)
    for name in args.methods:
        algorithm = next(cls for cls in METHODS if cls.name == name)(args.density, **options_of(name, args))
        traffic = steady_traffic(algorithm, sizes, world)
        out.append((name, step_time(profile, traffic, network, selection), bytes_per_rank(traffic)))
    return out


def main(argv: list[str] | None = None) -> None:
    """Print one table per world size."""
    args = parse_args(argv)
    print(f"Projection (hvd_sparse.plan's cost model, not a measurement): {sum(sizes_of(args)):,} "
          f"parameters, {args.bandwidth}, latency {args.latency_us:g} us, {args.overhead_us:g} us per "
          f"collective, {args.allreduce} allreduce, computation {args.compute_ms:g} ms, "
          f"ρ = {args.density:g}, steady state"
          + (f"; the Adam path's v shared, refreshed every {args.second_moment_refresh} steps (mean step)"
             if args.second_moment_refresh else ""))
    for world in args.world_sizes:
        table = rows(args, world)
        dense = table[0][1].total
        print(f"\nN = {world}\n{'method':10s} {'step ms':>9s} {'vs dense':>9s} {'exposed comm ms':>16s} "
              f"{'MB sent/rank':>13s}")
        for name, step, sent in table:
            print(f"{name:10s} {step.total * 1e3:9.2f} {dense / step.total:8.2f}x "
                  f"{step.exposed * 1e3:16.2f} {sent / 1e6:13.3f}")


if __name__ == "__main__":
    main()
