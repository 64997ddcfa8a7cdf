"""Worker: the whole-model methods (ExDyna, MiCRO, DEFT) and LAGS as DDP communication hooks,
checked every step.

Run by tests/multiproc/test_ddp.py under torchrun (2 ranks on one agent, 4 ranks on two agents
as if on two hosts). After every step each rank allgathers every rank's accumulated vector and
re-derives the step independently: ExDyna/MiCRO (exact, neighbour -- point-to-point over
torch.distributed -- and tracking; every rank's partition and threshold, exact error feedback,
identical partition tables), DEFT (tests/reference/deft.py), LAGS (top-k per group, groups cut
across DDP's buckets, adaptive densities agreed in the end-of-step protocol); at the end,
identical parameters.
"""

from __future__ import annotations

import numpy as np
from checks import check_exclusive_step, check_identical, check_topk_step
from ddp_common import allgather_rows, finish, init, run
from deft_checks import check_deft_step

import hvd_sparse
import hvd_sparse.torch.ddp as ddp

DENSITY = 0.05


def acc_of(raw, old):
    return (raw + (old["residual"] if old is not None else 0)).astype(np.float32)


def check_exclusive(rank: int, moves: list, exact: bool = True):
    def check(step, bucket, raw, applied, old, new, stats, label):
        accs = allgather_rows(acc_of(raw, old))
        views = allgather_rows(np.array([*stats["own_partition"], stats["threshold"]], dtype=np.float64))
        union = check_exclusive_step(rank, accs, views, applied, new["residual"], step, label)
        assert stats["union"] == union and stats["buildup"] == union / stats["k"], (label, stats)
        if "rebalance_moves" in stats:
            moves.append(stats["rebalance_moves"])
        if exact:   # every rank holds the same partition table (neighbour mode: its own range)
            table = np.array(stats["partition"], dtype=np.int64)
            check_identical(allgather_rows(table), f"{label} partition tables")
            assert sum(stats["counts"]) == stats["union"], (label, stats)
    return check


def check_deft(rank: int, sizes: list[int], agreed_k: bool):
    def check(step, bucket, raw, applied, old, new, stats, label):
        accs = allgather_rows(acc_of(raw, old))
        check_deft_step(rank, accs, applied, new["residual"], sizes, DENSITY, step, agreed_k, stats, label)
    return check


def check_lags(rank: int, densities: dict):
    def check(step, bucket, raw, applied, old, new, stats, label):
        accs = allgather_rows(acc_of(raw, old))
        check_topk_step(rank, accs, applied, new["residual"], densities.get(bucket, DENSITY), "gather", label)
        if bucket == "group2":   # the last group of the step: the densities of the next one
            densities.clear()
            densities.update(stats.get("group_densities", {}))
    return check


def main() -> None:
    rank, size = init()
    sizes = [384, 24, 576, 24, 120, 5]
    for options in ({"rebalance": "exact"}, {"rebalance": "neighbour"},
                    {"threshold_scaling": "tracking"}):
        moves: list = []
        label = "exdyna/" + "-".join(f"{k}={v}" for k, v in options.items())
        run(label, lambda named, o=options: ddp.ExDyna(DENSITY, named_parameters=named, **o),
            check_exclusive(rank, moves, exact=options.get("rebalance", "exact") == "exact"))
        moved = int(allgather_rows(np.array([sum(moves)])).sum())
        assert moved > 0, f"{label}: no partition boundary ever moved"
    run("micro", lambda named: hvd_sparse.create("micro", framework="ddp", density=DENSITY,
                                                  named_parameters=named), check_exclusive(rank, []))
    run("deft/paper", lambda named: ddp.DEFT(DENSITY, named_parameters=named),
        check_deft(rank, sizes, agreed_k=False))
    run("deft/agreed-heap", lambda named: ddp.DEFT(DENSITY, agreed_k=True, packing="heap",
                                                   named_parameters=named),
        check_deft(rank, sizes, agreed_k=True))
    run("lags/merged", lambda named: ddp.LAGS(DENSITY, merge_threshold=100, named_parameters=named),
        check_lags(rank, {}))
    state, _ = run("lags/adaptive", lambda named: ddp.LAGS(DENSITY, merge_threshold=100, adaptive=True,
                                                           profile_steps=3, alpha=1e-4, beta=1e-6,
                                                           named_parameters=named),
                   check_lags(rank, {}))
    stats = state.stats()
    assert stats["adaptive_state"] == "fixed", stats
    densities = np.array([stats["group_densities"][g] for g in ("group0", "group1", "group2")])
    check_identical(allgather_rows(densities), "lags/adaptive densities")
    finish(rank, size)


if __name__ == "__main__":
    main()
