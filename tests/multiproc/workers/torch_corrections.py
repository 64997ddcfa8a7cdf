"""Worker: every method with the corrections (momentum, nesterov, dense_steps, warmup_steps,
dense_below) through stock horovod.torch, checked on every rank and every step; then a
checkpoint resume with momentum, both non-finite policies with momentum, and the warning about a
second momentum in the optimizer.

Run by tests/multiproc/test_horovod_corrections.py. Each configuration of ``CONFIGS`` trains a
three-layer MLP for ``STEPS`` steps with plain SGD (the momentum is in the compressor) and, after
every step, checks every bucket on every rank (correction_checks.py): the applied gradient
against the average of every rank's accumulated vector where it sent, exact error feedback, the
velocity masked where sent, the step's target density; at the end, identical parameters
(``CHECKED torch/<config> rank=<r>``). Across them the configurations cover every method, the
gather, union and shared patterns and the tensor, model and LAGS group scopes. Then:

* ``resume/<method>``: a run checkpointed (through ``torch.save``) after 4 of 8 steps and
  resumed by a new model, optimizer and compressor at the same world size applies bit for bit
  the same gradients and ends with the same residuals and velocities;
* ``nonfinite/<config>``: ``nonfinite="raise"`` with a NaN in one tensor on rank 1: every rank
  raises, and every bucket (those that finished their step included) has its step counter back
  as before the step, and its residual and velocity as before (rank 1's poisoned bucket) or
  holding all it accumulated, the velocity unmasked (nothing sent); training goes on to identical
  weights;
* ``warning``: an optimizer with momentum under a compressor with momentum warns once, and one
  without momentum (or a compressor without) does not.

``SKIPPED <config> step <s>`` marks the steps where rank 1's gradient was not finite
(``nonfinite="skip"``: it sent zeros and kept its residual and velocity bit for bit).
"""

from __future__ import annotations

import io
import math
import warnings

import horovod.torch as hvd
import numpy as np
import torch
from checks import by_tensor, check_identical
from correction_checks import check_corrected_bucket, check_raised, target_density
from torch_common import RawGradients, allgather_rows

import hvd_sparse.torch as hs
from hvd_sparse.engine.planning import plan_buckets

STEPS = 8
DENSITY = 0.1
SMALL = 30   # dense_below: the biases (24, 24 and 5 entries) are averaged densely

# label -> (method, options, how the selection is re-derived: "topk", "threshold", or None: read
# off the residuals; "shared": read off, and every rank must have sent the same k entries)
CONFIGS = {
    "topk/tensor/gather": ("TopK", {"momentum": 0.9, "dense_steps": 2, "warmup_steps": 3}, "topk"),
    "topk/model/union": ("TopK", {"scope": "model", "pattern": "union", "momentum": 0.9, "nesterov": True,
                                  "dense_below": SMALL}, "topk"),
    "randomk/model/shared": ("RandomK", {"scope": "model", "shared_seed": True, "seed": 2, "momentum": 0.9,
                                         "warmup_steps": 3, "dense_below": SMALL}, "shared"),
    "threshold/tensor/union": ("Threshold", {"scope": "tensor", "pattern": "union", "momentum": 0.9,
                                             "nesterov": True, "warmup_steps": 3}, "threshold"),
    "gaussiank/tensor/gather": ("GaussianK", {"momentum": 0.9, "dense_steps": 1, "dense_below": SMALL}, None),
    "dgc/model/gather": ("DGC", {"scope": "model", "nesterov": True, "warmup_steps": 3,
                                 "dense_below": SMALL}, None),
    "lags/groups/gather": ("LAGS", {"merge_threshold": 500, "momentum": 0.9, "warmup_steps": 3,
                                    "dense_below": SMALL}, "topk"),
    "exdyna/model/union": ("ExDyna", {"momentum": 0.9, "nesterov": True, "dense_steps": 2, "warmup_steps": 3,
                                      "dense_below": SMALL}, None),
    "micro/model/union": ("MiCRO", {"momentum": 0.9, "warmup_steps": 3}, None),
    "deft/model/union": ("DEFT", {"momentum": 0.9, "dense_steps": 1, "dense_below": SMALL}, None),
}
NAN_STEP = {"lags/groups/gather": 5, "exdyna/model/union": 6}   # rank 1's input is NaN there


