"""The N-rank simulator: N simulated ranks in one process, on the same algorithm code as a real
job (engine + ``comm/local.py``), fed real per-rank gradients of a small model.

Every rank computes its gradient on its own minibatch at the shared parameters; the ranks'
engines (torch backend, writing the average into the gradient tensors as the PyTorch face does)
exchange through the lockstep local group; the averaged gradient (identical on every rank,
checked every 50 steps) drives one optimizer step. One record per step (``RECORD_FIELDS``).

    python -m hvd_sparse.sim --method exdyna --world-size 64 --density 0.001 --model lstm \\
        --steps 500 --out run.json

``method="dense"`` is the plain average through the same loop (every entry allreduced, nothing
kept back): the baseline of convergence runs. See ``hvd_sparse/sim/__main__.py`` for the command
line and ``hvd_sparse/sim/tasks.py`` for the models.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..algorithms import AdamPath, Algorithm
from ..algorithms.dense import DENSE, DenseAverage
from ..backends import get_backend
from ..comm.local import LocalGroup
from ..engine import Engine
from ..engine.planning import plan_buckets
from ..registry import available, create
from .tasks import TASKS

SCHEDULES = ("constant", "cosine")
OPTIMIZERS = ("sgd", "adamw")

# One record per step. Scalars describe the step as every rank sees it (rank 0's statistics);
# lists are per rank, in rank order.
RECORD_FIELDS = (
    "step",            # 0-based
    "loss",            # mean over ranks of the training loss at the parameters before the step
    "density_target",  # the target density (DGC: the warm-up's current one)
    "density_actual",  # distinct aggregated indices / elements
    "k",               # the target count (summed over buckets)
    "union",           # distinct aggregated indices (summed over buckets)
    "buildup",         # union / k (1: no build-up; up to N for independent selections)
    "threshold",       # λ: one number when every rank uses the same one (MiCRO, ExDyna, Threshold),
                       # a per-rank list when each rank has its own (Gaussian-k, DGC), else None
    "counts",          # per rank: the entries it selected (its own count)
    "imbalance",       # N·max(counts) / Σcounts − 1: padding waste of a padded index allgather
    "common",          # entries appended to the union besides the gathered ones (DEFT), else 0
    "partition",       # ExDyna/MiCRO: the N+1 element bounds of the partitions used this step
                       # (neighbour mode: rebuilt from every rank's own partition)
    "rebalance_moves",  # ExDyna: boundaries moved before this step
    "bytes_sent",      # per rank: payload put into collectives (int32 indices, values)
    "bytes_received",  # per rank: payload received
    "residual_norm",   # per rank: ||residual|| after the step
    "seconds",         # wall time of the simulated step (all ranks' gradients and engines)
)


def methods() -> list[str]:
    """Method names the simulator accepts: every registered method and ``dense``."""
    return [DENSE, *available()]


def make_algorithm(method: str | Algorithm, density: float, options: dict | None = None,
                   adam: AdamPath | None = None) -> Algorithm:
    """The algorithm of ``method``: itself, the plain average for ``dense``, else the registry's with
    ``options`` (and the Adam path ``adam``, when given)."""
    if isinstance(method, Algorithm):
        return method
    if method == DENSE:
        return DenseAverage()
    kwargs: dict[str, Any] = {**(options or {}), **({"adam": adam} if adam else {})}
    return create(method, density=density, **kwargs)


@dataclass(frozen=True)
class OptimizerRecipe:
    """The simulator's optimizer: SGD(lr, momentum) or AdamW(lr, betas, eps, weight_decay)."""

    name: str = "sgd"
    lr: float = 0.05
    momentum: float = 0.9
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01

    def __post_init__(self) -> None:
        if self.name not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {self.name!r}")

    def adam_path(self) -> AdamPath:
        """The Adam path of this AdamW (its betas and eps)."""
        return AdamPath(*self.betas, self.eps)

    def build(self, params: list[torch.nn.Parameter], applies_updates: bool) -> torch.optim.Optimizer:
        """The optimizer stepping ``params``. ``applies_updates``: the averaged result is the Adam
        path's update, applied as AdamW applies its own, p <- p - lr * (update + weight_decay * p),
        which is SGD with that weight decay (hvd_sparse.torch.optim.AdamW's step, without
        importing the PyTorch face)."""
        if self.name == "sgd":
            return torch.optim.SGD(params, lr=self.lr, momentum=self.momentum)
        if applies_updates:
            return torch.optim.SGD(params, lr=self.lr, weight_decay=self.weight_decay)
        return torch.optim.AdamW(params, lr=self.lr, betas=self.betas, eps=self.eps,
                                 weight_decay=self.weight_decay)


