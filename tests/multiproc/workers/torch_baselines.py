"""Worker: the baseline sparsifiers through stock horovod.torch, checked every step, then every
error a user can cause, on every rank.

Run by tests/multiproc/test_horovod_baselines.py under horovodrun. For each configuration it
trains a small MLP for STEPS steps and, after every step, checks on every rank the applied
gradient and the residual against a reference built from every rank's allgathered vectors
(baseline_checks.py), and at the end that all ranks hold identical parameters. Then it provokes
each refused input and prints ``REFUSED <what> rank=<r>`` where every rank raised; the job ends
with a collective, so a rank left hanging would fail the run. ``argv[1]``: a directory for the
statistics log.
"""

from __future__ import annotations

import math
import os
import sys

import horovod.torch as hvd
import numpy as np
import torch
from baseline_checks import check_step, cleared, threshold_selection, topk_indices
from checks import by_tensor, check_identical
from torch_common import RawGradients

import hvd_sparse
import hvd_sparse.torch as hs
from hvd_sparse import ConfigurationError, UnsupportedTensorError
from hvd_sparse.monitor import StatsLogger, average_rows
from tests.reference.engine import expected_step

STEPS = 12
LOG_DIR = sys.argv[1] if len(sys.argv) > 1 else "."


def allgather_rows(vector: np.ndarray, name: str) -> np.ndarray:
    return hvd.allgather(torch.from_numpy(np.ascontiguousarray(vector, dtype=np.float32))[None],
                         name=name).numpy()


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 24), torch.nn.Tanh(), torch.nn.Linear(24, 5))


def flat(tensors: dict, names: list[str]) -> np.ndarray:
    return torch.cat([tensors[n].reshape(-1) for n in names]).numpy()


