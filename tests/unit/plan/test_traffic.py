"""What a step puts into collectives (hvd_sparse/plan/traffic.py): recorded from the engine, equal
to the engine's own ``bytes_sent``, and derived from a method's plan and pattern for any N."""

from __future__ import annotations

import numpy as np
import pytest

from hvd_sparse.algorithms import METHODS
from hvd_sparse.backends import get_backend
from hvd_sparse.comm.protocol import ALLGATHER, ALLREDUCE, BROADCAST
from hvd_sparse.engine import Engine
from hvd_sparse.engine.planning import pack_tensors, plan_buckets
from hvd_sparse.plan import RecordingGroup, bytes_per_rank, dense_traffic, steady_traffic

NP = get_backend("numpy")
SIZES = [4000, 100, 2000, 50]


def method(name: str, density: float = 0.01, **options):
    return next(cls for cls in METHODS if cls.name == name)(density, **options)


def record_steps(algorithm, size: int, steps: int,
                 packed: bool = False) -> tuple[RecordingGroup, list[Engine], list]:
    """``steps`` steps on ``size`` ranks; the group (every phase), the engines, and per step the
    phases it recorded (the first step's agreement on the configuration included). ``packed``:
    per-tensor steps packed as the PyTorch faces pack them."""
    engines = [Engine(algorithm, NP, r, size) for r in range(size)]
    group, rng = RecordingGroup(size, NP), np.random.default_rng(0)
    keys = [f"t{i}" for i in range(len(SIZES))]
    plan = plan_buckets(algorithm, keys, SIZES)
    single = {name for name, _ in plan}
    if packed:
        plan = pack_tensors(algorithm, plan, dict(zip(keys, SIZES, strict=True)),
                            dict.fromkeys(keys, "float32"), 1 << 22)
    per_step = []
    for _ in range(steps):
        before = len(group.phases)
        for bucket, members in plan:
            grads = [[rng.standard_normal(SIZES[keys.index(m)]).astype(np.float32) for m in members]
                     for _ in range(size)]
            packs = () if bucket in single else tuple(members)
            group.run([e.step(bucket, grads[r], members=packs) for r, e in enumerate(engines)])
        group.run([e.end_step(None) for e in engines])
        per_step.append(group.phases[before:])
    return group, engines, per_step


def payload(phases, rank: int) -> int:
    """Bytes rank ``rank`` put into a step's collectives, but for control messages that
    ``bytes_sent`` leaves out: the configuration's agreement and DEFT's assignment."""
    return sum(t.parts[rank] for phase in phases for t in phase
               if not t.name.endswith(("config", "assign")))


@pytest.mark.parametrize("name", ["exdyna", "micro", "deft", "lags", "topk", "dgc", "gaussiank", "randomk"])
def test_recorded_bytes_are_the_engines_bytes_sent(name):
    size = 3
    _, engines, per_step = record_steps(method(name), size, 3)
    for rank, engine in enumerate(engines):
        assert payload(per_step[-1], rank) == engine.stats()["bytes_sent"], rank


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("name", ["topk", "lags", "randomk", "dgc"])
def test_derived_traffic_is_what_a_fixed_k_method_issues(name, packed):
    """Methods whose k is fixed: the derived phases are the recorded ones, byte for byte, with
    per-tensor steps packed as the PyTorch faces pack them or not."""
    size = 4
    algorithm = method(name, sample_ratio=1.0) if name == "dgc" else method(name)
    _, _, per_step = record_steps(algorithm, size, 2, packed)
    recorded = [[(t.op, t.parts) for t in phase] for phase in per_step[-1]]
    derived = [[(t.op, t.parts) for t in phase]
               for bucket in steady_traffic(algorithm, SIZES, size, packed=packed) for phase in bucket.phases]
    if name == "dgc":   # a sampled threshold sends about k: the structure, and bytes within 30%
        ops = [[[op for op, _ in phase] for phase in run] for run in (derived, recorded)]
        assert ops[0] == ops[1]
        assert sum(sum(p) for phase in derived for _, p in phase) == pytest.approx(
            sum(sum(p) for phase in recorded for _, p in phase), rel=0.3)
    else:
        assert derived == recorded


@pytest.mark.parametrize("name", ["exdyna", "micro", "deft"])
def test_exclusive_methods_send_k_over_the_ranks(name):
    """An exclusive method's ranks send k in all and the union is k: the derived step matches
    the recorded one's structure, and its bytes within the per-rank variation of a settled
    threshold (tracking: density held at the target)."""
    size = 4
    options = {"threshold_scaling": "tracking"} if name != "deft" else {}
    algorithm = method(name, **options)
    _, _, per_step = record_steps(algorithm, size, 60)
    derived = [t for bucket in steady_traffic(algorithm, SIZES, size, packed=False)
               for phase in bucket.phases for t in phase]
    recorded = [t for phase in per_step[-1] for t in phase]
    assert [t.op for t in derived] == [t.op for t in recorded]
    for mine, theirs in zip(derived, recorded, strict=True):
        if mine.op == BROADCAST:
            assert mine.parts == theirs.parts
        else:
            assert sum(mine.parts) == pytest.approx(sum(theirs.parts), rel=0.5), mine.op


def test_top_k_gathers_n_k_pairs_and_the_dense_allreduce_is_fused():
    algorithm = method("topk", scope="model")
    numel = sum(SIZES)
    traffic = steady_traffic(algorithm, SIZES, 64, packed=False)
    k = algorithm.k(numel)
    assert [t.op for t in traffic[0].phases[0]] == [ALLGATHER, ALLGATHER]
    assert bytes_per_rank(traffic) == 8 * k and traffic[0].scanned == numel
    exdyna = steady_traffic(method("exdyna"), SIZES, 64)
    assert exdyna[0].scanned == -(-numel // 64)
    dense = dense_traffic(SIZES, 8, fusion_bytes=4 * 2100)   # buffers of 2100 entries at most;
    assert [b.members for b in dense] == [(3, 2), (1,), (0,)]   # the 4000 alone
    assert all(t.op == ALLREDUCE for b in dense for p in b.phases for t in p)
    assert bytes_per_rank(dense) == 4 * numel


def test_the_shared_second_moments_refresh_is_what_the_engine_issues():
    """The Adam path with ``second_moment_refresh`` = K: a dense allreduce of the bucket on every
    K-th sparse step, which the derived mean step carries with ``every`` = K; over K recorded
    sparse steps the bytes are K derived steps'."""
    from hvd_sparse.algorithms import AdamPath

    size, every = 3, 2
    algorithm = method("topk", adam=AdamPath(), dense_steps=1, second_moment_refresh=every)
    _, _, per_step = record_steps(algorithm, size, 1 + 2 * every)
    sparse = per_step[1:]
    refreshes = [[t for phase in step for t in phase if t.name.endswith(".v")] for step in sparse]
    assert [len(r) for r in refreshes] == [len(SIZES), 0] * every   # one per bucket, the first step
    assert all(t.op == ALLREDUCE for r in refreshes for t in r)
    derived = steady_traffic(algorithm, SIZES, size, packed=False)
    assert [t.every for b in derived for t in b.phases[0]] == [every] * len(SIZES)
    recorded = sum(payload(step, 0) for step in sparse)
    assert recorded == pytest.approx(2 * every * bytes_per_rank(derived))