def simulate(method: str | Algorithm, world_size: int, steps: int, *, density: float = 0.01,
             task: str = "digits", batch_size: int = 16, lr: float = 0.05, momentum: float = 0.9,
             seed: int = 0, evaluate_every: int = 0, options: dict | None = None,
             schedule: str = "constant", clip_norm: float | None = None,
             task_options: dict | None = None, optimizer: str = "sgd", weight_decay: float = 0.01,
             betas: tuple[float, float] = (0.9, 0.999), adam_path: bool = False,
             on_record: Callable[[dict], None] | None = None) -> list[dict]:
    """Train ``task`` for ``steps`` steps with ``world_size`` simulated ranks; one record per step
    (``RECORD_FIELDS``, plus the task's evaluation -- e.g. ``accuracy`` or ``perplexity`` -- every
    ``evaluate_every`` steps and at the last step when ``evaluate_every`` > 0).

    The optimizer is SGD(lr, momentum) on the averaged gradient (``optimizer="adamw"``:
    AdamW(lr, betas, weight_decay)), after clipping its norm to ``clip_norm`` when given;
    ``schedule="cosine"`` decays lr to 0 over ``steps``. ``adam_path``: the method runs the Adam
    path of that AdamW (``AdamPath``; docs/methods.md#adam-and-adamw), whose averaged update the
    optimizer applies. ``method`` is a registered name (with ``options``), an ``Algorithm``, or
    ``"dense"``. ``on_record`` is called with each record as it is made (progress, streaming)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; available: {', '.join(TASKS)}")
    recipe = OptimizerRecipe(optimizer, lr, momentum, (float(betas[0]), float(betas[1])),
                             weight_decay=weight_decay)
    if adam_path and (optimizer != "adamw" or clip_norm is not None or method == DENSE):
        raise ValueError("adam_path needs optimizer='adamw', a sparsifying method and no clip_norm "
                         "(the averaged result is an update, not a gradient)")
    algorithm = make_algorithm(method, density, options, recipe.adam_path() if adam_path else None)
    applies_updates = algorithm.corrections.adam is not None
    if steps <= algorithm.corrections.dense_steps + algorithm.corrections.warmup_steps and method != DENSE:
        raise ValueError(f"a run of {steps} steps ends before its dense steps and warm-up "
                         f"({algorithm.corrections.dense_steps} + {algorithm.corrections.warmup_steps})")
    job = TASKS[task](batch_size=batch_size, seed=seed, **(task_options or {}))
    ranks = SimulatedRanks.build(algorithm, job.model, world_size)
    stepper = recipe.build([p for _, p in ranks.named], applies_updates)
    records = []
    for step in range(steps):
        started = time.perf_counter()
        if schedule == "cosine":
            for param_group in stepper.param_groups:
                param_group["lr"] = lr * 0.5 * (1.0 + math.cos(math.pi * step / steps))
        grads, losses = ranks.gradients(job, step)
        ranks.apply(ranks.average(grads, step), clip_norm)
        stepper.step()
        record = _record(step, float(np.mean(losses)), ranks.engines)
        record["seconds"] = time.perf_counter() - started
        if evaluate_every > 0 and ((step + 1) % evaluate_every == 0 or step == steps - 1):
            record.update(job.evaluate(job.model))
        records.append(record)
        if on_record is not None:
            on_record(record)
    return records


@dataclass
class SimulatedRanks:
    """N ranks' engines over one model's trainable parameters, exchanging in lockstep."""

    engines: list[Engine]
    group: LocalGroup
    named: list[tuple[str, torch.nn.Parameter]]   # the trainable parameters, in model order
    plan: list                                    # the method's buckets: (name, parameter names)
    position: dict[str, int]                      # parameter name -> index in ``named``

    @classmethod
    def build(cls, algorithm: Algorithm, model: torch.nn.Module, world_size: int) -> SimulatedRanks:
        """One engine per rank (torch backend, writing the average into the gradient tensors as
        the PyTorch face does) and the method's plan of the model."""
        backend = get_backend("torch")
        engines = [Engine(algorithm, backend, rank, world_size, write_into_inputs=True)
                   for rank in range(world_size)]
        named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        plan = plan_buckets(algorithm, [name for name, _ in named], [p.numel() for _, p in named])
        return cls(engines, LocalGroup(world_size, backend), named, plan,
                   {name: i for i, (name, _) in enumerate(named)})

    def gradients(self, job: Any, step: int) -> tuple[list[list], list[float]]:
        """Every rank's gradients on its own minibatch at the shared parameters, and its loss."""
        grads, losses = [], []
        for rank in range(len(self.engines)):
            job.model.zero_grad(set_to_none=True)
            loss = job.loss(job.model, job.batch(rank, step))
            loss.backward()
            grads.append([p.grad for _, p in self.named])   # fresh tensors: every rank owns its own
            losses.append(loss.item())
        return grads, losses

    def average(self, grads: list[list], step: int) -> list[Any]:
        """The ranks' step, bucket by bucket, then their end of step: the averaged gradient (rank
        0's; every 50 steps checked identical on every rank)."""
        averaged: list[Any] = [None] * len(self.named)
        for bucket, members in self.plan:
            protocols = [self.engines[r].step(bucket, [grads[r][self.position[m]] for m in members])
                         for r in range(len(self.engines))]
            outputs = self.group.run(protocols)
            for member, out in zip(members, outputs[0], strict=True):
                averaged[self.position[member]] = out
            if step % 50 == 0:  # every rank must hold the same average
                for other in outputs[1:]:
                    for a, b in zip(outputs[0], other, strict=True):
                        torch.testing.assert_close(a, b, rtol=0, atol=0)
        self.group.run([engine.end_step(None) for engine in self.engines])
        return averaged

    def apply(self, averaged: list[Any], clip_norm: float | None) -> None:
        """The averaged gradient as the parameters' ``grad``, its norm clipped to ``clip_norm``."""
        for (_, p), g in zip(self.named, averaged, strict=True):
            p.grad = g
        if clip_norm is not None:
            torch.nn.utils.clip_grad_norm_([p for _, p in self.named], clip_norm)


