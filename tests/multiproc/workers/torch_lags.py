"""Worker: stock horovod.torch DistributedOptimizer with hvd_sparse LAGS, checked every step.

Configurations (one launch covers them all):
* "merged": groups of two tensors (merge_threshold=100), with a layer whose backward sleeps, to
  check that each group's collectives are issued -- and complete -- while the backward pass is
  still running (``communication_timeline()`` read from a gradient hook of every parameter: the
  reading taken at the last hook of the step must already show group0 issued and complete).
* "per-tensor": merge_threshold=0, built through the registry.
* "adaptive-calibrated": adaptive densities, cost model measured on the job, T_comp = remaining.
* "adaptive-given": adaptive densities from given alpha/beta, T_comp = own group.

After every step, every rank allgathers every rank's accumulated vector per group and checks the
applied gradient, its new residual and error feedback against an independent reference with that
group's density; at the end, that all ranks hold identical parameters and densities.
"""

from __future__ import annotations

import sys
import time

import horovod.torch as hvd
import numpy as np
import torch
from checks import check_identical, check_topk_step
from torch_common import RawGradients, allgather_rows

import hvd_sparse
import hvd_sparse.torch as hs
from hvd_sparse.engine.planning import plan_buckets

STEPS = int(sys.argv[1]) if len(sys.argv) > 1 else 20
DENSITY = 0.05
PROFILE_STEPS = 3


class SlowBackward(torch.autograd.Function):
    """Identity whose backward takes ``delay`` seconds: backward work after the later groups."""

    @staticmethod
    def forward(ctx, x, delay):
        ctx.delay = delay
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.delay)
        return grad, None


class Slow(torch.nn.Module):
    def __init__(self, delay: float):
        super().__init__()
        self.delay = delay

    def forward(self, x):
        return SlowBackward.apply(x, self.delay) if self.delay else x


