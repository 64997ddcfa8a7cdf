"""Worker: every method on the Adam path through stock horovod.torch, checked on every rank and
step; then a checkpoint resume, ``nonfinite="raise"``, a learning-rate schedule, bfloat16
parameters, and the warning about torch's AdamW stepping without the path.

Run by tests/multiproc/test_horovod_adam.py. Each configuration of ``CONFIGS`` trains a three-layer
MLP for ``STEPS`` steps with ``hvd_sparse.torch.optim.AdamW`` linked through ``optimizer=`` and
wrapped in ``hvd.DistributedOptimizer``. After every step, on every rank: the optimizer applied
what ``decompress`` delivered as AdamW applies its own update, p <- p (1 - lr wd) - lr delivered, bit
for bit; every bucket as adam_checks.py says (Adam of the average during the dense steps; exact
error feedback on the rank's own Adam update afterwards); at the end identical parameters
(``CHECKED torch/<config> rank=<r>``). Then:

* ``resume``: a run checkpointed (torch.save: model, optimizer, compressor) after 4 of 8 steps and
  resumed by a new model, optimizer and compressor applies the same updates bit for bit;
* ``nonfinite``: ``nonfinite="raise"`` with a NaN on rank 1 in a dense step and in a sparse one:
  every rank raises, the step is applied nowhere (the moments of a finished dense bucket are taken
  back), and training goes on to identical weights;
* ``schedule``: a LambdaLR schedule on the Horovod optimizer halves the rate at step 4; every
  step applies the rate of its group then;
* ``bf16``: bfloat16 parameters (their gradients sparsified, fp32 residuals): applied as in
  bfloat16, identical weights;
* ``warning``: torch's AdamW under a compressor without ``optimizer=`` warns once, naming the fix;
  hvd_sparse's AdamW linked through ``optimizer=`` does not.
"""

from __future__ import annotations

import io
import warnings

import horovod.torch as hvd
import numpy as np
import torch
from adam_checks import by_tensor, check_adam_bucket
from checks import check_identical
from torch_common import RawGradients, allgather_rows

import hvd_sparse.torch as hs
from hvd_sparse.engine.planning import plan_buckets

STEPS = 7
DENSE = 2
DENSITY = 0.1
LR, DECAY = 0.01, 0.01
SMALL = 30   # dense_below: the biases (24, 24 and 5 entries)
CONFIGS = {
    "exdyna/model/union": ("ExDyna", {"threshold_scaling": "tracking", "dense_below": SMALL}, None),
    "micro/model/union": ("MiCRO", {}, None),
    "deft/model/union": ("DEFT", {"dense_below": SMALL}, None),
    "lags/groups/gather": ("LAGS", {"merge_threshold": 500}, "topk"),
    "topk/tensor/gather": ("TopK", {"warmup_steps": 2}, "topk"),
    "topk/model/union": ("TopK", {"scope": "model", "pattern": "union", "dense_below": SMALL}, "topk"),
    "dgc/model/gather": ("DGC", {"scope": "model"}, None),
    "randomk/model/shared": ("RandomK", {"scope": "model", "shared_seed": True, "seed": 2}, "shared"),
    "gaussiank/tensor/gather": ("GaussianK", {}, None),
    "threshold/tensor/union": ("Threshold", {"scope": "tensor", "pattern": "union"}, None),
    # the shared second moment, refreshed on steps 2, 4 and 6
    "exdyna/model/shared-v": ("ExDyna", {"threshold_scaling": "tracking", "dense_below": SMALL,
                                         "second_moment_refresh": 2}, None),
    "lags/groups/shared-v": ("LAGS", {"merge_threshold": 500, "second_moment_refresh": 2}, "topk"),
}


