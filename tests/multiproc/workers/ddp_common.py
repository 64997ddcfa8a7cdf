"""What the DDP workers share: the torch.distributed set-up, allgathers of NumPy rows, and a
training loop through DistributedDataParallel that hands every step of every bucket to a check.

The model has six parameters (384, 24, 576, 24, 120, 5 entries) and DDP's buckets are capped at
2000 bytes, so after its first step DDP rebuilds them into several buckets whose boundaries
cut across LAGS's groups: the face must not depend on DDP's layout.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
from checks import by_tensor, check_identical
from torch.nn.parallel import DistributedDataParallel

import hvd_sparse.torch.ddp as ddp
from hvd_sparse.engine.planning import plan_buckets

STEPS = 12
BUCKET_CAP_MB = 0.002
TIMEOUT = timedelta(seconds=60)   # a collective that waits longer fails the job instead of hanging


def init() -> tuple[int, int]:
    dist.init_process_group("gloo", timeout=TIMEOUT)
    return dist.get_rank(), dist.get_world_size()


def allgather_rows(vector: np.ndarray) -> np.ndarray:
    """(N, ...) every rank's copy of ``vector``, by rank."""
    mine = torch.from_numpy(np.ascontiguousarray(vector))[None]
    rows = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, mine)
    return torch.cat(rows).numpy()


def make_model(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 24), torch.nn.Tanh(), torch.nn.Linear(24, 24),
                               torch.nn.Tanh(), torch.nn.Linear(24, 5)).to(dtype)


class RawGradients:
    """Each parameter's gradient as backward computed it, caught by a tensor hook before DDP
    copies it into its bucket (the hook then overwrites the bucket with the average)."""

    def __init__(self, named: list):
        self.grads: dict[str, torch.Tensor] = {}
        for name, param in named:
            param.register_hook(functools.partial(self._keep, name))

    def _keep(self, name: str, grad: torch.Tensor) -> None:
        self.grads[name] = grad.detach().clone()

    def take(self) -> dict[str, torch.Tensor]:
        grads, self.grads = self.grads, {}
        return grads


def flat(tensors: dict, names: list[str]) -> np.ndarray:
    return torch.cat([tensors[n].detach().float().reshape(-1) for n in names]).numpy()


# check(step, bucket, raw, applied, old, new, stats, label): raw and applied flat over the bucket's
# tensors, old/new the bucket's entry of state_dict() before and after the step (old None at first).
Check = Callable[..., None]


def run(label: str, make_state: Callable, check: Check, *, steps: int = STEPS,
        dtype: torch.dtype = torch.float32, nan_step: int | None = None,
        steps_per_epoch: int | None = None, find_unused_parameters: bool = False, resumed_at: int = 0):
    """Train ``steps`` steps through DDP with ``make_state(named_parameters)``'s hook, checking
    every bucket of every step, then that every rank holds identical parameters. ``resumed_at``:
    the step counter the state starts from (a loaded checkpoint)."""
    rank = dist.get_rank()
    model = make_model(dtype)
    named = list(model.named_parameters())
    state = make_state(named)
    wrapped = DistributedDataParallel(model, bucket_cap_mb=BUCKET_CAP_MB,
                                      find_unused_parameters=find_unused_parameters)
    wrapped.register_comm_hook(state, ddp.hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    plan = plan_buckets(state.algorithm, [n for n, _ in named], [p.numel() for _, p in named])
    generator = torch.Generator().manual_seed(1000 + rank)
    gradients = RawGradients(named)
    for step in range(steps):
        if steps_per_epoch:
            state.set_epoch(step // steps_per_epoch)
        x = torch.randn(12, 16, generator=generator) * (1 + rank)
        y = torch.randint(0, 5, (12,), generator=generator)
        if step == nan_step and rank == 1:
            x[0, 0] = float("nan")
        old = by_tensor(state.state_dict()["buckets"])
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(wrapped(x.to(dtype)).float(), y).backward()
        raw = gradients.take()
        applied = {n: p.grad for n, p in named}
        new, stats = by_tensor(state.state_dict()["buckets"]), state.stats()
        for bucket, members in plan:
            check(step, bucket, flat(raw, members), flat(applied, members), old.get(bucket),
                  new[bucket], stats, f"{label} step {step} bucket {bucket}")
        optimizer.step()
    stats = state.stats()
    assert stats["step"] == resumed_at + steps and stats["world_size"] == dist.get_world_size(), stats
    params = torch.cat([p.detach().float().reshape(-1) for p in model.parameters()]).numpy()
    check_identical(allgather_rows(params), f"{label} parameters")
    print(f"CHECKED ddp/{label} rank={rank} density={stats['density_actual']:.4f} "
          f"buildup={stats['buildup']:.3f} wait_ms={1e3 * stats['comm_wait_seconds']:.2f}", flush=True)
    return state, model


def outcome(label: str, body: Callable) -> list:
    """Every rank's outcome of ``body()``: ("ok", value) or (error type, message), by rank."""
    import re

    try:
        mine = ("ok", body())
    except Exception as error:
        mine = (type(error).__name__, re.sub(r"seen on rank \d+", "seen on rank R", str(error)))
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return everyone


def finish(rank: int, size: int) -> None:
    """A last collective on every rank (a rank left behind fails the job), then PASSED, and the
    process ends without the interpreter's shutdown: torch 2.13's Gloo threads can otherwise abort
    it ("terminate called without an active exception", docs/ddp.md), as one did in a full test
    run after every check had passed."""
    total = torch.ones(1)
    dist.all_reduce(total)
    assert total.item() == size
    print(f"PASSED rank={rank} size={size}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    sys.stderr.flush()
    os._exit(0)
