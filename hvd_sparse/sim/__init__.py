"""The N-rank simulator: N simulated ranks in one process, on the same algorithm code as a real
job (engine + ``comm/local.py``), fed real per-rank gradients of a small model.

Every rank computes its gradient on its own minibatch at the shared parameters; the ranks'
engines exchange through the lockstep local group; the averaged gradient (identical on every
rank, checked) drives one optimizer step. One record per step.

    python -m hvd_sparse.sim --method exdyna --world-size 64 --density 0.001 --model digits \\
        --steps 500 --out run.json
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..algorithms import Algorithm
from ..backends import get_backend
from ..comm.local import LocalGroup
from ..engine import Engine
from ..registry import create
from .tasks import TASKS

RECORD_FIELDS = ("step", "loss", "density_target", "density_actual", "k", "union", "buildup",
                 "threshold", "counts", "imbalance", "partition", "rebalance_moves", "bytes_sent",
                 "bytes_received", "residual_norm")


def simulate(method: str | Algorithm, world_size: int, steps: int, *, density: float = 0.01,
             task: str = "digits", batch_size: int = 16, lr: float = 0.05, momentum: float = 0.9,
             seed: int = 0, evaluate_every: int = 0, options: dict | None = None) -> list[dict]:
    """Train ``task`` for ``steps`` steps with ``world_size`` simulated ranks; one record per step
    (``RECORD_FIELDS``; per-rank lists for the byte counts and residual norms)."""
    algorithm = method if isinstance(method, Algorithm) else create(method, density=density,
                                                                     **(options or {}))
    job = TASKS[task](batch_size=batch_size, seed=seed)
    model = job.model
    backend = get_backend("torch")
    engines = [Engine(algorithm, backend, rank, world_size, write_into_inputs=True)
               for rank in range(world_size)]
    group = LocalGroup(world_size, backend)
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    plan = algorithm.plan([name for name, _ in named], [p.numel() for _, p in named])
    position = {name: i for i, (name, _) in enumerate(named)}
    optimizer = torch.optim.SGD([p for _, p in named], lr=lr, momentum=momentum)
    records = []
    for step in range(steps):
        grads, losses = [], []
        for rank in range(world_size):
            model.zero_grad(set_to_none=True)
            loss = job.loss(model, job.batch(rank, step))
            loss.backward()
            grads.append([p.grad.detach().clone() for _, p in named])
            losses.append(loss.item())
        averaged: list[Any] = [None] * len(named)
        for bucket, members in plan:
            protocols = [engines[r].step(bucket, [grads[r][position[m]] for m in members])
                         for r in range(world_size)]
            outputs = group.run(protocols)
            for member, out in zip(members, outputs[0], strict=True):
                averaged[position[member]] = out
            if step % 50 == 0:  # every rank must hold the same average
                for other in outputs[1:]:
                    for a, b in zip(outputs[0], other, strict=True):
                        torch.testing.assert_close(a, b, rtol=0, atol=0)
        for (_, p), g in zip(named, averaged, strict=True):
            p.grad = g
        optimizer.step()
        records.append(_record(step, float(np.mean(losses)), engines, job, model, evaluate_every))
    return records


def _record(step: int, loss: float, engines: list[Engine], job: Any, model: Any,
            evaluate_every: int) -> dict:
    per_rank = [engine.stats() for engine in engines]
    first = per_rank[0]
    record = {field: first.get(field) for field in RECORD_FIELDS}
    record.update(step=step, loss=loss,
                  bytes_sent=[s["bytes_sent"] for s in per_rank],
                  bytes_received=[s["bytes_received"] for s in per_rank],
                  residual_norm=[s["residual_norm"] for s in per_rank])
    if evaluate_every and (step + 1) % evaluate_every == 0:
        record.update(job.evaluate(model))
    return record
