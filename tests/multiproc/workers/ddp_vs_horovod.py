"""Worker: one training run per method through the Horovod face or the DDP face, recording every
step's decisions, so that tests/multiproc/test_ddp_vs_horovod.py can compare the two faces.

``argv[1]``: "ddp" (run under torchrun) or "horovod" (under horovodrun); ``argv[2]``: the output
directory. For each configuration every rank trains the same model on the same data (seeded by
rank) for STEPS steps and writes, per step, every bucket's step counter, residual, momentum
velocity and control state (thresholds, partitions, unit tables, ...) and the applied gradients,
to ``<config>.rank<r>.pkl``. Nothing here compares: identical files are the claim.
"""

from __future__ import annotations

import pickle
import sys
from pathlib import Path

import torch

import hvd_sparse

FACE, OUT = sys.argv[1], Path(sys.argv[2])
STEPS = 8
DENSITY = 0.05
CONFIGS = {
    "exdyna": ("exdyna", {}),
    "exdyna-neighbour": ("exdyna", {"rebalance": "neighbour"}),
    "exdyna-tracking": ("exdyna", {"threshold_scaling": "tracking"}),
    "micro": ("micro", {}),
    "deft": ("deft", {}),
    "lags": ("lags", {"merge_threshold": 100}),
    "topk": ("topk", {}),
    "topk-model-union": ("topk", {"scope": "model", "pattern": "union"}),
    "topk-corrections": ("topk", {"momentum": 0.9, "warmup_steps": 3, "dense_below": 30}),
    "randomk": ("randomk", {"seed": 3}),
    "threshold": ("threshold", {}),
    "gaussiank": ("gaussiank", {}),
    "dgc": ("dgc", {"momentum": 0.9}),
}


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 24), torch.nn.Tanh(), torch.nn.Linear(24, 24),
                               torch.nn.Tanh(), torch.nn.Linear(24, 5))


def horovod_trainer(label: str, method: str, options: dict, model: torch.nn.Module):
    import horovod.torch as hvd

    named = list(model.named_parameters())
    compressor = hvd_sparse.create(method, framework="torch", density=DENSITY, named_parameters=named,
                                   prefix=f"cmp.{label}", **options)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         named_parameters=named, compression=compressor)
    return compressor, model, optimizer


def ddp_trainer(label: str, method: str, options: dict, model: torch.nn.Module):
    from torch.nn.parallel import DistributedDataParallel

    import hvd_sparse.torch.ddp as ddp

    state = hvd_sparse.create(method, framework="ddp", density=DENSITY,
                              named_parameters=model.named_parameters(), **options)
    wrapped = DistributedDataParallel(model, bucket_cap_mb=0.002)
    wrapped.register_comm_hook(state, ddp.hook)
    return state, wrapped, torch.optim.SGD(model.parameters(), lr=0.1)


def record(label: str, method: str, options: dict, rank: int) -> None:
    model = make_model()
    trainer = ddp_trainer if FACE == "ddp" else horovod_trainer
    compression, forward, optimizer = trainer(label, method, options, model)
    generator = torch.Generator().manual_seed(1000 + rank)
    steps = []
    for _ in range(STEPS):
        x = torch.randn(12, 16, generator=generator) * (1 + rank)
        y = torch.randint(0, 5, (12,), generator=generator)
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(forward(x), y).backward()
        optimizer.step()
        buckets = compression.state_dict()["buckets"]
        parts = ("step", "residual", "momentum", "control")
        steps.append({"buckets": {key: {p: saved[p] for p in parts} for key, saved in buckets.items()},
                      "applied": {n: p.grad.detach().numpy().copy() for n, p in model.named_parameters()}})
    params = {n: p.detach().numpy().copy() for n, p in model.named_parameters()}
    with open(OUT / f"{label}.rank{rank}.pkl", "wb") as out:
        pickle.dump({"steps": steps, "params": params}, out)
    print(f"RECORDED {FACE}/{label} rank={rank}", flush=True)


def main() -> None:
    if FACE == "horovod":
        import horovod.torch as hvd

        hvd.init()
        rank, size = hvd.rank(), hvd.size()
    else:
        import torch.distributed as dist

        dist.init_process_group("gloo")
        rank, size = dist.get_rank(), dist.get_world_size()
    OUT.mkdir(parents=True, exist_ok=True)
    for label, (method, options) in CONFIGS.items():
        record(label, method, options, rank)
    if FACE == "ddp":   # ends without the interpreter's shutdown, which Gloo's threads can abort
        from ddp_common import finish

        finish(rank, size)
    print(f"PASSED rank={rank} size={size}", flush=True)


if __name__ == "__main__":
    main()
