"""torch.distributed execution of step protocols: the DDP face's driver, on Gloo or NCCL.

torch.distributed matches the collectives of a process group by the order in which each rank
issues them, not by name (unlike Horovod, docs/architecture.md#collective-rules). So everything
here is issued in one order that every rank derives from the same data:

* ``SerialWorker`` runs jobs one after another on one thread per compressor, so that no two
  threads ever issue collectives on its process group; the DDP hook only hands jobs over and
  returns (a hook never blocks);
* ``TorchDistributedComm.execute`` runs one phase: every collective started asynchronously, in the
  phase's order, then waited for. An allgather whose length differs per rank first learns every
  rank's length -- one all_gather of the lengths of all the phase's allgathers -- and then
  gathers tensors padded to the longest, cut back afterwards;
* ``protocol.run_together`` (used through the step assembly) advances several protocols phase by
  phase, their phases joined into one in a fixed order (the buckets' order), so buckets that are
  ready together share each phase's waits.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from ..errors import ConfigurationError
from .neighbours import neighbours
from .protocol import ALLGATHER, ALLREDUCE, BROADCAST, NEIGHBOURS, Collective, Phase


class TorchDistributedComm:
    """Runs phases of named collectives on a ``torch.distributed`` process group (names are only
    labels here: every rank issues the same collectives in the same order)."""

    def __init__(self, group: Any):
        import torch
        import torch.distributed as dist

        self._torch, self._dist = torch, dist
        # torch >= 2.13 renames all_gather_into_tensor (which it deprecates) to all_gather_single
        self._gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.wait_seconds = 0.0   # time spent waiting for collectives, since the last reset

    def execute(self, phase: Phase) -> list:
        """Run a phase, blocking: start every collective, then wait for each, in phase order."""
        lengths = self._allgather_lengths(phase)
        started = time.perf_counter()
        finishers, column = [], 0
        for c in phase:
            if c.op == ALLGATHER:
                finishers.append(self._allgather(c, lengths[:, column]))
                column += 1
            else:
                finishers.append(self._start(c))
        results = [finish() for finish in finishers]
        self.wait_seconds += time.perf_counter() - started
        return results

    # --- one collective each: start it, return what waits for it and shapes the result -----------
    def _start(self, c: Collective) -> Callable[[], Any]:
        dist, group = self._dist, self.group
        if c.op == ALLREDUCE:
            # A copy: the protocol may still need what it sent (take_back puts it back).
            total = c.tensor.contiguous().clone()
            work = dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group, async_op=True)
            return lambda: (work.wait(), total)[1]
        if c.op == BROADCAST:
            value = c.tensor.contiguous().clone()
            work = dist.broadcast(value, group_src=c.root, group=group, async_op=True)
            return lambda: (work.wait(), value)[1]
        if c.op == NEIGHBOURS:
            return self._neighbours(c)
        raise ValueError(f"unknown collective op {c.op!r}")

    def _allgather_lengths(self, phase: Phase) -> Any:
        """(N, m) the first-dimension length of each of the phase's m allgathers on every rank
        (one small all_gather), or None when the phase has none."""
        gathers = [c.tensor for c in phase if c.op == ALLGATHER]
        if not gathers:
            return None
        torch = self._torch
        for t in gathers:
            if t.dim() == 0:
                raise ValueError("allgather needs tensors of rank >= 1 (a single number travels "
                                 "as a 1-element vector)")
        mine = torch.tensor([t.shape[0] for t in gathers], dtype=torch.int64, device=gathers[0].device)
        every = torch.empty(self.size * len(gathers), dtype=torch.int64, device=mine.device)
        self._gather_into(every, mine, group=self.group)
        return every.reshape(self.size, len(gathers)).cpu()

    def _allgather(self, c: Collective, lengths: Any) -> Callable[[], Any]:
        """Every rank's tensor, concatenated along dim 0 in rank order; ``lengths``: their
        first-dimension lengths, known on every rank."""
        torch, tensor = self._torch, c.tensor.contiguous()
        lengths = [int(n) for n in lengths]
        longest = max(lengths)
        if longest == 0:   # nothing anywhere: no collective (every rank knows it)
            return lambda: tensor.new_empty((0, *tensor.shape[1:]))
        if tensor.shape[0] < longest:
            padded = tensor.new_zeros((longest, *tensor.shape[1:]))
            padded[: tensor.shape[0]] = tensor
            tensor = padded
        out = tensor.new_empty((self.size * longest, *tensor.shape[1:]))
        work = self._gather_into(out, tensor, group=self.group, async_op=True)

        def finish() -> Any:
            work.wait()
            if all(n == longest for n in lengths):
                return out
            return torch.cat([out[r * longest: r * longest + n] for r, n in enumerate(lengths)])
        return finish

    def _neighbours(self, c: Collective) -> Callable[[], Any]:
        """[tensor of rank r-1, tensor of rank r+1]: point-to-point with the two neighbours only.
        A rank sends the same tensor both ways, so with N = 2 (one neighbour, twice) the two
        messages may match in either order."""
        dist, tensor = self._dist, c.tensor.contiguous()
        if self.size == 1:
            return lambda: [tensor.clone(), tensor.clone()]
        left, right = neighbours(self.rank, self.size)
        from_left, from_right = tensor.new_empty(tensor.shape), tensor.new_empty(tensor.shape)
        ops = [dist.P2POp(dist.isend, tensor, group=self.group, group_peer=left),
               dist.P2POp(dist.isend, tensor, group=self.group, group_peer=right),
               dist.P2POp(dist.irecv, from_left, group=self.group, group_peer=left),
               dist.P2POp(dist.irecv, from_right, group=self.group, group_peer=right)]
        works = dist.batch_isend_irecv(ops)

        def finish() -> Any:
            for work in works:
                work.wait()
            return [from_left, from_right]
        return finish


class SerialWorker:
    """One daemon thread running submitted jobs in submission order (module docstring). The
    thread holds no job once it has run it, and ends at ``close()``: an idle worker keeps nothing
    of its owner alive."""

    def __init__(self, name: str):
        self._name = name
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._closed = False

    def submit(self, job: Callable[[], None]) -> None:
        """Run ``job`` after every job submitted before it. A job reports its own errors: one
        that escapes is printed by the thread, which goes on with the next job."""
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self._name}: this worker is closed (its compressor state was closed)")
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
        self._jobs.put(job)

    def call(self, function: Callable[[], Any]) -> Any:
        """``function()`` run on the worker after the jobs already submitted; blocks for its
        result (or raises its error). Called on the worker itself, it runs at once."""
        if threading.current_thread() is self._thread:
            return function()
        done = threading.Event()
        outcome: list = []

        def job() -> None:
            try:
                outcome.append((True, function()))
            except BaseException as error:  # handed to the caller
                outcome.append((False, error))
            finally:
                done.set()

        self.submit(job)
        done.wait()
        ok, value = outcome[0]
        if not ok:
            raise value
        return value

    def close(self) -> None:
        """End the thread once the jobs already submitted have run; later submits raise."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._thread is not None and self._thread.is_alive():
                self._jobs.put(None)

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                job()
            except Exception:   # a job's own bookkeeping failed: say so, keep serving
                import traceback

                traceback.print_exc()
            job = None   # a finished job (and what it holds: a state, DDP's buffers) is let go


def own_group(process_group: Any, timeout: timedelta | None) -> Any:
    """A new group over ``process_group``'s ranks, with its backend, for a DDP state alone."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise ConfigurationError(
            "torch.distributed is not initialized: call torch.distributed.init_process_group() "
            "(backend 'gloo' for CPU, 'nccl' for CUDA; torchrun sets the environment it reads) "
            "before building an hvd_sparse DDP state")
    group = process_group if process_group is not None else dist.group.WORLD
    ranks = dist.get_process_group_ranks(group)
    # Over every rank, every rank builds the state: a group numbered like any other, so that a
    # later state's group never meets a closed one's leftovers in the store. Over some of the
    # ranks, only they build it: torch names such a group after its ranks (local synchronization).
    # Such a group is therefore never destroyed (``close``): another built over the same ranks
    # later would take its name.
    return dist.new_group(ranks=ranks, backend=dist.get_backend(group), timeout=timeout,
                          use_local_synchronization=len(ranks) < dist.get_world_size())
