"""Exchanges with the ring neighbours r-1 and r+1 only (ExDyna's neighbour rebalancer).

The payload is a small host vector (control data), so it travels as NumPy:

* under an MPI job, with mpi4py's non-blocking point-to-point calls on COMM_WORLD (two sends and
  two receives per rank, whatever N is);
* under Gloo, where there is no MPI world, as a Horovod alltoall whose splits are zero except
  towards the two neighbours (``neighbour_splits`` / ``split_neighbours``).

Either way the result is ``[payload of rank r-1, payload of rank r+1]`` (modulo N: for N = 2 both
are the other rank, for N = 1 both are this rank).
"""

from __future__ import annotations

import zlib

import numpy as np


def neighbours(rank: int, size: int) -> tuple[int, int]:
    return (rank - 1) % size, (rank + 1) % size


def neighbour_splits(rank: int, size: int, length: int) -> list[int]:
    """Elements this rank sends to each rank in an alltoall: ``length`` to each neighbour (twice
    to a rank that is both)."""
    left, right = neighbours(rank, size)
    splits = [0] * size
    splits[left] += length
    splits[right] += length
    return splits


def neighbour_payload(payload: np.ndarray, rank: int, size: int) -> np.ndarray:
    """The alltoall input matching ``neighbour_splits``: the payload once per destination slot."""
    copies = sum(neighbour_splits(rank, size, 1))
    return np.concatenate([payload] * copies)


def split_neighbours(received: np.ndarray, rank: int, size: int, length: int) -> list[np.ndarray]:
    """[from r-1, from r+1] out of an alltoall result ordered by source rank."""
    incoming = [neighbour_splits(source, size, length)[rank] for source in range(size)]
    offsets = np.concatenate([[0], np.cumsum(incoming)])
    left, right = neighbours(rank, size)
    return [received[offsets[left]: offsets[left] + length],
            received[offsets[right]: offsets[right] + length]]


def _tag(name: str, direction: int) -> int:
    return (zlib.crc32(name.encode()) % 16384) * 2 + direction


class MpiNeighbourExchange:
    """Non-blocking neighbour exchange over mpi4py (the job must run under MPI)."""

    def __init__(self):
        from mpi4py import MPI

        self._mpi = MPI
        self.comm = MPI.COMM_WORLD

    def start(self, payload: np.ndarray, name: str) -> tuple:
        payload = np.ascontiguousarray(payload)
        rank, size = self.comm.Get_rank(), self.comm.Get_size()
        left, right = neighbours(rank, size)
        from_left, from_right = np.empty_like(payload), np.empty_like(payload)
        # Messages travelling rightwards carry direction 0, leftwards direction 1.
        requests = [self.comm.Irecv(from_left, source=left, tag=_tag(name, 0)),
                    self.comm.Irecv(from_right, source=right, tag=_tag(name, 1)),
                    self.comm.Isend(payload, dest=right, tag=_tag(name, 0)),
                    self.comm.Isend(payload, dest=left, tag=_tag(name, 1))]
        return requests, from_left, from_right, payload

    def test(self, handle: tuple) -> bool:
        """Whether the exchange has completed; never blocks."""
        return bool(self._mpi.Request.Testall(handle[0]))

    def wait(self, handle: tuple) -> list[np.ndarray]:
        requests, from_left, from_right, _ = handle
        self._mpi.Request.Waitall(requests)
        return [from_left, from_right]


def mpi_exchange_for(process_set_is_global: bool, mpi_enabled: bool) -> MpiNeighbourExchange | None:
    """The mpi4py exchange when the job runs under MPI on the global process set, else None (the
    caller then uses a Horovod alltoall)."""
    if not (mpi_enabled and process_set_is_global):
        return None
    try:
        return MpiNeighbourExchange()
    except ImportError:
        return None
