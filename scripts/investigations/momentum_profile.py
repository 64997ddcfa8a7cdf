"""Where the momentum path's step goes above its floor: ExDyna and MiCRO with ``momentum=0.9`` at
25M elements, N = 4, kernels on (issue 18's target, measured by ``bench_select.py --momentum``).

Every figure is a ratio to the momentum floor (``bench_select.MomentumFloor``: one pass that reads
u, g and e and writes u and e) timed just before it; medians over repeats. Two parts:

* ``kernel``: the fused op ``momentum_accumulate_select`` in pieces, on four ranks' vectors (cold
  caches, as in the benchmark), e and u reset before each piece: the finite check alone
  (``all_finite``, one read of the gradient), the pass without selection, with the clearing of
  the gradient, with the selection and the tracking probes, with both, and the whole op as the
  engine calls it (the check first).
* ``step``: the engine's step per rank (as bench_select times it) and, inside it, the fused op,
  with ``nonfinite="skip"`` (the default: the op reads the gradient for NaN/Inf before the pass)
  and ``nonfinite="ignore"`` (no check), side by side.

``--adam``: the step part on the Adam path instead (``bench_select --adam``'s configuration: the
gradient rolled every step, 30 warm-up steps), against the Adam floor (one pass reading g, u,
v, e, writing u, v, e); the fused op is then ``adam_accumulate_select``.

``--clock cpu`` (the default) times by the thread's CPU time, which other jobs on a shared
machine perturb less than the wall clock that bench_select uses (``--clock wall``).

    python scripts/investigations/momentum_profile.py --repeats 9
    python scripts/investigations/momentum_profile.py --adam --parts step --repeats 5
"""

from __future__ import annotations

import argparse
import functools
import random
import statistics
import sys
import time
import types
from pathlib import Path

import torch

import hvd_sparse
from hvd_sparse.backends import get_backend
from hvd_sparse.comm import local
from hvd_sparse.comm.local import LocalGroup
from hvd_sparse.engine import Engine

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # scripts/: the helpers it builds on
from bench_select import ADAM_WARMUP, ROLL, WARMUP, MomentumFloor, gradients, options_for

FACTOR = 0.9
CLOCKS = {"cpu": time.thread_time, "wall": time.perf_counter}


def kernel_parts(n: int, repeats: int, clock) -> dict[str, float]:
    """Median ratio of each piece of the fused op to the momentum floor timed just before it."""
    from hvd_sparse.kernels import cpu

    floor = MomentumFloor(n, "cpu", FACTOR)
    lo, hi = n // 4, n // 2                      # one rank's range of four
    ranks = []
    for g in gradients(n, 4, "cpu"):
        e0, u0 = g.roll(1000) * 3, g.roll(7) * 2    # a residual and a velocity of the gradient's scale
        acc = (e0 + (u0 * FACTOR + g))[lo:hi].abs()
        threshold = float(acc.kthvalue(int((hi - lo) * 0.999)).values)   # density 0.001 in the range
        ranks.append({"g": g, "x": g.clone(), "e0": e0, "u0": u0, "e": e0.clone(), "u": u0.clone(),
                      "t": threshold})

    def fused(d, select, probes, clear, check):
        a, b = (lo, hi) if select else (0, 0)
        p = [d["t"] / 1.5, d["t"] * 1.5] if probes else []
        return cpu.momentum_accumulate_select(d["e"], d["u"], [d["x"]], FACTOR, False, a, b, d["t"], p, 8,
                                              torch.int32, clear, check)

    pieces = {
        "finite check (all_finite)": lambda d: cpu.all_finite([d["x"]]),
        "pass": lambda d: fused(d, False, False, False, False),
        "pass + clear": lambda d: fused(d, False, False, True, False),
        "pass + selection + probes": lambda d: fused(d, True, True, False, False),
        "pass + selection + probes + clear": lambda d: fused(d, True, True, True, False),
        "whole op (check first)": lambda d: fused(d, True, True, True, True),
    }
    ratios: dict[str, list[float]] = {name: [] for name in pieces}
    for _ in range(repeats):
        order = list(pieces)
        random.shuffle(order)
        for name in order:
            for d in ranks:
                d["x"].copy_(d["g"])
                below = floor.seconds()
                d["e"].copy_(d["e0"])
                d["u"].copy_(d["u0"])
                started = clock()
                pieces[name](d)
                ratios[name].append((clock() - started) / below)
    return {name: statistics.median(r) for name, r in ratios.items()}


