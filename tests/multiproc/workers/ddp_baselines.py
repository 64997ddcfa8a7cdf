"""Worker: the per-tensor and baseline methods as DDP communication hooks, checked every step;
the torch.distributed driver against the local one; statistics; checkpoints; every refusal.

Run by tests/multiproc/test_ddp.py under torchrun. ``argv[1]``: a directory for the statistics
log and the checkpoint files; ``argv[2]`` == "resume": instead of training from scratch, load
the ExDyna checkpoint another job wrote there (at another world size) and train on, checked.
Prints ``CHECKED ddp/<config>``, ``REFUSED <what> rank=<r>`` where every rank raised the same
error, and ends with a collective (a rank left behind fails the job).
"""

from __future__ import annotations

import math
import sys
from collections import OrderedDict
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from baseline_checks import check_step, cleared, threshold_selection, topk_indices
from checks import check_exclusive_step, check_topk_step
from ddp_common import allgather_rows, finish, init, make_model, outcome, run
from torch.nn.parallel import DistributedDataParallel

import hvd_sparse
import hvd_sparse.torch.ddp as ddp
from hvd_sparse.comm import ALLGATHER, ALLREDUCE, BROADCAST, NEIGHBOURS, Collective
from hvd_sparse.comm.local import LocalGroup
from hvd_sparse.comm.torch_distributed import TorchDistributedComm
from hvd_sparse.monitor import StatsLogger, average_rows
from tests.reference.dgc import dgc_density
from tests.reference.engine import expected_step

OUT = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(".")
RANK = SIZE = 0


def acc_of(raw, old):
    return (raw + (old["residual"] if old is not None else 0)).astype(np.float32)


def gathered(raw, old, new):
    return allgather_rows(acc_of(raw, old)), allgather_rows(new["residual"].astype(np.float32))


# --- per-method checks (as in the Horovod workers, on torch.distributed) ------------------------------
def check_topk(density: float, pattern: str = "gather", dense_steps: int = 0):
    """Exact top-k; a rank whose gradient is not finite must have sent zeros and kept its
    residual; during ``dense_steps`` everything is averaged."""
    def check(step, bucket, raw, applied, old, new, stats, label):
        old_residual = old["residual"] if old is not None else np.zeros_like(raw)
        finite = bool(np.isfinite(raw).all())
        accs = allgather_rows(old_residual + raw if finite else np.zeros_like(raw))
        if step < dense_steps:
            np.testing.assert_allclose(applied, accs.astype(np.float64).mean(axis=0), rtol=1e-5,
                                       atol=1e-7, err_msg=label)
            assert not new["residual"].any(), f"{label}: a dense step left a residual"
        elif finite:
            check_topk_step(RANK, accs, applied, new["residual"], density, pattern, label)
        else:
            selections = [topk_indices(a, max(1, int(density * raw.size))) for a in accs]
            average, _, _ = expected_step(list(accs), selections, pattern)
            np.testing.assert_allclose(applied, average, rtol=1e-5, atol=1e-7, err_msg=label)
            np.testing.assert_array_equal(new["residual"], old_residual,
                                          err_msg=f"{label}: a skipped rank's residual moved")
            print(f"SKIPPED {label} rank={RANK}", flush=True)
    return check


def check_randomk(density: float, shared: bool):
    def check(step, bucket, raw, applied, old, new, stats, label):
        accs, residuals = gathered(raw, old, new)
        sent = cleared(accs, residuals)
        k = max(1, int(density * raw.size))
        assert all(s.size == k for s in sent), (label, [s.size for s in sent], k)
        if shared:
            assert all(np.array_equal(s, sent[0]) for s in sent), f"{label}: ranks drew different indices"
        check_step(RANK, accs, residuals, applied, sent, "gather", label)
    return check


