"""The communication patterns (hvd_sparse/engine/patterns.py): what each one issues is what its
schedule says, for every registered method, and each moves the bytes docs/architecture.md's table
of patterns gives (docs/architecture.md#communication-patterns)."""

from __future__ import annotations

import numpy as np
import pytest

from hvd_sparse.algorithms import GATHER, SHARED, UNION, Algorithm
from hvd_sparse.algorithms.base import PATTERNS
from hvd_sparse.backends import get_backend
from hvd_sparse.comm.local import LocalGroup
from hvd_sparse.engine import Engine
from hvd_sparse.engine.patterns import BY_NAME, Gather, Shared, Union
from hvd_sparse.registry import METHODS

NP = get_backend("numpy")
SHAPES = [(40, 5), (30,)]
NUMEL = sum(int(np.prod(s)) for s in SHAPES)


def build(cls: type[Algorithm], pattern: str) -> Algorithm:
    """The registered method ``cls`` running ``pattern`` (one of ``cls.patterns``)."""
    if len(cls.patterns) == 1:
        return cls(0.05)
    if cls.name == "randomk":
        return cls(0.05, shared_seed=pattern == SHARED)
    return cls(0.05, pattern=pattern)


METHOD_PATTERNS = [(name, pattern) for name, cls in sorted(METHODS.items()) for pattern in cls.patterns]


def recorded(protocol, log: list):
    """``protocol``, appending the (op, name, dtype) of each collective of each phase to ``log``."""
    try:
        phase = next(protocol)
        while True:
            log.append([(c.op, c.name, NP.dtype_name(c.tensor)) for c in phase])
            phase = protocol.send((yield phase))
    except StopIteration as done:
        return done.value


def run_steps(algorithm: Algorithm, dtype: str, steps: int = 4, size: int = 3) -> tuple[list, list]:
    """Per step, the phases rank 0 issued (after a first step that checks the layout), and the engines."""
    engines, group = [Engine(algorithm, NP, rank, size) for rank in range(size)], LocalGroup(size)
    rng = np.random.default_rng(0)
    issued = []
    for step in range(steps):
        logs = [[] for _ in range(size)]
        grads = [[rng.standard_normal(s).astype(dtype) for s in SHAPES] for _ in range(size)]
        group.run([recorded(e.step("model", grads[r], check_layout=step == 0), logs[r])
                   for r, e in enumerate(engines)])
        issued.append(logs[0])
    return issued[1:], engines


def test_every_pattern_name_has_its_object():
    assert sorted(BY_NAME) == sorted(PATTERNS)
    assert all(BY_NAME[name].name == name for name in PATTERNS)


def test_schedules_are_the_documented_phases():
    assert Gather().schedule("p.b", "int32", "float16") == [
        [("allgather", "p.b.idx", "int32"), ("allgather", "p.b.val", "float16")]]
    assert Union().schedule("p.b", "int64", "float32") == [
        [("allgather", "p.b.idx", "int64")], [("allreduce", "p.b.val", "float32")]]
    assert Shared().schedule("p.b", "int32", "float64") == [[("allreduce", "p.b.val", "float64")]]


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("method,pattern", METHOD_PATTERNS)
def test_the_pattern_issues_what_its_schedule_says(method, pattern, dtype):
    algorithm = build(METHODS[method], pattern)
    assert algorithm.pattern == pattern
    issued, engines = run_steps(algorithm, dtype)
    bucket = engines[0].buckets["model"]
    name = f"{engines[0].prefix}.model"
    expected = BY_NAME[pattern].schedule(name, bucket.index_dtype, bucket.value_dtype)
    ours = {f"{name}.idx", f"{name}.val"}
    for phases in issued:
        # The pattern's collectives come last; a method may issue its own before them.
        exchanged = [phase for phase in phases if {c[1] for c in phase} & ours]
        assert exchanged == expected
        assert phases[-len(expected):] == expected
        if not algorithm.select_collectives:  # then the whole step is what Engine.schedule lists
            assert phases == engines[0].schedule("model", NUMEL, (dtype, dtype))


class Picks(Algorithm):
    """Test-only method: each rank selects the indices of ``TABLE`` for its rank (rank 0's on the
    shared pattern, where every rank must select the same)."""

    name = "picks"
    patterns = PATTERNS
    TABLE = ([0, 1, 2, 3], [2, 3, 4], [9, 3, 0, 7, 8])

    def select_local(self, acc, control, ctx):
        picks = self.TABLE[0 if self.pattern == SHARED else ctx.rank]
        return NP.from_numpy(np.array(picks, dtype=np.int64))


@pytest.mark.parametrize("dtype,value_bytes", [("float32", 4), ("float16", 2), ("float64", 8)])
@pytest.mark.parametrize("pattern", PATTERNS)
def test_bytes_each_pattern_moves(pattern, dtype, value_bytes):
    size, index_bytes = len(Picks.TABLE), 4   # int32 indices for a small bucket
    engines, group = [Engine(Picks(0.1, pattern=pattern), NP, r, size) for r in range(size)], LocalGroup(size)
    group.run([e.step("b", [np.ones(20, dtype)]) for e in engines])
    picks = [Picks.TABLE[0 if pattern == SHARED else r] for r in range(size)]
    union, total = len(set().union(*picks)), sum(len(p) for p in picks)
    for rank, engine in enumerate(engines):
        stats, mine = engine.stats(), len(picks[rank])
        sent, received = {
            GATHER: (mine * (index_bytes + value_bytes), (total - mine) * (index_bytes + value_bytes)),
            UNION: (mine * index_bytes + union * value_bytes,
                    (total - mine) * index_bytes + union * value_bytes),
            SHARED: (mine * value_bytes, mine * value_bytes),
        }[pattern]
        assert (stats["bytes_sent"], stats["bytes_received"]) == (sent, received)
        assert stats["selected"] == mine and stats["union"] == union
