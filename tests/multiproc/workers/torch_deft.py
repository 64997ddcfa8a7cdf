"""Worker: stock horovod.torch DistributedOptimizer with hvd_sparse DEFT, checked every step.

Run by tests/multiproc/test_horovod_deft.py under horovodrun (Gloo or MPI, 4 ranks). Three
configurations: paper mode; agreed_k with heap packing under Horovod's ``groups=2`` (DEFT is
whole-model whatever Horovod's grouping); paper mode at a high density built by name, where
bins run empty and ranks send their fallback index. After every step each rank allgathers every
rank's accumulated vector and checks the applied gradient, its new residual, error feedback and
the statistics against an independent re-derivation of the step (workers/deft_checks.py); at the
end, that all ranks hold identical parameters. Any failure raises, so the job exits non-zero.
"""

from __future__ import annotations

import sys

import horovod.torch as hvd
import numpy as np
import torch
from checks import check_identical
from deft_checks import check_deft_step
from torch_common import allgather_rows

import hvd_sparse
import hvd_sparse.torch as hs

STEPS = int(sys.argv[1]) if len(sys.argv) > 1 else 20


def run(label: str, density: float, agreed_k: bool, packing: str, groups: int | None,
        via_registry: bool) -> None:
    label = f"torch/{label}"
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 24), torch.nn.Tanh(), torch.nn.Linear(24, 5))
    named = list(model.named_parameters())
    sizes = [p.numel() for _, p in named]
    options = dict(density=density, agreed_k=agreed_k, packing=packing, named_parameters=named,
                   prefix=f"hs.{label}")
    compressor = (hvd_sparse.create("deft", framework="torch", **options) if via_registry
                  else hs.DEFT(**options))
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         named_parameters=named, compression=compressor,
                                         groups=groups)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    generator = torch.Generator().manual_seed(1000 + hvd.rank())
    fallbacks, densities = 0, []
    for step in range(STEPS):
        x = torch.randn(12, 16, generator=generator)
        y = torch.randint(0, 5, (12,), generator=generator)
        old = compressor.state_dict()["buckets"]
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        raw = torch.cat([p.grad.detach().reshape(-1) for _, p in named]).numpy().copy()
        optimizer.step()
        applied = torch.cat([p.grad.detach().reshape(-1) for _, p in named]).numpy()
        new = compressor.state_dict()["buckets"]["model"]
        acc = raw + (old["model"]["residual"] if "model" in old else 0)
        accs = allgather_rows(acc.astype(np.float32), f"test.{label}.{step}")
        stats = compressor.stats()
        fallbacks += check_deft_step(hvd.rank(), accs, applied, new["residual"], sizes, density, step,
                                     agreed_k, stats, f"{label} step {step}")
        densities.append(stats["density_actual"])
    stats = compressor.stats()
    assert stats["step"] == STEPS and len(stats["counts"]) == hvd.size(), stats
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()
    check_identical(allgather_rows(params, f"test.{label}.params"), f"{label} parameters")
    print(f"CHECKED {label} rank={hvd.rank()} steps={STEPS} density={np.mean(densities):.4f} "
          f"target={density} fallbacks={fallbacks} imbalance={stats['imbalance']:.3f}", flush=True)


def main() -> None:
    hvd.init()
    run("paper", 0.05, agreed_k=False, packing="linear", groups=None, via_registry=False)
    run("agreed-heap-groups2", 0.05, agreed_k=True, packing="heap", groups=2, via_registry=False)
    run("dense-fallback", 1.0, agreed_k=False, packing="linear", groups=None, via_registry=True)
    print(f"PASSED rank={hvd.rank()} size={hvd.size()}", flush=True)


if __name__ == "__main__":
    main()