def check_threshold(density: float, pattern: str):
    def check(step, bucket, raw, applied, old, new, stats, label):
        accs, residuals = gathered(raw, old, new)
        lam = 1 / (2 * math.sqrt(max(1, int(density * raw.size))))
        selections = [threshold_selection(acc, lam, step) for acc in accs]
        check_step(RANK, accs, residuals, applied, selections, pattern, label)
    return check


def check_cleared(step, bucket, raw, applied, old, new, stats, label):
    """Gaussian-k: what was sent is read off the residuals; at least one entry each."""
    accs, residuals = gathered(raw, old, new)
    sent = cleared(accs, residuals)
    assert all(s.size >= 1 for s in sent), label
    check_step(RANK, accs, residuals, applied, sent, "gather", label)


def check_dgc(density, momentum, clip_norm, warmup_epochs, steps_per_epoch):
    """Momentum correction, clipping, masking and the warm-up k, against a NumPy re-computation."""
    def check(step, bucket, raw, applied, old, new, stats, label):
        u = np.zeros_like(raw) if old is None or old["momentum"] is None else old["momentum"]
        v = np.zeros_like(raw) if old is None else old["residual"]
        coefficient = clip_norm / math.sqrt(SIZE) / (float(np.linalg.norm(raw.astype(np.float64))) + 1e-6)
        grad = raw * np.float32(coefficient) if coefficient < 1 else raw
        u = u * np.float32(momentum) + grad
        accs = allgather_rows((v + u).astype(np.float32))
        residuals = allgather_rows(new["residual"])
        sent = cleared(accs, residuals)
        k = math.ceil(raw.size * dgc_density(density, warmup_epochs, step // steps_per_epoch))
        assert all(1 <= s.size <= min(k, raw.size) for s in sent), (label, [s.size for s in sent], k)
        check_step(RANK, accs, residuals, applied, sent, "gather", label, exact=False)
        u[sent[RANK]] = 0
        np.testing.assert_allclose(new["momentum"], u, rtol=1e-5, atol=1e-7,
                                   err_msg=f"{label}: momentum buffer differs (correction or masking)")
    return check


def check_low_precision(dtype_name: str, density: float):
    """fp16 values travel in fp16 (the rounding stays in the fp32 residual), bf16 in fp32."""
    def check(step, bucket, raw, applied, old, new, stats, label):
        accs, residuals = gathered(raw, old, new)
        k = max(1, int(density * raw.size))
        sent = [np.flatnonzero(res != a) for a, res in zip(accs, residuals, strict=True)]
        assert all(s.size <= k for s in sent), (label, [s.size for s in sent], k)
        wire = np.float16 if dtype_name == "float16" else np.float32
        total = np.zeros(raw.size)
        for a, s in zip(accs, sent, strict=True):
            total[s] += a[s].astype(wire).astype(np.float64)
        expected = (total / SIZE).astype(np.float32)
        tolerance = 1e-2 if dtype_name == "bfloat16" else 2e-3
        np.testing.assert_allclose(applied, expected, rtol=tolerance,
                                   atol=tolerance * np.abs(expected).max(), err_msg=label)
    return check


def check_exclusive(step, bucket, raw, applied, old, new, stats, label):
    """ExDyna re-derived; the fallback index rotates with the state's step counter, which a
    resumed run carries over."""
    accs = allgather_rows(acc_of(raw, old))
    views = allgather_rows(np.array([*stats["own_partition"], stats["threshold"]], dtype=np.float64))
    check_exclusive_step(RANK, accs, views, applied, new["residual"], stats["step"] - 1, label)


def named(cls, **options):
    return lambda params: cls(named_parameters=params, **options)


# --- the driver against the local one -----------------------------------------------------------------
def driver_phase(rank: int, size: int) -> list:
    """One phase of every kind of collective, rank ``rank``'s part: allgathers of lengths that
    differ per rank (zero on some), of fp16 rows and of bytes, an exact int64 allreduce, a
    broadcast from the last rank, a neighbour exchange."""
    rng = np.random.default_rng(rank)
    n = [3, 0, 5, 1][rank % 4]
    return [Collective(ALLGATHER, "a", torch.arange(n, dtype=torch.int32) + 10 * rank),
            Collective(ALLGATHER, "b", torch.full((rank + 1, 3), rank + 0.5, dtype=torch.float16)),
            Collective(ALLGATHER, "c", torch.tensor(list(b"rank%d" % rank), dtype=torch.uint8)),
            Collective(ALLREDUCE, "d", torch.from_numpy(rng.integers(-9, 9, 5))),
            Collective(BROADCAST, "e", torch.tensor([rank, rank + 1.0]), root=size - 1),
            Collective(NEIGHBOURS, "f", torch.tensor([rank * 1.0, -rank]))]


def check_driver() -> None:
    comm = TorchDistributedComm(dist.new_group(list(range(SIZE))))
    mine = comm.execute(driver_phase(RANK, SIZE))
    local = LocalGroup(SIZE, "torch")
    expected = local._execute([driver_phase(r, SIZE) for r in range(SIZE)])[RANK]
    for got, want, c in zip(mine, expected, driver_phase(RANK, SIZE), strict=True):
        pairs = zip(got, want, strict=True) if c.op == NEIGHBOURS else [(got, want)]
        for g, w in pairs:
            assert g.dtype == w.dtype and torch.equal(g, w), (c.name, g, w)
    print(f"CHECKED ddp/driver rank={RANK}", flush=True)


# --- refusals -----------------------------------------------------------------------------------------
def one_step(state, model=None, x=None) -> None:
    model = model or make_model()
    wrapped = DistributedDataParallel(model)
    wrapped.register_comm_hook(state, ddp.hook)
    wrapped(torch.ones(2, 16) if x is None else x).sum().backward()


def renamed_model() -> torch.nn.Module:
    """The same shapes as make_model(), under other parameter names."""
    torch.manual_seed(0)
    return torch.nn.Sequential(OrderedDict(first=torch.nn.Linear(16, 24), a=torch.nn.Tanh(),
                                           second=torch.nn.Linear(24, 24), b=torch.nn.Tanh(),
                                           third=torch.nn.Linear(24, 5)))


def expect_everywhere(what: str, body, fragments: tuple[str, ...]) -> None:
    """Every rank raised, with the same message naming every fragment."""
    outcomes = outcome(what, body)
    kinds = {kind for kind, _ in outcomes}
    assert "ok" not in kinds, f"{what}: not refused on every rank: {outcomes}"
    messages = {message for _, message in outcomes}
    assert len(messages) == 1, f"{what}: ranks raised different errors: {outcomes}"
    message = messages.pop()
    for fragment in fragments:
        assert fragment in message, f"{what}: {fragment!r} not in {message!r}"
    print(f"REFUSED {what} rank={RANK}: {message.splitlines()[0]}", flush=True)


def refusals() -> None:
    expect_everywhere("density", lambda: one_step(ddp.ExDyna(0.02 if RANK == 1 else 0.01)),
                      ("RankMismatchError", "density=0.01 on rank 0, 0.02 on rank 1"))
    expect_everywhere("method", lambda: one_step(ddp.TopK(0.01) if RANK == 1 else ddp.ExDyna(0.01)),
                      ("RankMismatchError", "rank 0 runs 'exdyna', ranks [1] run 'topk'"))

    def other_model():
        model = renamed_model() if RANK == SIZE - 1 else make_model()
        one_step(ddp.DEFT(0.05, named_parameters=model.named_parameters()), model)
    expect_everywhere("model", other_model, ("RankMismatchError", "every rank must train the same model",
                                             "only on rank"))

    def nonfinite():
        state = ddp.TopK(0.5, nonfinite="raise")
        model = make_model()
        wrapped = DistributedDataParallel(model)
        wrapped.register_comm_hook(state, ddp.hook)
        bad = torch.ones(2, 16)
        if RANK == 0:
            bad[0, 0] = float("inf")
        try:
            wrapped(bad).sum().backward()
        finally:   # the job goes on after it: one more step, on every rank
            wrapped.zero_grad()
            wrapped(torch.ones(2, 16)).sum().backward()
            assert state.stats()["step"] == 1
    expect_everywhere("nan-raise", nonfinite, ("FloatingPointError", "raised on every rank",
                                               "skip optimizer.step()"))


# --- checkpoints --------------------------------------------------------------------------------------
def checkpoint_run(resume: bool) -> None:
    """Train ExDyna and save it, one file per rank; or, in a job at another world size, load the
    file of rank r % old size and train on, checked."""
    def make_state(params):
        state = ddp.ExDyna(0.05, named_parameters=params)
        if resume:
            old_size = len(list(OUT.glob("exdyna.rank*.pt")))
            saved = torch.load(OUT / f"exdyna.rank{RANK % old_size}.pt", weights_only=False)
            assert saved["size"] != SIZE
            state.load_state_dict(saved)
        return state
    state, _ = run("exdyna/resumed" if resume else "exdyna/saved", make_state, check_exclusive,
                   steps=4, resumed_at=4 if resume else 0)
    if not resume:
        torch.save(state.state_dict(), OUT / f"exdyna.rank{RANK}.pt")


def main() -> None:
    global RANK, SIZE
    RANK, SIZE = init()
    if len(sys.argv) > 2 and sys.argv[2] == "resume":
        checkpoint_run(resume=True)
        finish(RANK, SIZE)
        return
    check_driver()
    for scope in ("tensor", "model"):
        for pattern in ("gather", "union"):
            run(f"topk/{scope}/{pattern}", named(ddp.TopK, density=0.05, scope=scope, pattern=pattern),
                check_topk(0.05, pattern))
    state, _ = run("randomk/tensor/gather", named(ddp.RandomK, density=0.1, seed=1),
                   check_randomk(0.1, False))
    run("randomk/model/shared",
        lambda params: hvd_sparse.create("randomk", framework="ddp", density=0.1, seed=2, shared_seed=True,
                                         scope="model", named_parameters=params),
        check_randomk(0.1, True))
    keys = ("density_actual", "buildup", "bytes_sent", "residual_norm")
    averaged = state.average_stats(keys)
    everyone = [None] * SIZE
    dist.all_gather_object(everyone, state.stats())
    expected = average_rows(everyone, keys)
    assert all(math.isclose(averaged[k], expected[k], rel_tol=1e-9) for k in keys), (averaged, expected)
    logger = StatsLogger(state, every=1, keys=keys, jsonl=OUT / "ddp_stats.jsonl", stdout=False)
    logger(0)
    print(f"AVERAGED rank={RANK} {averaged}", flush=True)
    run("threshold/model/gather", named(ddp.Threshold, density=0.05), check_threshold(0.05, "gather"))
    run("gaussiank/tensor/gather", named(ddp.GaussianK, density=0.1), check_cleared)
    run("dgc/tensor/gather", named(ddp.DGC, density=0.1, momentum=0.9, clip_norm=1.0, warmup_epochs=2),
        check_dgc(0.1, 0.9, 1.0, 2, 4), steps_per_epoch=4)
    run("topk/dense_steps", named(ddp.TopK, density=0.05, dense_steps=3), check_topk(0.05, dense_steps=3))
    run("topk/float16", named(ddp.TopK, density=0.1), check_low_precision("float16", 0.1),
        dtype=torch.float16)
    run("topk/bfloat16", named(ddp.TopK, density=0.1), check_low_precision("bfloat16", 0.1),
        dtype=torch.bfloat16)
    run("topk/nan-skip", named(ddp.TopK, density=0.1), check_topk(0.1), nan_step=3)
    run("topk/find_unused", named(ddp.TopK, density=0.1, scope="model"), check_topk(0.1),
        find_unused_parameters=True)
    refusals()
    checkpoint_run(resume=False)
    finish(RANK, SIZE)


if __name__ == "__main__":
    main()
