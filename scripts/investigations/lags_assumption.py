"""Check LAGS-SGD's convergence assumption (docs/algorithms.md#assumption-check) on a real model.

Trains a small CNN on scikit-learn's digits with LAGS-SGD on N simulated workers -- hvd_sparse's
engine over ``LocalGroup`` with the PyTorch backend, the code a Horovod job runs, in one process
-- and measures, per layer and epoch,

    delta = mean ||a - TopK(a, k)||^2 / mean ||a - RandK(a, k)||^2,   k = max(1, int(density * d)),

on every worker's accumulated vector ``a = g + e`` (gradient plus residual: what the sparsifier
sees), the random-k error taken at its expectation ``(1 - k/d) ||a||^2``. The convergence argument
needs delta <= 1 on every layer: layer-wise top-k no worse than random-k of the same size.

    python scripts/investigations/lags_assumption.py [--workers 4 --density 0.01 --epochs 10]
                                      [--out lags_assumption.json --plot lags_assumption.png]

Prints a table, writes the JSON report and, where matplotlib is installed, a plot of delta per
layer over the epochs with the reference line at 1.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

from hvd_sparse.algorithms.lags import LAGS, AssumptionMonitor
from hvd_sparse.backends import get_backend
from hvd_sparse.comm.local import LocalGroup
from hvd_sparse.engine import Engine
from hvd_sparse.engine.planning import plan_buckets
from hvd_sparse.sim.tasks import DigitsCNN

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # scripts/: the helpers it builds on
from results import pyplot, save


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=4, help="simulated data-parallel workers")
    parser.add_argument("--density", type=float, default=0.01)
    parser.add_argument("--merge-threshold", type=int, default=0,
                        help="LAGS grouping of the training run (0: per layer, as the assumption)")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=32, help="per worker")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--max-steps", type=int, default=0, help="steps per epoch (0: the whole shard)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="lags_assumption.json")
    parser.add_argument("--plot", default="lags_assumption.png", help="PNG path; '' for none")
    return parser.parse_args()


def accumulated_layers(engine: Engine, group: str, members: list[str], grads: dict) -> dict:
    """This worker's ``g + e`` for each layer of a group, before the group's step."""
    bucket = engine.buckets.get(group)
    out, offset = {}, 0
    for name in members:
        g = grads[name].reshape(-1)
        residual = bucket.residual[offset:offset + g.numel()] if bucket is not None else 0
        out[name] = g + residual
        offset += g.numel()
    return out


def evaluate(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    model.eval()
    with torch.no_grad():
        accuracy = float((model(x).argmax(1) == y).float().mean())
    model.train()
    return accuracy


def plot(report: dict, path: str) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    epochs = [e["epoch"] for e in report["epochs"]]
    fig, ax = plt.subplots(figsize=(6, 4))
    for name in report["layers"]:
        ax.plot(epochs, [e["delta"][name] for e in report["epochs"]], marker="o", label=name)
    ax.axhline(1.0, color="black", linestyle="--", linewidth=1)
    ax.set_xlabel("epoch")
    ax.set_ylabel(r"$\delta^{(l)}$ = top-k error / random-k error")
    ax.set_title(f"LAGS assumption, digits CNN, {report['workers']} workers, density {report['density']}")
    ax.legend(fontsize=7)
    save(fig, path)
    return True


def train_step(model, named: list, shards: list, orders: list, step: int, batch_size: int,
               lags: tuple) -> list[float]:
    """One step of every simulated worker: its gradients, LAGS's exchange per group (the monitor
    measuring each worker's accumulated layers first), the average left in ``p.grad``; returns the
    workers' losses."""
    plan, engines, group, monitor = lags
    grads, losses = [], []
    for (xs, ys), order in zip(shards, orders, strict=True):
        batch = order[step * batch_size:(step + 1) * batch_size]
        model.zero_grad()
        loss = F.cross_entropy(model(xs[batch]), ys[batch])
        loss.backward()
        losses.append(loss.item())
        grads.append({n: p.grad.detach().clone() for n, p in named})
    averaged = {}
    for name, members in plan:
        for rank, engine in enumerate(engines):
            monitor.add(accumulated_layers(engine, name, members, grads[rank]))
        outputs = group.run([engine.step(name, [grads[rank][m] for m in members])
                             for rank, engine in enumerate(engines)])
        averaged.update(zip(members, outputs[0], strict=True))
    for n, p in named:
        p.grad = averaged[n]
    return losses


def main() -> None:
    args = parse_args()
    torch.manual_seed(args.seed)
    digits = load_digits()
    x = torch.tensor(digits.images / 16.0, dtype=torch.float32)[:, None]
    y = torch.tensor(digits.target)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.25, random_state=args.seed)

    model = DigitsCNN()
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    algorithm = LAGS(args.density, merge_threshold=args.merge_threshold)
    plan = plan_buckets(algorithm, [n for n, _ in named], [p.numel() for _, p in named])
    backend = get_backend("torch")
    engines = [Engine(algorithm, backend, rank, args.workers) for rank in range(args.workers)]
    group = LocalGroup(args.workers, backend)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * args.workers, momentum=0.9)
    monitor = AssumptionMonitor(args.density)
    shards = [(x_train[r::args.workers], y_train[r::args.workers]) for r in range(args.workers)]
    generator = torch.Generator().manual_seed(args.seed)
    steps = min(len(s[0]) for s in shards) // args.batch_size
    if args.max_steps:
        steps = min(steps, args.max_steps)

    report = {"model": "digits CNN", "parameters": sum(p.numel() for _, p in named),
              "workers": args.workers, "density": args.density, "merge_threshold": args.merge_threshold,
              "randk": "expected", "measured_on": "each worker's accumulated vector g + e, per layer",
              "layers": [n for n, _ in named], "epochs": []}
    print(f"{args.workers} workers, {report['parameters']} parameters, {len(plan)} LAGS groups, "
          f"density {args.density}", flush=True)
    for epoch in range(1, args.epochs + 1):
        orders = [torch.randperm(len(s[0]), generator=generator) for s in shards]
        losses = []
        for step in range(steps):
            losses += train_step(model, named, shards, orders, step, args.batch_size,
                                 (plan, engines, group, monitor))
            optimizer.step()
        measured = monitor.delta()
        deltas = {n: measured[n] for n, _ in named}  # parameter order
        monitor.reset()
        accuracy = evaluate(model, x_test, y_test)
        report["epochs"].append({"epoch": epoch, "loss": float(np.mean(losses)), "test_accuracy": accuracy,
                                 "delta": deltas, "max_delta": max(deltas.values())})
        print(f"epoch {epoch}: loss {np.mean(losses):.4f}  test accuracy {accuracy:.3f}  delta per layer: "
              + "  ".join(f"{n}={d:.4f}" for n, d in deltas.items()), flush=True)

    report["holds"] = all(e["max_delta"] <= 1.0 for e in report["epochs"])
    report["plot"] = args.plot if args.plot and plot(report, args.plot) else None
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"assumption delta <= 1 on every layer and epoch: {report['holds']}; report: {args.out}"
          + (f", plot: {report['plot']}" if report["plot"] else ""), flush=True)


if __name__ == "__main__":
    main()
