"""Horovod (PyTorch) execution of step protocols: named, asynchronous, deadlock-free.

Horovod matches collectives by name in a background thread, so collectives that are *started*
asynchronously complete whatever order ranks start them in; a rank that *blocks* on one while
another blocks on a different one hangs both (docs/architecture.md#collective-rules). ``AsyncProtocols``
therefore starts every protocol's next phase before it waits for any: a phase's collectives are all issued
on every rank before any rank waits on them.

It also keeps, cheaply, the step's communication timeline: when each collective (and so each
bucket) was issued, with its bytes, and when it was seen complete (``poll``, called from the
backward hooks, asks Horovod about the collectives in flight without blocking, oldest first,
until one is still running: a few polls per hook whatever the number of buckets; in
``finish`` the wait tells, and the same poll after each wait notes the others that completed
meanwhile), and how long ``finish`` blocked on collectives -- the communication the backward
pass did not hide.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

from .neighbours import HorovodNeighbourChoice, neighbour_payload, neighbour_splits, split_neighbours
from .protocol import ALLGATHER, ALLREDUCE, BROADCAST, NEIGHBOURS, Collective, Phase, Protocol


class HorovodTorchComm(HorovodNeighbourChoice):
    """Starts and waits for named Horovod collectives on a process set."""

    def __init__(self, process_set: Any = None):
        import horovod.torch as hvd
        import torch

        self._hvd = hvd
        self._torch = torch
        self.process_set = process_set if process_set is not None else hvd.global_process_set
        self.rank = self.process_set.rank()
        self.size = self.process_set.size()
        self._mpi: Any = None       # the mpi4py exchange, decided at the first neighbour exchange
        self._mpi_decided = False

    def start(self, c: Collective) -> Any:
        """Start one collective asynchronously; the handle ``wait`` takes."""
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
        """The result of a started collective, waiting for it."""
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
        if self._mpi_exchange() is not None:
            return "mpi", self._mpi.start(payload, c.name)
        torch = self._torch
        splits = torch.tensor(neighbour_splits(self.rank, self.size, len(payload)), dtype=torch.int32)
        data = torch.from_numpy(neighbour_payload(payload, self.rank, self.size))
        handle = self._hvd.alltoall_async(data, splits=splits, name=c.name, process_set=self.process_set)
        return "alltoall", (handle, len(payload))

    def poll(self, handle: Any) -> bool:
        """Whether the collective has completed (``wait`` then returns at once); never blocks."""
        kind, payload = handle
        if kind == "mpi":
            return self._mpi.test(payload)
        return self._hvd.poll(payload[0] if kind == "alltoall" else payload)

    def execute(self, phase: Phase) -> list:
        """Run a phase blocking: start every collective, then wait for each. Only where every rank
        runs the same phases in the same order (outside backward hooks)."""
        handles = [self.start(c) for c in phase]
        return [self.wait(h) for h in handles]


def _nbytes(tensor: Any) -> int:
    """Bytes a collective's tensor holds (a torch tensor; a NumPy array for a neighbour exchange)."""
    if hasattr(tensor, "element_size"):
        return int(tensor.numel() * tensor.element_size())
    return int(getattr(tensor, "nbytes", 0))


