"""Worker: stock horovod.torch DistributedOptimizer with hvd_sparse TopK, checked every step.

Run by tests/multiproc/test_horovod_topk.py under horovodrun (Gloo or MPI, 2 or 4 ranks). For each
configuration (scope x pattern) it trains a small MLP for STEPS steps and, after every step,
allgathers every rank's accumulated vector and checks the applied gradient, the new residual and
error feedback against an independent reference; at the end, that all ranks hold identical
parameters. Any failure raises, so the job exits non-zero.
"""

from __future__ import annotations

import sys

import horovod.torch as hvd
import numpy as np
import torch
from checks import by_tensor, check_identical, check_topk_step
from torch_common import RawGradients, allgather_rows

import hvd_sparse
import hvd_sparse.torch as hs

STEPS = int(sys.argv[1]) if len(sys.argv) > 1 else 20
DENSITY = 0.05


def run(scope: str, pattern: str, via_registry: bool) -> None:
    label = f"torch/{scope}/{pattern}"
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 24), torch.nn.Tanh(), torch.nn.Linear(24, 5))
    named = list(model.named_parameters())
    options = dict(density=DENSITY, scope=scope, pattern=pattern, named_parameters=named,
                   prefix=f"hs.{scope}.{pattern}")
    compressor = (hvd_sparse.create("topk", framework="torch", **options) if via_registry
                  else hs.TopK(**options))
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         named_parameters=named, compression=compressor)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    buckets = ([("model", [n for n, _ in named])] if scope == "model"
               else [(n, [n]) for n, _ in named])
    generator = torch.Generator().manual_seed(1000 + hvd.rank())
    gradients = RawGradients(named)   # p.grad after backward: cleared by the pass that read it
    for step in range(STEPS):
        x = torch.randn(12, 16, generator=generator)
        y = torch.randint(0, 5, (12,), generator=generator)
        old = by_tensor(compressor.state_dict()["buckets"])
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        raw = gradients.take()
        optimizer.step()
        applied = {n: p.grad.detach().clone() for n, p in named}
        new = by_tensor(compressor.state_dict()["buckets"])
        for key, names in buckets:
            flat_raw = torch.cat([raw[n].reshape(-1) for n in names]).numpy()
            acc = flat_raw + (old[key]["residual"] if key in old else 0)
            accs = allgather_rows(acc.astype(np.float32), f"test.{label}.{key}.{step}")
            flat_applied = torch.cat([applied[n].reshape(-1) for n in names]).numpy()
            check_topk_step(hvd.rank(), accs, flat_applied, new[key]["residual"], DENSITY, pattern,
                            f"{label} step {step} bucket {key}")
    stats = compressor.stats()
    assert stats["step"] == STEPS and stats["k"] > 0 and 0 < stats["density_actual"] <= 1, stats
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()
    check_identical(allgather_rows(params, f"test.{label}.params"), f"{label} parameters")
    print(f"CHECKED {label} rank={hvd.rank()} steps={STEPS} density={stats['density_actual']:.4f}",
          flush=True)


def main() -> None:
    hvd.init()
    for i, (scope, pattern) in enumerate([("tensor", "gather"), ("tensor", "union"),
                                          ("model", "gather"), ("model", "union")]):
        run(scope, pattern, via_registry=(i == 3))
    print(f"PASSED rank={hvd.rank()} size={hvd.size()}", flush=True)


if __name__ == "__main__":
    main()