def make_model(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """16 -> 24 -> 24 -> 5 (tanh): tensors of 384, 24, 576, 24, 120 and 5 entries."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 24), torch.nn.Tanh(), torch.nn.Linear(24, 24),
                                torch.nn.Tanh(), torch.nn.Linear(24, 5))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)   # Horovod moves no bfloat16
    return model.to(dtype)


def batches(steps: int, nan_steps: tuple[int, ...] = ()) -> list:
    generator = torch.Generator().manual_seed(1000 + hvd.rank())
    out = []
    for step in range(steps):
        x = torch.randn(12, 16, generator=generator)
        if step in nan_steps and hvd.rank() == 1:
            x[0, 0] = float("nan")
        out.append((x, torch.randint(0, 5, (12,), generator=generator)))
    return out


def build(method: str, options: dict, prefix: str, dtype: torch.dtype = torch.float32, **face):
    model = make_model(dtype)
    named = list(model.named_parameters())
    adamw = hs.optim.AdamW(model.parameters(), lr=LR, weight_decay=DECAY)
    compressor = getattr(hs, method)(DENSITY, named_parameters=named, optimizer=adamw, prefix=prefix,
                                     dense_steps=DENSE, **options, **face)
    optimizer = hvd.DistributedOptimizer(adamw, named_parameters=named, compression=compressor)
    return model, named, compressor, optimizer


def flat(tensors: dict, names: list[str]) -> np.ndarray:
    return torch.cat([tensors[n].reshape(-1).float() for n in names]).numpy()


def params_of(model: torch.nn.Module) -> np.ndarray:
    return torch.cat([p.detach().reshape(-1).float() for p in model.parameters()]).numpy()


def step_and_check_applied(model, named, optimizer, x, y, label: str) -> dict:
    """One training step: backward, synchronize, the optimizer's step; checks that every
    parameter moved by p (1 - lr wd) - lr delivered, bit for bit. Returns what was delivered."""
    optimizer.zero_grad()
    torch.nn.functional.cross_entropy(model(x.to(next(model.parameters()).dtype)), y).backward()
    optimizer.synchronize()
    delivered = {n: p.grad.detach().clone() for n, p in named}
    before = {n: p.detach().clone() for n, p in named}
    lr = optimizer.param_groups[0]["lr"]
    with optimizer.skip_synchronize():
        optimizer.step()
    for n, p in named:
        expected = before[n].mul(1.0 - lr * DECAY).add(delivered[n].to(p.dtype), alpha=-lr)
        assert torch.equal(p.detach(), expected), f"{label}: {n} was not moved by the delivered update"
    return delivered


def run(label: str, method: str, options: dict, kind: str | None) -> None:
    model, named, compressor, optimizer = build(method, options, f"hs.{label}")
    algorithm, rank = compressor.algorithm, hvd.rank()
    names, sizes = [n for n, _ in named], [p.numel() for _, p in named]
    plan = plan_buckets(algorithm, names, sizes)
    gradients = RawGradients(named)
    for step, (x, y) in enumerate(batches(STEPS)):
        old = by_tensor(compressor.state_dict()["buckets"])
        delivered = step_and_check_applied(model, named, optimizer, x, y, f"{label} step {step}")
        raw = gradients.take()
        new = by_tensor(compressor.state_dict()["buckets"])
        for bucket, members in plan:
            check_adam_bucket(rank, step, algorithm, kind, flat(raw, members), flat(delivered, members),
                              old.get(bucket), new[bucket], [sizes[names.index(m)] for m in members],
                              allgather_rows, f"{label} step {step} bucket {bucket}")
    stats = compressor.stats()
    assert stats["step"] == STEPS and stats["dense_bytes_total"] > 0 and stats["bytes_sent_total"] > 0, label
    # the hard threshold's fixed λ is in the update's units here (lr): it sends nearly everything
    assert label.startswith("threshold") or stats["bytes_sent_total"] < stats["dense_bytes_total"], stats
    check_identical(allgather_rows(params_of(model), f"test.{label}.params"), f"{label} parameters")
    print(f"CHECKED torch/{label} rank={rank} density={stats['density_actual']:.4f} "
          f"bytes={stats['bytes_sent_total'] / stats['dense_bytes_total']:.3f}", flush=True)


def resume() -> None:
    """8 steps in one go, checkpointed after 4; a new model, optimizer and compressor resumed from
    the checkpoint must apply the same updates, bit for bit."""
    data, first = batches(8), 4

    def train(model, named, optimizer, steps):
        return [torch.cat([v.reshape(-1) for v in step_and_check_applied(
            model, named, optimizer, x, y, "resume").values()]).numpy().copy() for x, y in steps]

    method, options = "ExDyna", {"threshold_scaling": "tracking"}
    model, named, compressor, optimizer = build(method, options, "hs.resume.a")
    train(model, named, optimizer, data[:first])
    saved = io.BytesIO()
    torch.save({"compression": compressor.state_dict(), "model": model.state_dict(),
                "optimizer": optimizer.state_dict()}, saved)
    straight = train(model, named, optimizer, data[first:])
    model, named, compressor, optimizer = build(method, options, "hs.resume.b")
    saved.seek(0)
    checkpoint = torch.load(saved, weights_only=False)
    model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    compressor.load_state_dict(checkpoint["compression"])
    resumed = train(model, named, optimizer, data[first:])
    for step, (a, b) in enumerate(zip(straight, resumed, strict=True)):
        np.testing.assert_array_equal(b, a, err_msg=f"resume: step {first + step} differs")
    check_identical(allgather_rows(params_of(model), "test.resume"), "resume")
    print(f"CHECKED resume rank={hvd.rank()}", flush=True)


def nonfinite() -> None:
    """NaN on rank 1 at step 1 (dense) and step 4 (sparse), nonfinite="raise": every rank raises,
    nothing of the step is applied (parameters and compressor state as before), training goes on."""
    model, named, compressor, optimizer = build("TopK", {"dense_below": SMALL}, "hs.raise", nonfinite="raise")
    raised = []
    for step, (x, y) in enumerate(batches(STEPS, nan_steps=(1, 4))):
        before = {n: p.detach().clone() for n, p in named}
        state = compressor.state_dict()["buckets"]
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        try:
            optimizer.step()
        except FloatingPointError:
            raised.append(step)
            optimizer.load_state_dict(optimizer.state_dict())
            optimizer.zero_grad()
            assert all(torch.equal(p.detach(), before[n]) for n, p in named), f"step {step} moved weights"
            after = compressor.state_dict()["buckets"]
            for key, saved in state.items():
                assert after[key]["step"] == saved["step"], (step, key)
                if step < DENSE:   # the dense step's moments were taken back
                    for field in ("momentum", "second_moment"):
                        np.testing.assert_array_equal(after[key][field], saved[field],
                                                      err_msg=f"{key} {field}")
    assert raised == [1, 4], raised
    check_identical(allgather_rows(params_of(model), "test.raise"), "raise")
    print(f"CHECKED nonfinite rank={hvd.rank()} raised={raised}", flush=True)


def schedule() -> None:
    model, named, _, optimizer = build("TopK", {"scope": "model"}, "hs.schedule")
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 if step < 4 else 0.5)
    rates = []
    for x, y in batches(STEPS):
        rates.append(optimizer.param_groups[0]["lr"])
        step_and_check_applied(model, named, optimizer, x, y, "schedule")
        scheduler.step()
    assert rates == [LR] * 4 + [LR / 2] * 3, rates
    check_identical(allgather_rows(params_of(model), "test.schedule"), "schedule")
    print(f"CHECKED schedule rank={hvd.rank()}", flush=True)


def bf16() -> None:
    model, named, compressor, optimizer = build("ExDyna", {"threshold_scaling": "tracking"}, "hs.bf16",
                                                dtype=torch.bfloat16)
    for x, y in batches(STEPS):
        step_and_check_applied(model, named, optimizer, x, y, "bf16")
    assert compressor.stats()["step"] == STEPS
    assert all(b["residual"].dtype == np.float32 for b in compressor.state_dict()["buckets"].values())
    check_identical(allgather_rows(params_of(model), "test.bf16"), "bf16")
    print(f"CHECKED bf16 rank={hvd.rank()}", flush=True)


def warning() -> None:
    for stock, expected in ((True, 1), (False, 0)):
        model = make_model()
        named = list(model.named_parameters())
        cls = torch.optim.AdamW if stock else hs.optim.AdamW
        inner = cls(model.parameters(), lr=LR)
        compressor = hs.TopK(DENSITY, named_parameters=named, prefix=f"hs.warn.{stock}",
                             **({} if stock else {"optimizer": inner}))
        optimizer = hvd.DistributedOptimizer(inner, named_parameters=named, compression=compressor)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for x, y in batches(3):
                optimizer.zero_grad()
                torch.nn.functional.cross_entropy(model(x), y).backward()
                optimizer.step()
        about = [w for w in caught if "without the Adam path" in str(w.message)]
        assert len(about) == expected, (stock, [str(w.message) for w in caught])
        assert all("hvd_sparse.torch's Adam/AdamW" in str(w.message) and "optimizer=" in str(w.message)
                   for w in about)
    print(f"CHECKED warning rank={hvd.rank()}", flush=True)


def main() -> None:
    hvd.init()
    warnings.filterwarnings("ignore", message=".*non-finite gradient.*")
    for label, (method, options, kind) in CONFIGS.items():
        run(label, method, options, kind)
    resume()
    nonfinite()
    schedule()
    bf16()
    warning()
    print(f"PASSED rank={hvd.rank()} size={hvd.size()}", flush=True)


if __name__ == "__main__":
    main()
