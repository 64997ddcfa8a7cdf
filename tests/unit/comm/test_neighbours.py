"""The neighbour exchange (hvd_sparse/comm/neighbours.py) of ExDyna's neighbour rebalancing: the
messages it posts under MPI and the alltoall splits of the Gloo fallback."""

from __future__ import annotations

import numpy as np
import pytest


class RecordingComm:
    """Stands in for COMM_WORLD: records each point-to-point call, delivers nothing."""

    def __init__(self):
        self.calls = []

    def Isend(self, buffer, dest, tag):   # mpi4py names
        self.calls.append(("send", dest))

    def Irecv(self, buffer, source, tag):
        self.calls.append(("recv", source))


@pytest.mark.parametrize("size", [2, 5, 64])
def test_mpi_neighbour_exchange_sends_four_messages_whatever_n(size):
    """Under MPI each exchange is two sends and two receives, to the Horovod neighbours' COMM_WORLD
    ranks (here a permutation, as after hvd.init(comm=...) on a reordered communicator)."""
    pytest.importorskip("mpi4py")
    from hvd_sparse.comm.neighbours import MpiNeighbourExchange

    world_ranks = list(reversed(range(size)))
    comm = RecordingComm()
    MpiNeighbourExchange(1, world_ranks, comm).start(np.zeros(2, np.int64), "x.loads")
    left, right = world_ranks[0], world_ranks[2 % size]
    assert sorted(comm.calls) == sorted([("recv", left), ("recv", right), ("send", right), ("send", left)])


def test_gloo_neighbour_alltoall_carries_data_to_two_peers_only():
    """The Gloo fallback: an alltoall whose splits are zero except towards r-1 and r+1 (Horovod
    still posts zero-byte messages to the other peers: the docs state that cost)."""
    from hvd_sparse.comm.neighbours import neighbour_splits

    for size in (3, 8, 33):
        for rank in range(size):
            splits = neighbour_splits(rank, size, 2)
            assert sum(1 for s in splits if s) == 2 and sum(splits) == 4