def run(label: str, make_compressor, check, *, dtype=torch.float32, bpps: int = 1,
        steps_per_epoch: int | None = None, nan_step: int | None = None, logger_every: int | None = None):
    """Train STEPS steps; after each, ``check(step, key, accs, residuals, applied, old, new)`` on
    every bucket, with ``accs`` what every rank sparsified (gradient + residual, or for DGC the
    velocity the check computes itself from ``old``)."""
    model = make_model()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)  # Horovod cannot broadcast bf16
    model = model.to(dtype)
    named = list(model.named_parameters())
    compressor = make_compressor(named, f"hs.{label}")
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         named_parameters=named, compression=compressor,
                                         backward_passes_per_step=bpps)
    scope = compressor.algorithm.scope
    buckets = ([("model", [n for n, _ in named])] if scope == "model" else [(n, [n]) for n, _ in named])
    generator = torch.Generator().manual_seed(1000 + hvd.rank())
    gradients = RawGradients(named)
    logger = None if logger_every is None else StatsLogger(
        compressor, every=logger_every, keys=("density_actual", "buildup", "selected"),
        jsonl=os.path.join(LOG_DIR, "torch_stats.jsonl"))
    for step in range(STEPS):
        if steps_per_epoch:
            compressor.set_epoch(step // steps_per_epoch)
        old = by_tensor(compressor.state_dict()["buckets"])
        optimizer.zero_grad()
        for _ in range(bpps):
            x = torch.randn(12, 16, generator=generator)
            y = torch.randint(0, 5, (12,), generator=generator)
            if step == nan_step and hvd.rank() == 1:
                x[0, 0] = float("nan")
            loss = torch.nn.functional.cross_entropy(model(x.to(dtype)).float(), y)
            loss.backward()
        raw = {n: g.float() for n, g in gradients.take().items()}
        optimizer.step()
        applied = {n: p.grad.detach().float().clone() for n, p in named}
        new = by_tensor(compressor.state_dict()["buckets"])
        for key, names in buckets:
            check(step, key, flat(raw, names), flat(applied, names), old.get(key), new[key],
                  f"{label} step {step} bucket {key}")
        if logger is not None:
            logger(step)
    stats = compressor.stats()
    assert stats["step"] == STEPS, stats  # compression once per communication round
    params = torch.cat([p.detach().float().reshape(-1) for p in model.parameters()]).numpy()
    check_identical(allgather_rows(params, f"test.{label}.params"), f"{label} parameters")
    print(f"CHECKED torch/{label} rank={hvd.rank()} density={stats['density_actual']:.4f} "
          f"buildup={stats['buildup']:.3f}", flush=True)
    return compressor


def gathered(step, key, label, acc, new):
    """Every rank's accumulated vector and new residual (two allgathers)."""
    accs = allgather_rows(acc, f"test.{label}.acc")
    residuals = allgather_rows(new["residual"], f"test.{label}.res")
    return accs, residuals


def plain_acc(raw, old):
    return raw + (old["residual"] if old is not None else 0)


# --- per-method checks ------------------------------------------------------------------------------
def check_randomk(k_of, shared: bool):
    def check(step, key, raw, applied, old, new, label):
        accs, residuals = gathered(step, key, label, plain_acc(raw, old), new)
        sent = cleared(accs, residuals)
        k = k_of(raw.size)
        assert all(s.size == k for s in sent), (label, [s.size for s in sent], k)
        if shared:
            assert all(np.array_equal(s, sent[0]) for s in sent), f"{label}: ranks drew different indices"
        elif hvd.size() > 1 and raw.size > 20:
            assert not np.array_equal(sent[0], sent[1]), f"{label}: independent draws coincide"
        check_step(hvd.rank(), accs, residuals, applied, sent, "gather", label)
    return check


def check_threshold(density: float, lam: float | None, pattern: str):
    def check(step, key, raw, applied, old, new, label):
        accs, residuals = gathered(step, key, label, plain_acc(raw, old), new)
        threshold = lam if lam is not None else 1 / (2 * math.sqrt(max(1, int(density * raw.size))))
        selections = [threshold_selection(acc, threshold, step) for acc in accs]
        check_step(hvd.rank(), accs, residuals, applied, selections, pattern, label)
    return check


def check_cleared():
    """Gaussian-k: what was sent is read off the residuals; at least one entry each."""
    def check(step, key, raw, applied, old, new, label):
        accs, residuals = gathered(step, key, label, plain_acc(raw, old), new)
        sent = cleared(accs, residuals)
        assert all(s.size >= 1 for s in sent), label
        check_step(hvd.rank(), accs, residuals, applied, sent, "gather", label)
    return check


def check_dgc(density: float, momentum: float, clip_norm: float, warmup_epochs: int, steps_per_epoch: int):
    """Momentum correction, clipping, masking and the warm-up k, against a NumPy re-computation."""
    from tests.reference.dgc import dgc_density

    def check(step, key, raw, applied, old, new, label):
        u = np.zeros_like(raw) if old is None or old["momentum"] is None \
            else old["momentum"]
        v = np.zeros_like(raw) if old is None else old["residual"]
        limit = clip_norm / math.sqrt(hvd.size())
        coefficient = limit / (float(np.linalg.norm(raw.astype(np.float64))) + 1e-6)
        grad = raw * np.float32(coefficient) if coefficient < 1 else raw
        u = u * np.float32(momentum) + grad
        accs, residuals = gathered(step, key, label, v + u, new)
        sent = cleared(accs, residuals)
        k = math.ceil(raw.size * dgc_density(density, warmup_epochs, step // steps_per_epoch))
        assert all(1 <= s.size <= min(k, raw.size) for s in sent), (label, [s.size for s in sent], k)
        check_step(hvd.rank(), accs, residuals, applied, sent, "gather", label, exact=False)
        u[sent[hvd.rank()]] = 0
        np.testing.assert_allclose(new["momentum"], u, rtol=1e-5, atol=1e-7,
                                   err_msg=f"{label}: momentum buffer differs (correction or masking)")
        if new["control"] is not None:   # a bucket of its own; packed, the sent sizes bound k above
            assert new["control"]["k"] == k, (label, new["control"]["k"], k)
    return check


def check_topk(density: float):
    """Top-k, checked exactly; a rank whose gradient is not finite must have sent zeros and kept
    its residual (nonfinite="skip")."""
    def check(step, key, raw, applied, old, new, label):
        old_residual = old["residual"] if old is not None else np.zeros_like(raw)
        finite = bool(np.isfinite(raw).all())
        acc = old_residual + raw if finite else np.zeros_like(raw)
        accs, residuals = gathered(step, key, label, acc, new)
        selections = [topk_indices(a, max(1, int(density * raw.size))) for a in accs]
        if finite:
            check_step(hvd.rank(), accs, residuals, applied, selections, "gather", label)
        else:
            average, _, _ = expected_step(list(accs), selections, "gather")
            np.testing.assert_allclose(applied, average, rtol=1e-5, atol=1e-7, err_msg=label)
            np.testing.assert_array_equal(new["residual"], old_residual,
                                          err_msg=f"{label}: a skipped rank's residual moved")
            print(f"SKIPPED {label} rank={hvd.rank()}", flush=True)
    return check


def check_low_precision(dtype_name: str, density: float):
    """fp16 (values travel in fp16, the rounding stays in the fp32 residual) and bf16 (values
    travel in fp32): the sent entries are where the residual changed."""
    def check(step, key, raw, applied, old, new, label):
        acc = plain_acc(raw, old)
        accs = allgather_rows(acc, f"test.{label}.acc")
        residuals = allgather_rows(new["residual"], f"test.{label}.res")
        k = max(1, int(density * raw.size))
        sent = [np.flatnonzero(res != a) for a, res in zip(accs, residuals, strict=True)]
        assert all(s.size <= k for s in sent), (label, [s.size for s in sent], k)
        wire = np.float16 if dtype_name == "float16" else np.float32
        total = np.zeros(raw.size)
        for a, s in zip(accs, sent, strict=True):
            total[s] += a[s].astype(wire).astype(np.float64)
        expected = (total / hvd.size()).astype(np.float32)
        tolerance = 1e-2 if dtype_name == "bfloat16" else 2e-3  # the gradient's own precision
        np.testing.assert_allclose(applied, expected, rtol=tolerance, atol=tolerance * np.abs(expected).max(),
                                   err_msg=label)
        mine = sent[hvd.rank()]
        np.testing.assert_array_equal(
            residuals[hvd.rank()][mine] + accs[hvd.rank()][mine].astype(wire).astype(np.float32),
            accs[hvd.rank()][mine], err_msg=f"{label}: rounding error lost")
    return check


# --- errors -------------------------------------------------------------------------------------------
def expect_refusal(what: str, action, error: type, fragment: str) -> None:
    try:
        action()
    except error as raised:
        assert fragment in str(raised), f"{what}: unexpected message {raised}"
        print(f"REFUSED {what} rank={hvd.rank()}: {type(raised).__name__}: {raised}", flush=True)
        return
    raise AssertionError(f"{what}: no error was raised")


def backward_with(op=hvd.Average, complex_param: bool = False):
    def action():
        model = make_model()
        params = list(model.named_parameters())
        if complex_param:
            extra = torch.nn.Parameter(torch.randn(4, dtype=torch.complex64))
            params.append(("extra", extra))
        optimizer = hvd.DistributedOptimizer(
            torch.optim.SGD([p for _, p in params], lr=0.1), named_parameters=params, op=op,
            compression=hs.TopK(0.1, named_parameters=params, prefix=f"err.{op}.{complex_param}"))
        out = model(torch.randn(4, 16)).sum()
        if complex_param:
            out = out + (params[-1][1].abs() ** 2).sum()
        out.backward()
        optimizer.step()
    return action


def nonfinite_raise():
    torch.manual_seed(0)
    layer = torch.nn.Linear(8, 1)
    named = list(layer.named_parameters())
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(layer.parameters(), lr=0.1), named_parameters=named,
        compression=hs.TopK(0.5, named_parameters=named, nonfinite="raise", prefix="err.nan"))
    x = torch.ones(2, 8)
    if hvd.rank() == 0:
        x[0, 0] = float("inf")
    layer(x).sum().backward()
    optimizer.step()


def main() -> None:
    hvd.init()
    rank, size = hvd.rank(), hvd.size()

    def named(cls, **options):
        return lambda params, prefix: cls(named_parameters=params, prefix=prefix, **options)

    run("randomk/tensor/gather", named(hs.RandomK, density=0.1, seed=1),
        check_randomk(lambda n: max(1, int(0.1 * n)), shared=False))
    compressor = run(
        "randomk/model/shared",
        lambda params, prefix: hvd_sparse.create("randomk", framework="torch", density=0.1, seed=2,
                                                 shared_seed=True, scope="model",
                                                 named_parameters=params, prefix=prefix),
        check_randomk(lambda n: max(1, int(0.1 * n)), shared=True))
    keys = ("density_actual", "buildup", "bytes_sent", "residual_norm")
    mine = compressor.stats()
    averaged = compressor.average_stats(keys)
    everyone = hvd.allgather_object(mine, name="test.stats.rows")
    expected = average_rows(everyone, keys)
    assert all(math.isclose(averaged[k], expected[k], rel_tol=1e-9) for k in keys), (averaged, expected)
    print(f"AVERAGED rank={rank} {averaged}", flush=True)

    run("threshold/model/gather", named(hs.Threshold, density=0.05),
        check_threshold(0.05, None, "gather"), logger_every=4)
    run("threshold/tensor/union", named(hs.Threshold, threshold=0.02, scope="tensor", pattern="union"),
        check_threshold(0.01, 0.02, "union"))
    run("gaussiank/tensor/gather", named(hs.GaussianK, density=0.1), check_cleared())
    run("dgc/tensor/gather", named(hs.DGC, density=0.1, momentum=0.9, clip_norm=1.0, warmup_epochs=2),
        check_dgc(0.1, 0.9, 1.0, 2, 4), steps_per_epoch=4)
    run("topk/bpps2", named(hs.TopK, density=0.1), check_topk(0.1), bpps=2)
    run("topk/float16", named(hs.TopK, density=0.1), check_low_precision("float16", 0.1),
        dtype=torch.float16)
    run("topk/bfloat16", named(hs.TopK, density=0.1), check_low_precision("bfloat16", 0.1),
        dtype=torch.bfloat16)
    run("topk/nan-skip", named(hs.TopK, density=0.1), check_topk(0.1), nan_step=3)

    expect_refusal("adasum", backward_with(op=hvd.Adasum), ConfigurationError, "op=hvd.Adasum")
    expect_refusal("sum", backward_with(op=hvd.Sum), ConfigurationError, "op=hvd.Sum")
    expect_refusal("complex", backward_with(complex_param=True), UnsupportedTensorError, "complex64")
    expect_refusal("nan-raise", nonfinite_raise, FloatingPointError, "raised on every rank")
    total = hvd.allreduce(torch.ones(1), op=hvd.Sum, name="test.final").item()
    assert total == size
    print(f"PASSED rank={rank} size={size}", flush=True)


if __name__ == "__main__":
    main()
