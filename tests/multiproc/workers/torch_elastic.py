"""Elastic PyTorch job (horovodrun --min-np/--max-np with a discovery script): several methods
trained side by side, each model, optimizer and compressor in one hvd.elastic.TorchState, through
2 -> 3 ranks, a killed worker (3 -> 2, rolled back to the last commit) and 2 -> 1 ranks
(elastic_common.py). After every step, on every rank: identical weights, stats() at the new N,
identical step counters, no build-up for the exclusive methods. "topk-momentum" runs the momentum
correction (with a dense_below bucket per bias): after every step each process checks, from its
own raw gradient and its state before the step -- the last commit's after a reset, nothing for a
newcomer -- that the residual and the velocity went on exactly (correction_checks.py), so a reset
that dropped or mixed up a process's velocity or residual fails the job."""

from __future__ import annotations

import horovod.torch as hvd
import numpy as np
import torch
import torch.nn.functional as F
from checks import by_tensor
from correction_checks import accumulated
from elastic_common import (
    COMMIT_EVERY,
    END,
    N_HIDDEN,
    N_IN,
    N_OUT,
    Sizes,
    check_method,
    data,
    die,
    eval_data,
    is_victim,
    job_arguments,
    report_final,
    wait_a_little,
    world_change_due,
)
from torch_common import RawGradients, allgather_rows

import hvd_sparse.torch as hs

METHODS = {
    "exdyna": lambda named: hs.ExDyna(0.05, named_parameters=named, prefix="hs.exdyna"),
    "exdyna-histogram": lambda named: hs.ExDyna(0.05, rebalance="histogram", named_parameters=named,
                                                prefix="hs.exdyna-histogram"),
    "deft": lambda named: hs.DEFT(0.05, named_parameters=named, prefix="hs.deft"),
    "lags": lambda named: hs.LAGS(0.05, merge_threshold=200, named_parameters=named, prefix="hs.lags"),
    "topk-momentum": lambda named: hs.TopK(0.05, momentum=0.9, nesterov=True, dense_below=30,
                                           named_parameters=named, prefix="hs.topk-momentum"),
    "topk": lambda named: hs.TopK(0.05, named_parameters=named, prefix="hs.topk"),
}
EXCLUSIVE = ("exdyna", "exdyna-histogram", "deft")
LEARNING_RATE = {"topk-momentum": 0.2}   # with its momentum (0.9) in the update
CORRECTED = "topk-momentum"


def check_corrected(before: dict | None, after: dict, raw: dict, momentum: float, nesterov: bool,
                    dense_below: int) -> None:
    """This process's per-tensor buckets after a step: where the residual changed, it was cleared
    to zero (sent) and the velocity with it; elsewhere residual and velocity are what the
    correction makes of the state before the step (``before``: None for a process without one).
    Dense buckets (``dense_below``) send everything and keep the velocity. ``before`` and
    ``after`` are per tensor (``by_tensor``: the weights share a packed bucket, the biases a dense
    one)."""
    for key, new in after.items():
        old = None if before is None else before.get(key)
        acc, u = accumulated(raw[key].reshape(-1).numpy(), old, momentum, nesterov)
        sent = new["residual"] != acc
        assert not new["residual"][sent].any(), f"{key}: a residual entry neither kept nor sent"
        if acc.size < dense_below:
            assert sent[acc != 0].all(), f"{key}: a dense bucket kept a residual"
            np.testing.assert_array_equal(new["momentum"], u, err_msg=f"{key}: dense velocity")
        else:
            np.testing.assert_array_equal(new["momentum"], np.where(sent, 0, u),
                                          err_msg=f"{key}: velocity not carried or not masked")


