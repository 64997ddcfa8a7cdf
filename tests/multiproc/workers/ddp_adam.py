"""Worker: methods on the Adam path as DDP communication hooks (torchrun), checked on every rank and
step as workers/torch_adam.py checks them under Horovod: the optimizer (hvd_sparse.torch.optim.AdamW,
linked through the state's ``optimizer=``) applied what the hook delivered as AdamW applies its own
update, bit for bit; every bucket as adam_checks.py says; identical weights
(``CHECKED ddp/<config>``). Then a checkpoint of state, optimizer and model resumed bit for bit
(``CHECKED ddp/resume``). Run by tests/multiproc/test_ddp.py.
"""

from __future__ import annotations

import io

import numpy as np
import torch
import torch.distributed as dist
from adam_checks import by_tensor, check_adam_bucket
from checks import check_identical
from ddp_common import BUCKET_CAP_MB, RawGradients, allgather_rows, finish, flat, init, make_model
from torch.nn.parallel import DistributedDataParallel

import hvd_sparse.torch as hs
import hvd_sparse.torch.ddp as ddp
from hvd_sparse.engine.planning import plan_buckets

STEPS, DENSE, DENSITY, LR, DECAY = 7, 2, 0.1, 0.01, 0.01
CONFIGS = {
    "exdyna": ("ExDyna", {"threshold_scaling": "tracking", "dense_below": 30}, None),
    "deft": ("DEFT", {}, None),
    "lags": ("LAGS", {"merge_threshold": 500}, "topk"),
    "topk": ("TopK", {}, "topk"),
    "dgc": ("DGC", {"scope": "model"}, None),
    "exdyna/shared-v": ("ExDyna", {"threshold_scaling": "tracking", "dense_below": 30,
                                   "second_moment_refresh": 2}, None),
}


def build(method: str, options: dict):
    model = make_model()
    named = list(model.named_parameters())
    adamw = hs.optim.AdamW(model.parameters(), lr=LR, weight_decay=DECAY)
    state = getattr(ddp, method)(DENSITY, named_parameters=named, optimizer=adamw, dense_steps=DENSE,
                                 **options)
    wrapped = DistributedDataParallel(model, bucket_cap_mb=BUCKET_CAP_MB)
    wrapped.register_comm_hook(state, ddp.hook)
    return model, wrapped, named, state, adamw


def batch(generator: torch.Generator, rank: int):
    x = torch.randn(12, 16, generator=generator) * (1 + rank)
    return x, torch.randint(0, 5, (12,), generator=generator)


def step(model, wrapped, named, adamw, x, y, label: str) -> dict:
    """Backward through DDP, then the optimizer: every parameter moved by p (1 - lr wd) - lr
    delivered, bit for bit. Returns what the hook delivered."""
    adamw.zero_grad()
    torch.nn.functional.cross_entropy(wrapped(x), y).backward()
    delivered = {n: p.grad.detach().clone() for n, p in named}
    before = {n: p.detach().clone() for n, p in named}
    adamw.step()
    for n, p in named:
        expected = before[n].mul(1.0 - LR * DECAY).add(delivered[n], alpha=-LR)
        assert torch.equal(p.detach(), expected), f"{label}: {n} was not moved by the delivered update"
    return delivered


def run(label: str, method: str, options: dict, kind: str | None, rank: int) -> None:
    model, wrapped, named, state, adamw = build(method, options)
    names, sizes = [n for n, _ in named], [p.numel() for _, p in named]
    plan = plan_buckets(state.algorithm, names, sizes)
    gradients = RawGradients(named)
    generator = torch.Generator().manual_seed(1000 + rank)
    for at in range(STEPS):
        x, y = batch(generator, rank)
        old = by_tensor(state.state_dict()["buckets"])
        delivered = step(model, wrapped, named, adamw, x, y, f"{label} step {at}")
        raw = gradients.take()
        new = by_tensor(state.state_dict()["buckets"])
        for bucket, members in plan:
            check_adam_bucket(rank, at, state.algorithm, kind, flat(raw, members), flat(delivered, members),
                              old.get(bucket), new[bucket], [sizes[names.index(m)] for m in members],
                              lambda vector, _name: allgather_rows(vector),
                              f"{label} step {at} bucket {bucket}")
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()
    check_identical(allgather_rows(params), f"{label} parameters")
    density = state.stats()["density_actual"]
    state.close()
    print(f"CHECKED ddp/{label} rank={rank} density={density:.4f}", flush=True)


def resume(rank: int) -> None:
    """8 steps, checkpointed after 4 (state, optimizer, model); a new model, optimizer and state
    loaded from it apply the same updates, bit for bit."""
    generator = torch.Generator().manual_seed(2000 + rank)
    data = [batch(generator, rank) for _ in range(8)]

    def train(parts, steps):
        model, wrapped, named, _, adamw = parts
        delivered = [step(model, wrapped, named, adamw, x, y, "resume") for x, y in steps]
        return [torch.cat([v.reshape(-1) for v in d.values()]).numpy().copy() for d in delivered]

    first = build("ExDyna", {"threshold_scaling": "tracking"})
    train(first, data[:4])
    saved = io.BytesIO()
    torch.save({"state": first[3].state_dict(), "optimizer": first[4].state_dict(),
                "model": first[0].state_dict()}, saved)
    straight = train(first, data[4:])
    first[3].close()
    second = build("ExDyna", {"threshold_scaling": "tracking"})
    saved.seek(0)
    checkpoint = torch.load(saved, weights_only=False)
    second[0].load_state_dict(checkpoint["model"])
    second[4].load_state_dict(checkpoint["optimizer"])
    second[3].load_state_dict(checkpoint["state"])
    resumed = train(second, data[4:])
    for at, (a, b) in enumerate(zip(straight, resumed, strict=True)):
        np.testing.assert_array_equal(b, a, err_msg=f"resume: step {4 + at} differs")
    second[3].close()
    print(f"CHECKED ddp/resume rank={rank}", flush=True)


def main() -> None:
    rank, size = init()
    for label, (method, options, kind) in CONFIGS.items():
        run(label, method, options, kind, rank)
    resume(rank)
    assert dist.get_world_size() == size
    finish(rank, size)


if __name__ == "__main__":
    main()
