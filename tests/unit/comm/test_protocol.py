"""The protocol vocabulary (hvd_sparse/comm/protocol.py): a step is a generator of phases of named
collectives; ``run_blocking`` drives one phase at a time, ``finished`` is the protocol with no
collective, and a collective's signature (what every rank must agree on) leaves out its tensor."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from hvd_sparse.comm import ALLGATHER, ALLREDUCE, BROADCAST, Collective, finished, run_blocking


def two_phases(value):
    """Allgather, then an allreduce and a broadcast together; returns what came back."""
    (gathered,) = yield [Collective(ALLGATHER, "p.gather", np.array([value]))]
    summed, root_value = yield [Collective(ALLREDUCE, "p.sum", gathered),
                                Collective(BROADCAST, "p.root", gathered, root=1)]
    return summed, root_value


def test_run_blocking_hands_each_phase_its_results_in_order_and_returns_the_value():
    phases = []

    def execute(phase):
        phases.append([c.signature() for c in phase])
        return [c.tensor * 10 for c in phase]

    summed, root_value = run_blocking(two_phases(2), execute)
    assert phases == [[(ALLGATHER, "p.gather", 0)], [(ALLREDUCE, "p.sum", 0), (BROADCAST, "p.root", 1)]]
    np.testing.assert_array_equal(summed, [200])
    np.testing.assert_array_equal(root_value, [200])


def test_an_error_while_executing_reaches_the_caller():
    def execute(phase):
        raise RuntimeError(f"collective {phase[0].name} failed")

    with pytest.raises(RuntimeError, match=r"collective p\.gather failed"):
        run_blocking(two_phases(1), execute)


def test_finished_issues_no_collective():
    def execute(phase):
        raise AssertionError("finished() must not issue a collective")

    assert run_blocking(finished(7), execute) == 7
    with pytest.raises(StopIteration) as done:
        next(finished("value"))
    assert done.value.value == "value"


def test_finished_composes_inside_a_protocol():
    def protocol():
        skipped = yield from finished(3)      # e.g. a rebalance with nothing to do
        (got,) = yield [Collective(ALLREDUCE, "x", skipped)]
        return got

    assert run_blocking(protocol(), lambda phase: [c.tensor + 1 for c in phase]) == 4


def test_signature_is_op_name_and_root_and_a_collective_is_frozen():
    a = Collective(ALLREDUCE, "w.values", np.zeros(3))
    b = Collective(ALLREDUCE, "w.values", np.ones(5))
    assert a.root == 0 and a.signature() == b.signature() == (ALLREDUCE, "w.values", 0)
    assert Collective(BROADCAST, "w.values", None, root=2).signature() != a.signature()
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.name = "other"