def make_model() -> torch.nn.Module:
    """16 -> 24 -> 24 -> 5 (tanh): tensors of 384, 24, 576, 24, 120 and 5 entries."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 24), torch.nn.Tanh(), torch.nn.Linear(24, 24),
                                torch.nn.Tanh(), torch.nn.Linear(24, 5))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    return model


def flat(tensors: dict, names: list[str]) -> np.ndarray:
    return torch.cat([tensors[n].reshape(-1) for n in names]).numpy().astype(np.float32)


def batches(steps: int, nan_step: int | None = None) -> list:
    generator = torch.Generator().manual_seed(1000 + hvd.rank())
    out = []
    for step in range(steps):
        x = torch.randn(12, 16, generator=generator)
        if step == nan_step and hvd.rank() == 1:
            x[0, 0] = float("nan")
        out.append((x, torch.randint(0, 5, (12,), generator=generator)))
    return out


def params_of(model: torch.nn.Module) -> np.ndarray:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()


def check_plan(plan: list, names: list[str], sizes: list[int], below: int, label: str) -> None:
    """Tensors under ``dense_below`` entries sit in buckets of their own (one named "dense_below"
    in whole-model and grouped scopes, one each per tensor) and nowhere else."""
    small = {n for n, s in zip(names, sizes, strict=True) if s < below}
    for bucket, members in plan:
        inside = set(members) & small
        assert not inside or set(members) <= small, f"{label}: bucket {bucket} mixes {members}"
    assert sorted(m for _, ms in plan for m in ms) == sorted(names), f"{label}: plan {plan}"


def run(label: str, method: str, options: dict, kind: str | None) -> None:
    model = make_model()
    named = list(model.named_parameters())
    compressor = getattr(hs, method)(DENSITY, named_parameters=named, prefix=f"hs.{label}", **options)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         named_parameters=named, compression=compressor)
    algorithm, rank = compressor.algorithm, hvd.rank()
    corrections = algorithm.corrections
    names, sizes = [n for n, _ in named], [p.numel() for _, p in named]
    plan = plan_buckets(algorithm, names, sizes)
    check_plan(plan, names, sizes, corrections.dense_below, label)
    gradients = RawGradients(named)
    nan_step = NAN_STEP.get(label)
    for step, (x, y) in enumerate(batches(STEPS, nan_step)):
        old = by_tensor(compressor.state_dict()["buckets"])
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        raw = gradients.take()
        optimizer.step()
        applied = {n: p.grad.detach().clone() for n, p in named}
        new = by_tensor(compressor.state_dict()["buckets"])
        assert sorted(new) == sorted(b for b, _ in plan), (label, sorted(new), plan)
        density = target_density(DENSITY, corrections.dense_steps, corrections.warmup_steps, step)
        reported = compressor.stats()["density_target"]
        assert math.isclose(reported, density, rel_tol=1e-12), (label, step, reported, density)
        for bucket, members in plan:
            where = f"{label} step {step} bucket {bucket}"
            if not check_corrected_bucket(rank, step, algorithm, kind, flat(raw, members),
                                          flat(applied, members), old.get(bucket), new[bucket],
                                          [sizes[names.index(m)] for m in members], allgather_rows, where):
                print(f"SKIPPED {label} step {step} rank={rank}", flush=True)
    stats = compressor.stats()
    assert stats["step"] == STEPS, (label, stats["step"])
    check_identical(allgather_rows(params_of(model), f"test.{label}.params"), f"{label} parameters")
    print(f"CHECKED torch/{label} rank={rank} density={stats['density_actual']:.4f} "
          f"buckets={len(plan)}", flush=True)


# --- a checkpoint resume with momentum ---------------------------------------------------------------
def resume(label: str, method: str, options: dict) -> None:
    """8 steps in one go, checkpointed after 4; a new model, optimizer and compressor resumed from
    the checkpoint (same world size) must apply the same gradients, bit for bit."""
    data = batches(STEPS)
    first = STEPS // 2

    def build(prefix):
        model = make_model()
        named = list(model.named_parameters())
        compressor = getattr(hs, method)(DENSITY, named_parameters=named, prefix=prefix, **options)
        optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                             named_parameters=named, compression=compressor)
        return model, compressor, optimizer

    def train(model, optimizer, steps):
        applied = []
        for x, y in steps:
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
            grads = [p.grad.detach().reshape(-1) for p in model.parameters()]
            applied.append(torch.cat(grads).numpy().copy())
        return applied

    model, compressor, optimizer = build(f"hs.resume.{label}.a")
    train(model, optimizer, data[:first])
    saved = io.BytesIO()
    torch.save({"compression": compressor.state_dict(), "model": model.state_dict(),
                "optimizer": optimizer.state_dict()}, saved)
    assert all(b["momentum"] is not None for b in compressor.state_dict()["buckets"].values()), label
    straight = train(model, optimizer, data[first:])
    end = compressor.state_dict()

    model, compressor, optimizer = build(f"hs.resume.{label}.b")
    saved.seek(0)
    checkpoint = torch.load(saved, weights_only=False)
    model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    compressor.load_state_dict(checkpoint["compression"])
    resumed = train(model, optimizer, data[first:])
    for step, (a, b) in enumerate(zip(straight, resumed, strict=True)):
        np.testing.assert_array_equal(b, a, err_msg=f"resume/{label}: step {first + step} differs")
    again = compressor.state_dict()
    for key, bucket in end["buckets"].items():
        assert again["buckets"][key]["step"] == bucket["step"] == STEPS, (label, key)
        for field in ("residual", "momentum"):
            np.testing.assert_array_equal(again["buckets"][key][field], bucket[field],
                                          err_msg=f"resume/{label}: {key} {field}")
    check_identical(allgather_rows(params_of(model), f"test.resume.{label}"), f"resume/{label}")
    print(f"CHECKED resume/{label} rank={hvd.rank()}", flush=True)


# --- nonfinite="raise" with momentum -----------------------------------------------------------------
def nonfinite_raise(label: str, method: str, options: dict) -> None:
    """A NaN in the first layer's weight gradient on rank 1 at step 2: every rank raises; every
    bucket (those that finished their step and took it back included) has its step counter and
    velocity as before, and its residual as before or holding everything accumulated
    (``check_raised``); training goes on to identical weights."""
    model = make_model()
    named = list(model.named_parameters())
    compressor = getattr(hs, method)(DENSITY, named_parameters=named, nonfinite="raise",
                                     prefix=f"hs.nf.{label}", **options)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         named_parameters=named, compression=compressor)
    poison = {"on": False}
    model[0].weight.register_hook(lambda g: g * float("nan") if poison["on"] else g)
    gradients = RawGradients(named)   # after the poison: what the compressor is handed
    names, sizes = [n for n, _ in named], [p.numel() for _, p in named]
    plan = plan_buckets(compressor.algorithm, names, sizes)
    corrections = compressor.algorithm.corrections
    raised = 0
    for step, (x, y) in enumerate(batches(6)):
        poison["on"] = step == 2 and hvd.rank() == 1
        before = by_tensor(compressor.state_dict()["buckets"])
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        raw = gradients.take()
        try:
            optimizer.step()
        except FloatingPointError as error:
            assert "applied nowhere" in str(error), error
            raised += 1
            raws = {bucket: flat(raw, members) for bucket, members in plan}
            buckets = compressor.state_dict()["buckets"]
            packed_with = {m: saved["members"] for saved in buckets.values()
                           for m in saved.get("members") or ()}
            check_raised(before, by_tensor(buckets), raws, corrections.momentum, corrections.nesterov,
                         f"nonfinite/{label} step {step}", packed_with)
            optimizer.load_state_dict(optimizer.state_dict())   # docs/usage.md#non-finite-gradients
    assert raised == 1, (label, raised)
    assert compressor.stats()["step"] == 5, compressor.stats()["step"]
    check_identical(allgather_rows(params_of(model), f"test.nf.{label}"), f"nonfinite/{label}")
    print(f"CHECKED nonfinite/{label} rank={hvd.rank()}", flush=True)


# --- a second momentum --------------------------------------------------------------------------------
def momentum_warnings() -> None:
    """Each case: (optimizer, compressor options, warnings expected over three steps)."""
    cases = [
        (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), {"momentum": 0.9}, 1),
        (lambda ps: torch.optim.Adam(ps, lr=0.01), {"momentum": 0.9, "nesterov": True}, 1),
        (lambda ps: torch.optim.SGD(ps, lr=0.1), {"momentum": 0.9}, 0),
        (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), {}, 0),
    ]
    for case, (make_optimizer, options, expected) in enumerate(cases):
        model = make_model()
        named = list(model.named_parameters())
        compressor = hs.TopK(DENSITY, named_parameters=named, prefix=f"hs.warn{case}", **options)
        optimizer = hvd.DistributedOptimizer(make_optimizer(model.parameters()), named_parameters=named,
                                             compression=compressor)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for x, y in batches(3):
                optimizer.zero_grad()
                torch.nn.functional.cross_entropy(model(x), y).backward()
                optimizer.step()
        seen = [w for w in caught if "momentum twice" in str(w.message)]
        assert len(seen) == expected, (case, [str(w.message) for w in seen])
        assert all(issubclass(w.category, RuntimeWarning) for w in seen), [w.category for w in seen]
    print(f"CHECKED warning rank={hvd.rank()}", flush=True)


def main() -> None:
    hvd.init()
    torch.set_num_threads(1)
    rank, size = hvd.rank(), hvd.size()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="hvd_sparse: non-finite gradient")
        for label, (method, options, kind) in CONFIGS.items():
            run(label, method, options, kind)
    resume("exdyna", "ExDyna", {"momentum": 0.9, "nesterov": True, "warmup_steps": 6, "dense_below": SMALL})
    resume("lags", "LAGS", {"merge_threshold": 500, "momentum": 0.9, "dense_steps": 1, "warmup_steps": 6,
                            "dense_below": SMALL})
    nonfinite_raise("exdyna", "ExDyna", {"momentum": 0.9, "dense_below": SMALL})
    nonfinite_raise("topk-tensor", "TopK", {"momentum": 0.9, "nesterov": True, "dense_below": SMALL})
    momentum_warnings()
    total = hvd.allreduce(torch.ones(1), op=hvd.Sum, name="test.final").item()
    assert total == size
    print(f"PASSED rank={rank} size={size}", flush=True)


if __name__ == "__main__":
    main()