def run(label: str, delay: float = 0.0, via_registry: bool = False, **options) -> None:
    label = f"torch/{label}"
    torch.manual_seed(0)
    # Parameters 384, 24 | 576, 24 | 120, 5: with merge_threshold=100, three groups of two.
    model = torch.nn.Sequential(torch.nn.Linear(16, 24), Slow(delay), torch.nn.Tanh(),
                                torch.nn.Linear(24, 24), torch.nn.Tanh(), torch.nn.Linear(24, 5))
    named = list(model.named_parameters())
    options = dict(density=DENSITY, named_parameters=named, prefix=f"hs.{label}", **options)
    compressor = (hvd_sparse.create("lags", framework="torch", **options) if via_registry
                  else hs.LAGS(**options))
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         named_parameters=named, compression=compressor)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    plan = plan_buckets(compressor.algorithm, [n for n, _ in named], [p.numel() for _, p in named])
    expected_groups = 6 if compressor.algorithm.merge_threshold == 0 else 3
    assert len(plan) == expected_groups, plan

    # Read the communication timeline from a hook on every parameter's gradient; the reading at
    # the last hook (latest clock) tells what was in flight before backward finished.
    readings: list[tuple[float, dict]] = []
    for _, p in named:
        p.register_hook(lambda grad: readings.append((time.perf_counter(),
                                                      compressor.communication_timeline())))
    issued_early = completed_early = 0
    gradients = RawGradients(named)   # p.grad after backward is not the raw gradient (the pass
                                      # that reads it clears it)

    generator = torch.Generator().manual_seed(1000 + hvd.rank())
    for step in range(STEPS):
        x = torch.randn(12, 16, generator=generator)
        y = torch.randint(0, 5, (12,), generator=generator)
        old = compressor.state_dict()["buckets"]
        densities = compressor.stats().get("group_densities", {})
        optimizer.zero_grad()
        readings.clear()
        began = time.perf_counter()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        backward = time.perf_counter() - began
        raw = gradients.take()
        began = time.perf_counter()
        optimizer.step()
        check_breakdown(compressor.step_times(), backward, time.perf_counter() - began, label)
        applied = {n: p.grad.detach().clone() for n, p in named}
        new = compressor.state_dict()["buckets"]
        for group, members in plan:
            flat_raw = torch.cat([raw[n].reshape(-1) for n in members]).numpy()
            acc = flat_raw + (old[group]["residual"] if group in old else 0)
            accs = allgather_rows(acc.astype(np.float32), f"test.{label}.{group}.{step}")
            flat_applied = torch.cat([applied[n].reshape(-1) for n in members]).numpy()
            check_topk_step(hvd.rank(), accs, flat_applied, new[group]["residual"],
                            densities.get(group, DENSITY), "gather", f"{label} step {step} {group}")
        last_hook = max(readings, key=lambda r: r[0])[1]
        if step > 0:  # from the second step on the plan is known while backward runs
            issued, completed = last_hook.get("group0", (None, None))
            issued_early += issued is not None
            completed_early += completed is not None
            if compressor.algorithm.merge_threshold:  # the first layer's two tensors: one is left
                assert plan[-1][0] not in last_hook, f"{label}: the last group started too early"

    stats = compressor.stats()
    assert stats["step"] == STEPS and stats["buckets"] == len(plan), stats
    assert stats["comm_wait_seconds"] >= 0 and stats["comm_inflight_seconds"] > 0, stats
    # Every step after the first issued group0's allgathers inside the backward pass.
    assert issued_early == STEPS - 1, f"{label}: group0 issued during backward in {issued_early} steps"
    if delay:  # with backward work left after it, group0's exchange also completes during backward
        assert completed_early >= (STEPS - 1) // 2, \
            f"{label}: group0 completed during backward in only {completed_early} of {STEPS - 1} steps"
    group_densities = np.array([stats["group_densities"][g] for g, _ in plan])
    check_identical(allgather_rows(group_densities, f"test.{label}.densities"), f"{label} densities")
    assert (group_densities >= DENSITY).all(), group_densities
    if compressor.algorithm.adaptive:
        assert stats["adaptive_state"] == "fixed", stats
        assert stats["comm_alpha"] >= 0 and stats["comm_beta"] >= 0, stats
        comp = stats["group_comp_seconds"]
        if compressor.algorithm.comp_time == "own":  # the layers between two groups take time
            assert comp["group1"] > 0 and comp["group2"] > 0, comp
        else:  # backward work is left after the first group, none after the last one
            assert comp["group0"] > 0 and comp["group2"] == 0, comp
            assert stats["group_densities"]["group2"] == DENSITY, stats
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()
    check_identical(allgather_rows(params, f"test.{label}.params"), f"{label} parameters")
    extra = ""
    if compressor.algorithm.adaptive:
        extra = (f" alpha={stats['comm_alpha']:.3g} beta={stats['comm_beta']:.3g} densities="
                 + ",".join(f"{d:.4f}" for d in group_densities))
    print(f"CHECKED {label} rank={hvd.rank()} steps={STEPS} issued_early={issued_early} "
          f"completed_early={completed_early} wait_ms={1e3 * stats['comm_wait_seconds']:.2f} "
          f"inflight_ms={1e3 * stats['comm_inflight_seconds']:.2f}{extra}", flush=True)


def check_breakdown(times: dict, backward: float, step: float, label: str) -> None:
    """The face's step times fit inside the step as this rank timed it: the hooks inside the
    backward pass, decompress inside optimizer.step(), the engine's parts inside both, and the
    time in flight split into hidden + exposed."""
    slack = 1e-3
    assert 0 < times["hook_seconds"] <= backward + slack, (label, times, backward)
    assert 0 < times["decompress_seconds"] <= step + slack, (label, times, step)
    assert times["comm_wait_seconds"] <= times["decompress_seconds"] + slack, (label, times)
    parts = sum(times[f"{p}_seconds"] for p in ("accumulate", "select", "exchange", "reconstruct"))
    assert parts <= times["engine_seconds"] + slack, (label, times)
    inside = times["hook_seconds"] + times["decompress_seconds"]
    assert times["engine_seconds"] <= inside + slack, (label, times)
    inflight = times["comm_hidden_seconds"] + times["comm_exposed_seconds"]
    assert abs(inflight - times["comm_inflight_seconds"]) < 1e-9, (label, times)


def main() -> None:
    hvd.init()
    run("merged", delay=0.05, merge_threshold=100)
    run("per-tensor", via_registry=True, merge_threshold=0)
    run("adaptive-calibrated", merge_threshold=100, adaptive=True, profile_steps=PROFILE_STEPS,
        comp_time="remaining")
    run("adaptive-given", merge_threshold=100, adaptive=True, profile_steps=PROFILE_STEPS,
        alpha=1e-4, beta=1e-6)
    print(f"PASSED rank={hvd.rank()} size={hvd.size()}", flush=True)


if __name__ == "__main__":
    main()
