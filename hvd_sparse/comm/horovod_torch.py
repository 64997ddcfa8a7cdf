"""Horovod (PyTorch) execution of step protocols: named, asynchronous, deadlock-free.

Horovod matches collectives by name in a background thread, so collectives that are *started*
asynchronously complete whatever order ranks start them in; a rank that *blocks* on one while
another rank blocks on a different one hangs both (HOROVOD.md 1.8). ``AsyncProtocols`` therefore
starts every protocol's next phase before it waits for any: a phase's collectives are all issued
on every rank before any rank waits on them.
"""

from __future__ import annotations

from typing import Any

from .neighbours import mpi_exchange_for, neighbour_payload, neighbour_splits, split_neighbours
from .protocol import ALLGATHER, ALLREDUCE, BROADCAST, NEIGHBOURS, Collective, Protocol


class HorovodTorchComm:
    """Starts and waits for named Horovod collectives on a process set."""

    def __init__(self, process_set: Any = None):
        import horovod.torch as hvd
        import torch

        self._hvd = hvd
        self._torch = torch
        self.process_set = process_set if process_set is not None else hvd.global_process_set
        self.rank = self.process_set.rank()
        self.size = self.process_set.size()
        self._mpi = mpi_exchange_for(self.process_set is hvd.global_process_set, hvd.mpi_enabled())

    def start(self, c: Collective) -> Any:
        hvd, ps = self._hvd, self.process_set
        if c.op == NEIGHBOURS:
            return self._start_neighbours(c)
        if c.op == ALLGATHER:
            return "horovod", hvd.allgather_async(c.tensor, name=c.name, process_set=ps)
        if c.op == ALLREDUCE:
            return "horovod", hvd.allreduce_async(c.tensor, name=c.name, op=hvd.Sum, process_set=ps)
        if c.op == BROADCAST:
            return "horovod", hvd.broadcast_async(c.tensor, root_rank=c.root, name=c.name,
                                                  process_set=ps)
        raise ValueError(f"unknown collective op {c.op!r}")

    def wait(self, handle: Any) -> Any:
        kind, payload = handle
        if kind == "mpi":
            return [self._torch.from_numpy(x) for x in self._mpi.wait(payload)]
        if kind == "alltoall":
            handle, length = payload
            received, _ = self._hvd.synchronize(handle)
            return split_neighbours(received, self.rank, self.size, length)
        return self._hvd.synchronize(payload)

    def _start_neighbours(self, c: Collective) -> Any:
        payload = c.tensor.cpu().numpy()
        if self._mpi is not None:
            return "mpi", self._mpi.start(payload, c.name)
        torch = self._torch
        splits = torch.tensor(neighbour_splits(self.rank, self.size, len(payload)), dtype=torch.int32)
        data = torch.from_numpy(neighbour_payload(payload, self.rank, self.size))
        handle = self._hvd.alltoall_async(data, splits=splits, name=c.name, process_set=self.process_set)
        return "alltoall", (handle, len(payload))


class AsyncProtocols:
    """Protocols in flight during one step, keyed by bucket name."""

    def __init__(self, comm: HorovodTorchComm):
        self.comm = comm
        self._running: dict[str, tuple[Protocol, list]] = {}
        self.results: dict[str, Any] = {}

    def start(self, key: str, protocol: Protocol) -> None:
        """Run ``protocol`` up to its first phase and start that phase's collectives."""
        self._advance(key, protocol, None)

    def finish_all(self) -> None:
        """Drive every running protocol to completion, phase by phase across all of them."""
        while self._running:
            running, self._running = self._running, {}
            outputs = {key: [self.comm.wait(h) for h in handles] for key, (_, handles) in running.items()}
            for key, (protocol, _) in running.items():
                self._advance(key, protocol, outputs[key])

    def clear(self) -> None:
        if self._running:
            raise RuntimeError(f"collectives still in flight for {sorted(self._running)}")
        self.results.clear()

    def _advance(self, key: str, protocol: Protocol, sent: list | None) -> None:
        try:
            phase = next(protocol) if sent is None else protocol.send(sent)
        except StopIteration as done:
            self.results[key] = done.value
            return
        self._running[key] = (protocol, [self.comm.start(c) for c in phase])