class CorrectionWatch:
    """The corrected method's compressor state in this process: before the coming step, and at its
    last commit (what a reset continues from). After every step ``check`` replays the correction
    from the raw gradient and the state before, so a reset that dropped or mixed up a process's
    velocity or residual fails the job."""

    def __init__(self, model: torch.nn.Module, compression) -> None:
        self.compression = compression
        self.gradients = RawGradients([(f"{CORRECTED}.{n}", p) for n, p in model.named_parameters()])
        self.before: dict | None = None
        self.committed: dict | None = None
        self.resumed = True

    def commit(self) -> None:
        self.committed = by_tensor(self.compression.state_dict()["buckets"])

    def restart(self) -> None:
        """The start, a rollback or a reset: go on from the last commit's state."""
        self.before, self.resumed = self.committed, True

    def check(self, raw: dict, step: int) -> None:
        after = by_tensor(self.compression.state_dict()["buckets"])
        corrections = self.compression.algorithm.corrections
        check_corrected(self.before, after, raw, corrections.momentum, corrections.nesterov,
                        corrections.dense_below)
        if self.resumed:   # the first step after the start or a reset: checked from there
            origin = "nothing" if self.before is None else "its last commit"
            print(f"CONTINUED {CORRECTED} size={hvd.size()} step={step} rank={hvd.rank()} from={origin}",
                  flush=True)
            self.resumed = False
        self.before = after


def make_parts(methods: list[str]) -> dict:
    """method -> (model, optimizer, compressor), every model from the same initial weights."""
    torch.manual_seed(0)
    parts = {}
    for method in methods:
        model = torch.nn.Sequential(torch.nn.Linear(N_IN, N_HIDDEN), torch.nn.Tanh(),
                                    torch.nn.Linear(N_HIDDEN, N_OUT))
        named = [(f"{method}.{name}", p) for name, p in model.named_parameters()]
        compression = METHODS[method](named)
        optimizer = hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=LEARNING_RATE.get(method, 0.5)),
            named_parameters=named, compression=compression)
        parts[method] = (model, optimizer, compression)
    return parts


def train_every_method(parts: dict, step: int, watch: CorrectionWatch | None, victim: bool,
                       directory: str) -> None:
    """One step of every method on this rank's batch; the victim dies before the last one's update."""
    rank = hvd.rank()
    for method, (model, optimizer, _) in parts.items():
        x, y = data(1, step, rank)
        optimizer.zero_grad()
        F.cross_entropy(model(torch.from_numpy(x)), torch.from_numpy(y)).backward()
        raw = watch.gradients.take() if method == CORRECTED and watch is not None else None
        if victim and method == list(parts)[-1]:
            die(directory)
        optimizer.step()
        if raw is not None:
            watch.check(raw, step)


def evaluate(parts: dict) -> None:
    x, y = eval_data()
    for method, (model, _, compression) in parts.items():
        with torch.no_grad():
            loss = float(F.cross_entropy(model(torch.from_numpy(x)), torch.from_numpy(y)))
        stats = compression.stats()
        report_final(method, loss, stats["step"], stats)


def main() -> None:
    args = job_arguments(METHODS)
    hvd.init()
    parts = make_parts(args.methods.split(","))
    watch = CorrectionWatch(parts[CORRECTED][0], parts[CORRECTED][2]) if CORRECTED in parts else None

    def commit() -> None:
        if watch is not None:
            watch.commit()
        state.commit()
    # The documented line, once per method: the compressor is one more keyword of TorchState.
    kwargs = {}
    for method, (model, optimizer, compression) in parts.items():
        kwargs.update({f"compression_{method}": compression, f"model_{method}": model,
                       f"optimizer_{method}": optimizer})
    state = hvd.elastic.TorchState(step=0, **kwargs)
    sizes = Sizes()

    @hvd.elastic.run
    def train(state):
        if watch is not None:
            watch.restart()
        while state.step < END:
            size, rank = hvd.size(), hvd.rank()
            if world_change_due(state.step, size, args.dir, rank, args.static):
                commit()   # raises HostsUpdatedInterrupt once Horovod has the new hosts
                wait_a_little()
                continue
            train_every_method(parts, state.step, watch, is_victim(state.step, size, args.static), args.dir)
            for method, (model, _, compression) in parts.items():
                weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()
                check_method(method, weights, compression.stats(), allgather_rows, state.step, size, rank,
                             method in EXCLUSIVE, sizes.is_new(size))
            sizes.note(size)
            state.step += 1
            if state.step % COMMIT_EVERY == 0:
                commit()
        commit()   # accounts for ranks that left without a sync

    train(state)
    if hvd.rank() == 0:
        evaluate(parts)
    print(f"PASSED rank={hvd.rank()} size={hvd.size()} sizes={sizes}", flush=True)


if __name__ == "__main__":
    main()
