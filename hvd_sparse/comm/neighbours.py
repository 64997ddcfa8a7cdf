"""Exchanges with the ring neighbours r-1 and r+1 only (ExDyna's neighbour rebalancer).

The payload is a small host vector (control data), so it travels as NumPy:

* under an MPI job, with mpi4py's non-blocking point-to-point calls on COMM_WORLD: two sends and
  two receives per rank and exchange, whatever N is (two exchanges per step). mpi4py is then
  called from whatever thread runs the step (PyTorch: the autograd hook) while Horovod's own
  thread uses MPI, so this needs MPI_THREAD_MULTIPLE (Horovod's default; not with
  HOROVOD_MPI_THREADS_DISABLE=1); Horovod ranks are mapped to COMM_WORLD ranks once (one mpi4py
  allgather), which needs Horovod to run on all of COMM_WORLD (not ``hvd.init(comm=...)`` on a
  part of it). Where either fails the exchange falls back, with one warning saying why, to:
* a Horovod alltoall whose splits are zero except towards the two neighbours
  (``neighbour_splits`` / ``split_neighbours``) -- under Gloo always, since there is no MPI world.
  Only two of its N - 1 peers receive data, but Horovod's alltoall still posts a send and a
  receive to every peer (zero bytes to most) and negotiates like any collective: about 2(N - 1)
  messages per rank per exchange, 4(N - 1) per step. Horovod 0.28.1 has no point-to-point call.

Either way the result is ``[payload of rank r-1, payload of rank r+1]`` (modulo N: for N = 2 both
are the other rank, for N = 1 both are this rank).
"""

from __future__ import annotations

import warnings
import zlib
from typing import Any

import numpy as np


def neighbours(rank: int, size: int) -> tuple[int, int]:
    """The ranks to the left and right of ``rank`` on the ring of ``size``."""
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
    """Non-blocking neighbour exchange over mpi4py (the job must run under MPI).

    ``world_ranks[h]`` is the COMM_WORLD rank of Horovod rank ``h``; ``comm`` is COMM_WORLD (a
    recording stand-in in tests)."""

    def __init__(self, rank: int, world_ranks: list[int], comm: Any = None):
        from mpi4py import MPI

        self._mpi = MPI
        self.comm = MPI.COMM_WORLD if comm is None else comm
        self.rank, self.world_ranks = rank, list(world_ranks)

    def start(self, payload: np.ndarray, name: str) -> tuple:
        """Post the non-blocking sends to and receives from both neighbours; the handle ``wait`` takes."""
        payload = np.ascontiguousarray(payload)
        left, right = (self.world_ranks[r] for r in neighbours(self.rank, len(self.world_ranks)))
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
        """The payloads of the left and the right neighbour."""
        requests, from_left, from_right, _ = handle
        self._mpi.Request.Waitall(requests)
        return [from_left, from_right]


_warned: set[str] = set()


def mpi_exchange_for(process_set_is_global: bool, mpi_enabled: bool, rank: int = 0,
                     size: int = 1) -> MpiNeighbourExchange | None:
    """The mpi4py exchange when the job runs under MPI on the global process set and MPI allows
    it (module docstring), else None: the caller then uses a Horovod alltoall. Call it on every
    rank at the same point (it may run one mpi4py allgather on COMM_WORLD)."""
    if not (mpi_enabled and process_set_is_global):
        return None
    try:
        from mpi4py import MPI
    except ImportError:
        _fall_back("mpi4py is not installed")
        return None
    if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
        _fall_back("MPI was initialized without MPI_THREAD_MULTIPLE (HOROVOD_MPI_THREADS_DISABLE=1?), "
                   "and the exchange runs beside Horovod's own MPI thread")
        return None
    if MPI.COMM_WORLD.Get_size() != size:
        _fall_back(f"Horovod runs on {size} of COMM_WORLD's {MPI.COMM_WORLD.Get_size()} processes "
                   "(hvd.init(comm=...)), so COMM_WORLD ranks are not Horovod's")
        return None
    horovod_rank_of_world = MPI.COMM_WORLD.allgather(rank)
    world_ranks = [0] * size
    for world, horovod in enumerate(horovod_rank_of_world):
        world_ranks[horovod] = world
    return MpiNeighbourExchange(rank, world_ranks)


class HorovodNeighbourChoice:
    """What the Horovod drivers (torch and TF) share: the neighbour exchange's transport, decided
    once, at the first neighbour exchange -- every rank reaches it at the same point of the same
    step. Needs ``process_set``, ``_hvd``, ``rank``, ``size`` and ``_mpi_decided = False``."""

    process_set: Any
    _hvd: Any
    rank: int
    size: int
    _mpi_decided: bool
    _mpi: MpiNeighbourExchange | None

    def _mpi_exchange(self) -> Any:
        """mpi4py point-to-point where MPI allows it (``mpi_exchange_for``), else None."""
        if not self._mpi_decided:
            self._mpi_decided = True
            self._mpi = mpi_exchange_for(self.process_set is self._hvd.global_process_set,
                                         self._hvd.mpi_enabled(), self.rank, self.size)
        return self._mpi


def _fall_back(reason: str) -> None:
    if reason not in _warned:
        _warned.add(reason)
        warnings.warn(f"hvd_sparse: the neighbour exchange uses a Horovod alltoall instead of mpi4py "
                      f"point-to-point messages (about 2(N-1) messages per rank instead of 4): {reason}",
                      RuntimeWarning, stacklevel=3)
    return None
