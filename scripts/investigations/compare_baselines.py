"""Train the same small CNN on scikit-learn's digits with each sparsifier and print one table.

    horovodrun --gloo -np 2 -H localhost:2 python scripts/investigations/compare_baselines.py [--density 0.01]

Every method runs from the same initial weights and data order, with plain SGD (momentum 0.9
for every method except DGC, whose momentum correction already is the momentum: it gets SGD
without momentum and ``momentum=0.9`` inside). Per method the table gives the final test
accuracy, the mean achieved density (aggregated distinct entries / entries, averaged over ranks
and steps), the mean build-up (union / k), the bytes this rank sent relative to a dense
allreduce of fp32 values, and the mean selection time per step. The figures are measured on this
machine and this tiny model; they show the methods' behaviour (density control, build-up), not
the speed a GPU cluster would see.
"""

from __future__ import annotations

import argparse
import time

import horovod.torch as hvd
import numpy as np
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import hvd_sparse
from hvd_sparse.sim.tasks import DigitsCNN

METHODS = {
    "dense": None,
    "topk": {},
    "topk-union": {"pattern": "union"},
    "randomk": {},
    "randomk-shared": {"shared_seed": True},
    "threshold": {},
    "gaussiank": {},
    "dgc": {"momentum": 0.9},
}


def train(method: str, args, data) -> dict:
    x_train, y_train, x_test, y_test = data
    torch.manual_seed(0)
    model = DigitsCNN()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    named = list(model.named_parameters())
    numel = sum(p.numel() for _, p in named)
    options = METHODS[method]
    compression = hvd.Compression.none
    if options is not None:
        name = method.split("-")[0]
        compression = hvd_sparse.create(name, framework="torch", density=args.density,
                                        named_parameters=named, prefix=f"cmp.{method}", **options)
    momentum = 0.0 if method == "dgc" else 0.9
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=momentum),
        named_parameters=named, compression=compression)
    generator = torch.Generator().manual_seed(hvd.rank())
    steps = len(x_train) // args.batch_size
    density, buildup, sent, select = [], [], 0, 0.0
    started = time.perf_counter()
    for _ in range(args.epochs):
        order = torch.randperm(len(x_train), generator=generator)
        model.train()
        for step in range(steps):
            batch = order[step * args.batch_size:(step + 1) * args.batch_size]
            optimizer.zero_grad()
            F.cross_entropy(model(x_train[batch]), y_train[batch]).backward()
            optimizer.step()
            if options is not None:
                stats = compression.stats()
                density.append(stats["density_actual"])
                buildup.append(stats["buildup"])
                sent += stats["bytes_sent"]
                select += stats["select_seconds"]
    seconds = time.perf_counter() - started
    model.eval()
    with torch.no_grad():
        accuracy = (model(x_test).argmax(1) == y_test).float().mean().item()
    total_steps = args.epochs * steps
    row = {
        "accuracy": accuracy,
        "density": float(np.mean(density)) if density else 1.0,
        "buildup": float(np.mean(buildup)) if buildup else float("nan"),
        "sent_vs_dense": sent / (total_steps * numel * 4) if options is not None else 1.0,
        "select_ms": 1000 * select / total_steps,
        "seconds": seconds,
    }
    keys = sorted(row)
    mean = hvd.allreduce(torch.tensor([row[k] for k in keys], dtype=torch.float64), op=hvd.Average,
                         name=f"cmp.{method}.row")
    return dict(zip(keys, mean.tolist(), strict=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--density", type=float, default=0.01)
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--methods", default=",".join(METHODS))
    args = parser.parse_args()

    hvd.init()
    digits = load_digits()
    x = torch.tensor(digits.images / 16.0, dtype=torch.float32)[:, None]
    y = torch.tensor(digits.target)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.25, random_state=0)
    shard = slice(hvd.rank(), None, hvd.size())
    data = (x_train[shard], y_train[shard], x_test, y_test)
    rows = {method: train(method, args, data) for method in args.methods.split(",")}
    if hvd.rank() == 0:
        print(f"\n{hvd.size()} ranks, density {args.density}, {args.epochs} epochs (means over ranks)\n")
        print("| method | test accuracy | achieved density | build-up | bytes sent / dense | "
              "selection ms/step | wall s |")
        print("|---|---|---|---|---|---|---|")
        for method, r in rows.items():
            print(f"| {method} | {r['accuracy']:.3f} | {r['density']:.4f} | {r['buildup']:.2f} | "
                  f"{r['sent_vs_dense']:.4f} | {r['select_ms']:.2f} | {r['seconds']:.1f} |")


if __name__ == "__main__":
    main()
