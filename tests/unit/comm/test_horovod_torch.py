"""The PyTorch Horovod driver (hvd_sparse/comm/horovod_torch.py): the timeline bookkeeping of
asynchronous protocols (issue, completion, waiting) that LAGS profiles with; no Horovod needed."""

from __future__ import annotations

import numpy as np
import pytest

from hvd_sparse.comm import ALLGATHER
from hvd_sparse.comm.horovod_torch import AsyncProtocols


class FakeComm:
    """Collectives that complete when the test says so."""

    def __init__(self):
        self.done = set()
        self.count = 0

    def start(self, collective):
        self.count += 1
        return (self.count, collective.tensor)

    def poll(self, handle):
        return handle[0] in self.done

    def wait(self, handle):
        self.done.add(handle[0])
        return handle[1]


def test_async_protocols_record_issue_completion_and_waiting():
    from hvd_sparse.comm import Collective

    def protocol(value):
        (got,) = yield [Collective(ALLGATHER, f"x{value}", np.array([value]))]
        return got

    comm = FakeComm()
    protocols = AsyncProtocols(comm)
    protocols.start("a", protocol(1))
    protocols.start("b", protocol(2))
    protocols.poll()
    assert protocols.timeline()["a"][1] is None   # not complete yet
    comm.done.add(1)                              # a's allgather completes during "backward"
    protocols.poll()
    seen_a = protocols.timeline()["a"][1]
    assert seen_a is not None and protocols.timeline()["b"][1] is None
    assert protocols.finish()[1] == {}
    assert protocols.results == {"a": np.array([1]), "b": np.array([2])}
    assert protocols.completed_at["a"] == seen_a  # completion is when it was seen, not the wait
    assert protocols.completed_at["b"] >= seen_a
    assert protocols.wait_seconds >= 0
    span = max(protocols.completed_at.values()) - min(protocols.issued_at.values())
    assert protocols.inflight_seconds() == pytest.approx(span)
    protocols.clear()
    assert protocols.timeline() == {} and protocols.wait_seconds == 0


def test_every_collective_is_recorded_and_the_time_in_flight_splits_at_a_moment():
    from hvd_sparse.comm import Collective

    def protocol():
        yield [Collective(ALLGATHER, "x.idx", np.zeros(3, np.int32)),
               Collective(ALLGATHER, "x.val", np.zeros(3, np.float32))]
        yield [Collective(ALLGATHER, "x.more", np.zeros(5, np.float64))]

    comm = FakeComm()
    protocols = AsyncProtocols(comm)
    protocols.start("x", protocol())
    comm.done.add(2)                              # the second completes first: polls go oldest
    protocols.poll()                              # first and stop at one still running
    assert [c[4] for c in protocols.collectives] == [None, None]
    comm.done.add(1)
    protocols.poll()
    assert all(c[4] is not None for c in protocols.collectives)
    assert protocols.finish()[1] == {}
    names = [c[0] for c in protocols.collectives]
    assert names == ["x.idx", "x.val", "x.more"]
    assert [c[2] for c in protocols.collectives] == [12, 12, 40]
    assert all(c[4] is not None and c[4] >= c[3] for c in protocols.collectives)
    total = protocols.inflight_seconds()
    middle = protocols.collectives[2][3]          # when the second phase was issued
    before = protocols.inflight_seconds(until=middle)
    assert 0 <= before <= total and protocols.inflight_seconds(until=0.0) == 0.0
    assert protocols.inflight_seconds(until=float("inf")) == pytest.approx(total)