class AsyncProtocols:
    """Protocols in flight during one step, keyed by bucket name."""

    def __init__(self, comm: HorovodTorchComm):
        self.comm = comm
        # bucket -> (its protocol, the handles of its phase in flight, their records)
        self._running: dict[str, tuple[Protocol, list, list]] = {}
        self.results: dict[str, Any] = {}
        self.issued_at: dict[str, float] = {}     # perf_counter when a bucket's first collectives started
        self.completed_at: dict[str, float] = {}  # ... when its last one was seen complete
        self.wait_seconds = 0.0                   # time finish blocked on collectives
        # every collective of the step: [name, op, bytes, issued, seen complete or None] (perf_counter)
        self.collectives: list[list] = []
        self._phase_done: dict[str, float] = {}
        self._records: dict[str, list] = {}       # bucket -> the records of its phase in flight
        self._pending: deque = deque()            # (bucket, handle, record) not seen complete, oldest first

    def start(self, key: str, protocol: Protocol) -> None:
        """Run ``protocol`` up to its first phase and start that phase's collectives."""
        self._advance(key, protocol, None)

    def poll(self, pending: deque | None = None) -> None:
        """Note the completion of the collectives in flight (of ``pending``, default all), oldest
        first, up to the first one still running: one Horovod poll per collective seen complete,
        and one more; never blocks."""
        pending = self._pending if pending is None else pending
        now = None
        while pending:
            key, handle, record = pending[0]
            if record[4] is None:
                if not self.comm.poll(handle):
                    return
                now = now or time.perf_counter()
                self._seen(key, record, now)
            pending.popleft()

    def _seen(self, key: str, record: list, when: float) -> None:
        """A collective of bucket ``key`` was seen complete at ``when``; the bucket's phase too
        once all of its collectives were."""
        record[4] = when
        if all(r[4] is not None for r in self._records.get(key, ())):
            self._phase_done.setdefault(key, when)

    def finish(self) -> tuple[dict[str, Any], dict[str, Exception]]:
        """Drive every running protocol to completion, phase by phase across all of them: the
        step's results and errors by bucket (engine/assembly.py ``Driver``). A protocol that
        raises (the same on every rank, e.g. ``nonfinite="raise"``) does not stop the others:
        they finish, so no rank leaves a collective the others wait for."""
        errors: dict[str, Exception] = {}
        while self._running:
            running, self._running = self._running, {}
            pending, self._pending = self._pending, deque()
            self.poll(pending)
            outputs = {key: self._wait(key, handles, records, pending)
                       for key, (_, handles, records) in running.items()}
            for key, (protocol, _, _) in running.items():
                try:
                    self._advance(key, protocol, outputs[key])
                except Exception as error:
                    errors[key] = error
        return dict(self.results), errors

    def execute(self, phase: Phase) -> list:
        """Run one phase, blocking."""
        return self.comm.execute(phase)

    def _wait(self, key: str, handles: list, records: list, pending: deque) -> list:
        """The results of a bucket's phase, blocking; each collective's completion noted as it is
        seen, and the others' that completed meanwhile (a poll after each wait)."""
        outputs = []
        for handle, record in zip(handles, records, strict=True):
            started = time.perf_counter()
            outputs.append(self.comm.wait(handle))
            done = time.perf_counter()
            self.wait_seconds += done - started
            if record[4] is None:
                self._seen(key, record, done)
                self.poll(pending)
        self._phase_done.setdefault(key, max((r[4] for r in records), default=time.perf_counter()))
        return outputs

    def clear(self) -> None:
        """Forget the last step's results and timings; refuses while collectives are in flight."""
        if self._running:
            raise RuntimeError(f"collectives still in flight for {sorted(self._running)}")
        self.results.clear()
        self.issued_at.clear()
        self.completed_at.clear()
        self._phase_done.clear()
        self._records.clear()
        self._pending.clear()
        self.collectives.clear()
        self.wait_seconds = 0.0

    def timeline(self, began: float = 0.0) -> dict[str, tuple[float, float | None]]:
        """Per bucket: (issued, seen complete or None), seconds after ``began`` (perf_counter). A
        bucket still running counts as complete once the collectives it has issued so far are
        done. Polls first."""
        self.poll()
        done = {**self._phase_done, **self.completed_at}
        return {key: (issued - began, None if done.get(key) is None else done[key] - began)
                for key, issued in self.issued_at.items()}

    def collective_timeline(self, began: float = 0.0) -> list[dict]:
        """Every collective of the step, in the order issued: ``name``, ``op``, ``bytes`` (this
        rank's input), ``issued`` and ``completed`` (seconds after ``began``; ``completed`` None
        while not seen complete). Polls first."""
        self.poll()
        return [{"name": name, "op": op, "bytes": size, "issued": issued - began,
                 "completed": None if done is None else done - began}
                for name, op, size, issued, done in self.collectives]

    def inflight_seconds(self, until: float | None = None) -> float:
        """Wall time during which at least one collective was in flight (the union of the
        collectives' issued-to-seen-complete intervals), up to ``until`` (perf_counter) if given:
        with the end of the backward pass, the communication it hid."""
        limit = float("inf") if until is None else until
        intervals = sorted((lo, min(hi, limit)) for _, _, _, lo, hi in self.collectives
                           if hi is not None and lo < limit)
        total, end = 0.0, -float("inf")
        for lo, hi in intervals:
            if hi > end:
                total += hi - max(lo, end)
                end = hi
        return total

    def _advance(self, key: str, protocol: Protocol, sent: list | None) -> None:
        try:
            phase = next(protocol) if sent is None else protocol.send(sent)
        except StopIteration as done:
            self.results[key] = done.value
            if key in self.issued_at:
                self.completed_at[key] = self._phase_done.pop(key, time.perf_counter())
            return
        self._phase_done.pop(key, None)
        issued = time.perf_counter()
        handles = [self.comm.start(c) for c in phase]
        records = [[c.name, c.op, _nbytes(c.tensor), issued, None] for c in phase]
        self.collectives += records
        self._records[key] = records
        self._pending.extend((key, handle, record) for handle, record in zip(handles, records, strict=True))
        self._running[key] = (protocol, handles, records)
        self.issued_at.setdefault(key, issued)
