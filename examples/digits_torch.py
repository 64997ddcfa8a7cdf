"""Data-parallel training of a small CNN on scikit-learn's digits with sparsified gradients.

    horovodrun --gloo -np 2 -H localhost:2 python examples/digits_torch.py [--method topk --density 0.01]
    horovodrun --gloo -np 2 -H localhost:2 python examples/digits_torch.py --method exdyna \\
        --option threshold_scaling=tracking --compare-dense          # what `make demo` runs

The only change from dense Horovod training is the ``compression=`` argument. Every epoch prints
the loss, the test accuracy, the achieved density and the bytes this rank sent compared with a
dense allreduce. ``--compare-dense`` then trains the same job densely (Horovod's own allreduce,
same data and seeds) and prints both results side by side. Exits non-zero if the ranks' weights
diverge or the sparsified model fails to learn.
"""

from __future__ import annotations

import argparse
import ast
import time

import horovod.torch as hvd
import numpy as np
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import hvd_sparse
from hvd_sparse.sim.tasks import DigitsCNN


def option(text: str) -> tuple[str, object]:
    """``KEY=VALUE`` of ``--option``: VALUE as a Python literal where it reads as one."""
    key, _, value = text.partition("=")
    try:
        return key, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return key, value


def load_shard() -> tuple[torch.Tensor, ...]:
    """This rank's part of the training set, and the whole test set."""
    digits = load_digits()
    x = torch.tensor(digits.images / 16.0, dtype=torch.float32)[:, None]
    y = torch.tensor(digits.target)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.25, random_state=0)
    shard = slice(hvd.rank(), None, hvd.size())          # each rank its own part of the data
    return x_train[shard], y_train[shard], x_test, y_test


def train(args: argparse.Namespace, data: tuple[torch.Tensor, ...], sparse: bool) -> dict:
    """One training run, sparsified with ``args.method`` or dense; returns what it reached."""
    x_train, y_train, x_test, y_test = data
    torch.manual_seed(0)
    model = DigitsCNN()
    named = list(model.named_parameters())
    numel = sum(p.numel() for _, p in named)
    compression = (hvd_sparse.create(args.method, framework="torch", density=args.density,
                                     named_parameters=named, **dict(args.option)) if sparse else None)
    # A compressor with a momentum correction (DGC's by default) holds the momentum itself.
    momentum = 0.0 if compression is not None and compression.algorithm.corrections.momentum else 0.9
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=momentum),
        named_parameters=named, **({"compression": compression} if sparse else {}))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    if hvd.rank() == 0:
        print(f"{hvd.size()} ranks, {numel} parameters, {compression!r}" if sparse
              else f"dense, {hvd.size()} ranks, {numel} parameters (Horovod's allreduce)", flush=True)
    generator = torch.Generator().manual_seed(hvd.rank())
    steps = len(x_train) // args.batch_size
    sent_total, started = 0, time.perf_counter()
    for epoch in range(args.epochs):
        model.train()
        order = torch.randperm(len(x_train), generator=generator)
        losses, density, sent = [], [], 0
        for step in range(steps):
            batch = order[step * args.batch_size:(step + 1) * args.batch_size]
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x_train[batch]), y_train[batch])
            loss.backward()
            optimizer.step()
            stats = compression.stats() if sparse else {"density_actual": 1.0, "bytes_sent": numel * 4}
            losses.append(loss.item())
            density.append(stats["density_actual"])
            sent += stats["bytes_sent"]
        sent_total += sent
        model.eval()
        with torch.no_grad():
            accuracy = (model(x_test).argmax(1) == y_test).float().mean().item()
        mean_loss = hvd.allreduce(torch.tensor(np.mean(losses)), name="demo.loss").item()
        if hvd.rank() == 0:
            dense = steps * numel * 4
            print(f"epoch {epoch + 1:2d}  loss {mean_loss:.4f}  test accuracy {accuracy:.3f}  "
                  f"density {np.mean(density):.4f}{f' (target {args.density})' if sparse else ''}  "
                  f"sent {sent / 1024:.1f} KiB = {sent / dense:.3f} x dense", flush=True)
    weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    everyone = hvd.allgather(weights[None], name=f"demo.weights.{int(sparse)}")
    if not bool((everyone == everyone[0]).all()):
        raise SystemExit("ranks hold different weights: synchronization failed")
    return {"accuracy": accuracy, "sent": sent_total, "seconds": time.perf_counter() - started}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--method", default="topk", choices=hvd_sparse.available())
    parser.add_argument("--density", type=float, default=0.01)
    parser.add_argument("--option", type=option, action="append", default=[], metavar="KEY=VALUE",
                        help="a method option, e.g. threshold_scaling=tracking (repeatable)")
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--min-accuracy", type=float, default=0.85)
    parser.add_argument("--compare-dense", action="store_true",
                        help="then train the same job densely and print both side by side")
    args = parser.parse_args()

    hvd.init()
    data = load_shard()
    ours = train(args, data, sparse=True)
    if ours["accuracy"] < args.min_accuracy:
        raise SystemExit(f"test accuracy {ours['accuracy']:.3f} below {args.min_accuracy}")
    if hvd.rank() == 0:
        print(f"done: weights identical on all {hvd.size()} ranks, test accuracy {ours['accuracy']:.3f}",
              flush=True)
    if args.compare_dense:
        dense = train(args, data, sparse=False)
        if hvd.rank() == 0:
            print(f"{args.method}: test accuracy {ours['accuracy']:.3f}, sent {ours['sent'] / 2**20:.2f} MiB "
                  f"per rank ({ours['sent'] / dense['sent']:.3f} x dense), {ours['seconds']:.1f} s\n"
                  f"dense: test accuracy {dense['accuracy']:.3f}, sent {dense['sent'] / 2**20:.2f} MiB "
                  f"per rank, {dense['seconds']:.1f} s (loopback: communication is cheap here)")


if __name__ == "__main__":
    main()
