"""Every method as a DDP communication hook on CUDA tensors over NCCL: the GPU check of the DDP face
(scripts/gpu_check.sh runs it; one rank per GPU, so one rank on a machine with one GPU).

    torchrun --standalone --nproc_per_node=NGPUS scripts/workers/ddp_cuda_check.py [--methods exdyna topk]

Per method, a small MLP on synthetic data trains through DistributedDataParallel for ``--steps``
steps with the hook. Checked on every rank and step: error feedback loses nothing, what each
rank sent (its local gradient, from an undistributed copy of the model, plus its last residual
less its new one) sums over ranks to the applied average times the world size, up to float32
rounding; the
weights stay finite and identical on every rank, and the loss falls. Needs no data set, no
Horovod and no network: what a lent GPU machine has. Exits non-zero on the first failure.
"""

from __future__ import annotations

import argparse
import copy
import os

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import hvd_sparse
import hvd_sparse.torch.ddp as ddp


def residuals(state: ddp.SparseHookState, names: list[str]) -> dict[str, np.ndarray]:
    """This rank's residual per parameter name, cut out of the engine's buckets (flat vectors of
    their members in plan order)."""
    found: dict[str, np.ndarray] = {}
    for key, bucket in state.state_dict()["buckets"].items():
        flat, offset = bucket["residual"], 0
        for name, shape in zip(state._members[key], bucket["shapes"], strict=True):  # the plan's members
            size = int(np.prod(shape))
            found[name] = flat[offset:offset + size].reshape(shape)
            offset += size
    return {name: found.get(name, 0.0) for name in names}


def check_method(method: str, steps: int, device: torch.device, rank: int, size: int) -> None:
    torch.manual_seed(0)
    layers = [torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10)]
    model = torch.nn.Sequential(*layers).to(device)
    local = copy.deepcopy(model)                 # the same weights, no communication: raw gradients
    names = [name for name, _ in model.named_parameters()]
    # No momentum correction (DGC's default is 0.9): the check reads error feedback alone.
    state = hvd_sparse.create(method, framework="ddp", density=0.05, momentum=0.0,
                              named_parameters=model.named_parameters())
    wrapped = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    wrapped.register_comm_hook(state, ddp.hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    teacher = torch.Generator().manual_seed(1)
    target = torch.randn(64, 10, generator=teacher).to(device)
    data = torch.Generator().manual_seed(100 + rank)
    losses, before = [], {name: 0.0 for name in names}
    for step in range(steps):
        x = torch.randn(32, 64, generator=data).to(device)
        y = (x @ target).argmax(1)
        local.load_state_dict(model.state_dict())
        torch.nn.functional.cross_entropy(local(x), y).backward()
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(wrapped(x), y)
        loss.backward()
        after = residuals(state, names)
        for (name, param), raw in zip(model.named_parameters(), local.parameters(), strict=True):
            # What this rank sent is what it accumulated less what it kept; the ranks' sends sum to
            # the applied average times the world size.
            sent = torch.from_numpy(raw.grad.double().cpu().numpy() + before[name] - after[name]).to(device)
            dist.all_reduce(sent)
            applied = param.grad.double() * size
            if not torch.allclose(applied, sent, rtol=1e-5, atol=1e-6):
                gap = (applied - sent).abs().max().item()
                raise AssertionError(f"{method} step {step} {name}: the ranks' sends do not sum to the "
                                     f"applied average (largest gap {gap:.3g})")
        local.zero_grad()
        optimizer.step()
        before = after
        losses.append(loss.item())
    weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    everyone = [torch.empty_like(weights) for _ in range(size)]
    dist.all_gather(everyone, weights)
    if not bool(torch.isfinite(weights).all()) or not all(torch.equal(w, weights) for w in everyone):
        raise AssertionError(f"{method}: weights not finite or not identical on every rank")
    if np.mean(losses[-5:]) >= np.mean(losses[:5]):
        first, last = np.mean(losses[:5]), np.mean(losses[-5:])
        raise AssertionError(f"{method}: the loss did not fall ({first:.3f} -> {last:.3f})")
    stats = state.stats()
    if rank == 0:
        print(f"CHECKED ddp-cuda/{method}: loss {losses[0]:.3f} -> {losses[-1]:.3f}, density "
              f"{stats['density_actual']:.4f}, {stats['bytes_sent']} bytes sent last step", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--methods", nargs="+", default=hvd_sparse.available())
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                        help="cpu: the same check on Gloo (to try the script without a GPU)")
    args = parser.parse_args()
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cpu")
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    for method in args.methods:
        check_method(method, args.steps, device, rank, size)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
