"""Elastic PyTorch job (horovodrun --min-np/--max-np with a discovery script): several methods
trained side by side, each model, optimizer and compressor in one hvd.elastic.TorchState, through
2 -> 3 ranks, a killed worker (3 -> 2, rolled back to the last commit) and 2 -> 1 ranks
(elastic_common.py). After every step, on every rank: identical weights, stats() at the new N,
identical step counters, no build-up for the exclusive methods."""

from __future__ import annotations

import argparse
import faulthandler
import os
import signal

import horovod.torch as hvd
import numpy as np
import torch
import torch.nn.functional as F
from elastic_common import (
    COMMIT_EVERY,
    END,
    N_HIDDEN,
    N_IN,
    N_OUT,
    check_step,
    data,
    die,
    eval_data,
    is_victim,
    stat_facts,
    wait_a_little,
    world_change_due,
)

import hvd_sparse.torch as hs

METHODS = {
    "exdyna": lambda named: hs.ExDyna(0.05, named_parameters=named, prefix="hs.exdyna"),
    "exdyna-histogram": lambda named: hs.ExDyna(0.05, rebalance="histogram", named_parameters=named,
                                                prefix="hs.exdyna-histogram"),
    "deft": lambda named: hs.DEFT(0.05, named_parameters=named, prefix="hs.deft"),
    "lags": lambda named: hs.LAGS(0.05, merge_threshold=200, named_parameters=named, prefix="hs.lags"),
    "topk": lambda named: hs.TopK(0.05, named_parameters=named, prefix="hs.topk"),
}
EXCLUSIVE = ("exdyna", "exdyna-histogram", "deft")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--static", action="store_true")
    args = parser.parse_args()
    methods = args.methods.split(",")
    stacks = open(f"{args.dir}/stacks.{os.getpid()}", "w")  # noqa: SIM115  (open for the process's life)
    faulthandler.register(signal.SIGUSR1, file=stacks)   # stacks on demand, should a job ever hang
    hvd.init()
    torch.manual_seed(0)
    parts = {}
    for method in methods:
        model = torch.nn.Sequential(torch.nn.Linear(N_IN, N_HIDDEN), torch.nn.Tanh(),
                                    torch.nn.Linear(N_HIDDEN, N_OUT))
        named = [(f"{method}.{name}", p) for name, p in model.named_parameters()]
        compression = METHODS[method](named)
        optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5),
                                             named_parameters=named, compression=compression)
        parts[method] = (model, optimizer, compression)
    # The documented line, once per method: the compressor is one more keyword of TorchState.
    kwargs = {}
    for method, (model, optimizer, compression) in parts.items():
        kwargs.update({f"compression_{method}": compression, f"model_{method}": model,
                       f"optimizer_{method}": optimizer})
    state = hvd.elastic.TorchState(step=0, **kwargs)
    seen_sizes = []

    @hvd.elastic.run
    def train(state):
        while state.step < END:
            size, rank = hvd.size(), hvd.rank()
            if world_change_due(state.step, size, args.dir, rank, args.static):
                state.commit()   # raises HostsUpdatedInterrupt once Horovod has the new hosts
                wait_a_little()
                continue
            for method, (model, optimizer, _) in parts.items():
                x, y = data(1, state.step, rank)
                optimizer.zero_grad()
                F.cross_entropy(model(torch.from_numpy(x)), torch.from_numpy(y)).backward()
                if method == methods[-1] and is_victim(state.step, size, args.static):
                    die(args.dir)
                optimizer.step()
            for method, (model, _, compression) in parts.items():
                flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).double()
                stats = compression.stats()
                row = np.array([float(flat.sum()), float((flat * flat).sum()), *stat_facts(stats)])
                rows = hvd.allgather(torch.from_numpy(row)[None], name=f"check.{method}").numpy()
                check_step(method, rows, size, method in EXCLUSIVE)
                if rank == 0 and (not seen_sizes or seen_sizes[-1] != size):
                    print(f"CHECKED {method} size={size} step={state.step} "
                          f"resets={stats.get('elastic_resets')} "
                          f"departed={stats.get('departed_ranks')} "
                          f"departed_norm={stats.get('departed_residual_norm')}", flush=True)
            if not seen_sizes or seen_sizes[-1] != size:
                seen_sizes.append(size)
            state.step += 1
            if state.step % COMMIT_EVERY == 0:
                state.commit()
        state.commit()   # accounts for ranks that left without a sync

    train(state)
    if hvd.rank() == 0:
        x, y = eval_data()
        for method, (model, _, compression) in parts.items():
            with torch.no_grad():
                loss = float(F.cross_entropy(model(torch.from_numpy(x)), torch.from_numpy(y)))
            stats = compression.stats()
            print(f"FINAL {method} loss={loss:.5f} step={stats['step']} world_size={stats.get('world_size')} "
                  f"resets={stats.get('elastic_resets')} departed={stats.get('departed_ranks')} "
                  f"departed_norm={stats.get('departed_residual_norm')}", flush=True)
    print(f"PASSED rank={hvd.rank()} size={hvd.size()} sizes={seen_sizes}", flush=True)


if __name__ == "__main__":
    main()