def _rank_facts(engine: Engine) -> dict:
    """One rank's own numbers for the last step, summed over buckets, without the union (which
    would cost every rank a de-duplication of everything gathered; rank 0's stats give it)."""
    latest = [bucket.stats for bucket in engine.buckets.values() if bucket.stats is not None]
    thresholds = [s.extra["threshold"] for s in latest if s.extra.get("threshold") is not None]
    own = latest[0].extra.get("own_partition") if len(latest) == 1 else None
    return {"selected": sum(s.selected for s in latest),
            "bytes_sent": sum(s.bytes_sent for s in latest),
            "bytes_received": sum(s.bytes_received for s in latest),
            "residual_norm": math.sqrt(sum(s.residual_sq() for s in latest)),
            "threshold": float(np.mean(thresholds)) if thresholds else None,
            "own_partition": own}


def _record(step: int, loss: float, engines: list[Engine]) -> dict:
    first = engines[0].stats()
    facts = [_rank_facts(engine) for engine in engines]
    counts = [f["selected"] for f in facts]
    total = sum(counts)
    thresholds = [f["threshold"] for f in facts]
    if all(t is None for t in thresholds):
        threshold = None
    elif all(t == thresholds[0] for t in thresholds):
        threshold = thresholds[0]
    else:
        threshold = thresholds
    partition = first.get("partition")
    if partition is None and all(f["own_partition"] is not None for f in facts):
        # ExDyna's neighbour mode: each rank knows only its own range; together they tile the vector.
        ranges = sorted(tuple(f["own_partition"]) for f in facts)
        partition = [lo for lo, _ in ranges] + [ranges[-1][1]]
    return {
        "step": step,
        "loss": loss,
        "density_target": first["density_target"],
        "density_actual": first["density_actual"],
        "k": first["k"],
        "union": first["union"],
        "buildup": first["buildup"],
        "threshold": threshold,
        "counts": counts,
        "imbalance": len(counts) * max(counts) / total - 1.0 if total else 0.0,
        "common": int(first.get("common", 0)),
        "partition": partition,
        "rebalance_moves": first.get("rebalance_moves"),
        "bytes_sent": [f["bytes_sent"] for f in facts],
        "bytes_received": [f["bytes_received"] for f in facts],
        "residual_norm": [f["residual_norm"] for f in facts],
        "seconds": 0.0,
    }


def summarize_run(records: list[dict], skip: int = 0) -> dict:
    """Means over the records after the first ``skip`` (a warm-up), and the last evaluation.
    Formerly ``summarize``, the name of the engine's per-step statistics (engine/stats.py)."""
    body = records[skip:] or records
    ratio = np.array([r["density_actual"] / r["density_target"] for r in body])
    out = {
        "steps": len(records),
        "density_ratio_mean": float(ratio.mean()),
        "density_error_mean": float(np.mean(np.abs(ratio - 1.0))),
        "buildup_mean": float(np.mean([r["buildup"] for r in body])),
        "imbalance_mean": float(np.mean([r["imbalance"] for r in body])),
        "final_loss": float(np.mean([r["loss"] for r in records[-10:]])),
        "seconds_per_step": float(np.mean([r["seconds"] for r in records])),
    }
    evaluated = [r for r in records if any(key in r for key in ("accuracy", "perplexity"))]
    if evaluated:
        last = evaluated[-1]
        out.update({key: last[key] for key in ("accuracy", "perplexity", "bits_per_char") if key in last})
    return out