def step_parts(method: str, nonfinite: str, n: int, size: int, repeats: int,
               adam: bool = False) -> dict[str, float]:
    """Median ratios of a rank's step, and of the fused op inside it, to the momentum floor (the
    Adam floor with ``adam``)."""
    backend = get_backend("torch")
    spent = [0.0]
    op = backend.accumulate_select

    @functools.wraps(op)
    def timed(*args, **kwargs):
        started = local.time.perf_counter()
        try:
            return op(*args, **kwargs)
        finally:
            spent[0] += local.time.perf_counter() - started

    options = options_for(method, adam=True) if adam else options_for(method, FACTOR)
    algorithm = hvd_sparse.create(method, density=0.001, **options)
    engines = [Engine(algorithm, backend, rank, size, write_into_inputs=True, nonfinite=nonfinite)
               for rank in range(size)]
    group = LocalGroup(size, backend)
    grads = gradients(n, size, "cpu")
    inputs = [g.clone() for g in grads]
    floor = MomentumFloor(n, "cpu", FACTOR, adam=adam)
    warmup = ADAM_WARMUP if adam else WARMUP
    steps, ops = [], []
    backend.accumulate_select = timed
    try:
        for step in range(repeats + warmup):
            below = floor.seconds()
            for g, x in zip(grads, inputs, strict=True):
                x.copy_(torch.roll(g, step * ROLL) if adam else g)
            group.seconds, spent[0] = [0.0] * size, 0.0
            group.run([engine.step("model", [inputs[r]]) for r, engine in enumerate(engines)])
            if step >= warmup:
                steps.append(statistics.median(group.seconds) / below)
                ops.append(spent[0] / size / below)
    finally:
        del backend.accumulate_select
    return {"step": statistics.median(steps), "fused op": statistics.median(ops)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=float, default=25e6, help="elements (default 25e6)")
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--methods", nargs="+", default=["exdyna", "micro"])
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="cpu")
    parser.add_argument("--adam", action="store_true", help="the step part on the Adam path")
    parser.add_argument("--parts", nargs="+", choices=["kernel", "step"], default=["kernel", "step"])
    args = parser.parse_args()
    torch.set_num_threads(1)
    hvd_sparse.set_kernels("auto")
    clock = CLOCKS[args.clock]
    # LocalGroup's per-rank seconds and the floor read this clock (bench_select's own module too).
    shim = types.SimpleNamespace(perf_counter=clock)
    import bench_select
    local.time = bench_select.time = shim
    n = int(args.size)
    path = "the Adam path" if args.adam else f"momentum={FACTOR}"
    print(f"n = {n:,}, N = {args.world_size}, {path}, kernels on, clock {args.clock}; "
          f"ratios to the {'Adam' if args.adam else 'momentum'} floor, medians of {args.repeats}", flush=True)
    if "kernel" in args.parts and not args.adam:
        for name, ratio in kernel_parts(n, args.repeats, clock).items():
            print(f"kernel  {name:36s} {ratio:6.3f}", flush=True)
    if "step" in args.parts:
        for method in args.methods:
            for nonfinite in ("skip", "ignore"):
                parts = step_parts(method, nonfinite, n, args.world_size, args.repeats, args.adam)
                print(f"step    {method:7s} nonfinite={nonfinite:7s} step {parts['step']:6.3f}  "
                      f"fused op {parts['fused op']:6.3f}  rest {parts['step'] - parts['fused op']:6.3f}",
                      flush=True)


if __name__ == "__main__":
    main()
