"""Exact top-k by magnitude: the kernel of the device against ``torch.topk`` and the reference op.

For each size n (fp32, heavy-tailed, k = density * n), in one process, side by side:
- ``kernel``: the op module's ``topk_abs`` (hvd_sparse.kernels: Triton on a GPU, C++ on a CPU),
  ascending indices with the lowest-index tie rule;
- ``torch.topk``: ``torch.topk(x.abs(), k, sorted=False)``, the unordered indices most code uses
  (no tie rule, NaN handling of its own): the speed a kernel has to match;
- ``reference``: the torch backend's ``topk_abs_indices`` with the kernels off.
Each figure is the median of ``--repeats`` timed calls after one warm-up call (which, on a GPU,
also compiles the kernels); the kernel's index set is checked against the reference's.

    python scripts/bench_topk.py --device cuda --sizes 25e6 1e8
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from hvd_sparse import kernels
from hvd_sparse.backends.torch_backend import TorchBackend


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def median_seconds(run, repeats: int, device: str) -> float:
    run()   # warm-up (and compilation)
    times = []
    for _ in range(repeats):
        sync(device)
        started = time.perf_counter()
        run()
        sync(device)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def measure(n: int, density: float, repeats: int, device: str) -> str:
    """One size: the three timings and whether the kernel's set is the reference's."""
    x = (torch.distributions.StudentT(3.0).sample((n,)) * 1e-3).to(device)
    k = max(1, int(density * n))
    reference = TorchBackend()
    kernels.set_mode("auto")
    ops = kernels.ops_for(x)
    if ops is None or not hasattr(ops, "topk_abs"):
        raise SystemExit(f"no top-k kernel for {device} tensors (see the warning above)")
    kernel = median_seconds(lambda: ops.topk_abs(x, k, torch.int64), repeats, device)
    baseline = median_seconds(lambda: torch.topk(x.abs(), k, sorted=False), repeats, device)
    kernels.set_mode("off")
    try:
        ref = median_seconds(lambda: reference.topk_abs_indices(x, k), repeats, device)
        same = torch.equal(ops.topk_abs(x, k, torch.int64), reference.topk_abs_indices(x, k))
    finally:
        kernels.set_mode("auto")
    return (f"n={n:>12,} k={k:>9,} {device}  kernel {kernel * 1e3:8.3f} ms  "
            f"torch.topk {baseline * 1e3:8.3f} ms  reference {ref * 1e3:8.3f} ms  "
            f"kernel/torch.topk {kernel / baseline:5.2f}  same set as reference: {same}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--sizes", type=float, nargs="+", default=[1e6, 25e6])
    parser.add_argument("--density", type=float, default=0.001)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    for n in args.sizes:
        print(measure(int(n), args.density, args.repeats, args.device), flush=True)


if __name__ == "__main__":
    main()
