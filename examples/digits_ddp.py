"""Data-parallel training of a small CNN on scikit-learn's digits with PyTorch DDP and a sparsifier
as its communication hook.

    torchrun --standalone --nproc_per_node=2 examples/digits_ddp.py [--method exdyna --density 0.01]
    torchrun --standalone --nproc_per_node=NGPUS examples/digits_ddp.py --device cuda   # NCCL

The only change from dense DDP training is ``register_comm_hook``. Every epoch prints the loss,
the test accuracy, the achieved density and the bytes this rank sent compared with a dense
allreduce. Exits non-zero if the ranks' weights diverge or the model fails to learn.
"""

from __future__ import annotations

import argparse
import os

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch.nn.parallel import DistributedDataParallel

import hvd_sparse
import hvd_sparse.torch.ddp as ddp
from hvd_sparse.sim.tasks import DigitsCNN


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--method", default="topk", choices=hvd_sparse.available())
    parser.add_argument("--density", type=float, default=0.01)
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--min-accuracy", type=float, default=0.85)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="cpu: Gloo; cuda: NCCL, one GPU per rank")
    args = parser.parse_args()

    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    device = torch.device(args.device)
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    digits = load_digits()
    x = torch.tensor(digits.images / 16.0, dtype=torch.float32)[:, None]
    y = torch.tensor(digits.target)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.25, random_state=0)
    shard = slice(rank, None, size)                       # each rank its own part of the data
    x_train, y_train = x_train[shard].to(device), y_train[shard].to(device)
    x_test, y_test = x_test.to(device), y_test.to(device)

    model = DigitsCNN().to(device)
    numel = sum(p.numel() for p in model.parameters())
    state = hvd_sparse.create(args.method, framework="ddp", density=args.density,
                              named_parameters=model.named_parameters())
    wrapped = DistributedDataParallel(model)              # broadcasts rank 0's weights
    wrapped.register_comm_hook(state, ddp.hook)
    # A compressor with a momentum correction (DGC's by default) holds the momentum itself.
    momentum = 0.0 if state.algorithm.corrections.momentum else 0.9
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=args.lr * size, momentum=momentum)
    if rank == 0:
        print(f"{size} ranks, {numel} parameters, {state!r}", flush=True)

    generator = torch.Generator().manual_seed(rank)   # the order of the batches, on the host
    steps = len(x_train) // args.batch_size
    for epoch in range(args.epochs):
        wrapped.train()
        order = torch.randperm(len(x_train), generator=generator)
        losses, density, sent = [], [], 0
        for step in range(steps):
            batch = order[step * args.batch_size:(step + 1) * args.batch_size].to(device)
            optimizer.zero_grad()
            loss = F.cross_entropy(wrapped(x_train[batch]), y_train[batch])
            loss.backward()                                # the hook exchanges the gradients
            optimizer.step()
            stats = state.stats()
            losses.append(loss.item())
            density.append(stats["density_actual"])
            sent += stats["bytes_sent"]
        wrapped.eval()
        with torch.no_grad():
            accuracy = (model(x_test).argmax(1) == y_test).float().mean().item()
        mean_loss = torch.tensor(np.mean(losses), device=device)
        dist.all_reduce(mean_loss)
        if rank == 0:
            dense = steps * numel * 4
            print(f"epoch {epoch + 1:2d}  loss {mean_loss.item() / size:.4f}  test accuracy {accuracy:.3f}  "
                  f"density {np.mean(density):.4f} (target {args.density})  "
                  f"sent {sent / 1024:.1f} KiB = {sent / dense:.3f} x dense", flush=True)

    weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    everyone = [torch.empty_like(weights) for _ in range(size)]
    dist.all_gather(everyone, weights)
    if not all(torch.equal(w, weights) for w in everyone):
        raise SystemExit("ranks hold different weights: synchronization failed")
    if accuracy < args.min_accuracy:
        raise SystemExit(f"test accuracy {accuracy:.3f} below {args.min_accuracy}")
    if rank == 0:
        print(f"done: weights identical on all {size} ranks, test accuracy {accuracy:.3f}")
    # Let Gloo's threads let go of the last collectives' tensors before Python shuts down
    # (docs/ddp.md, "Limits").
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
