"""N simulated ranks in one process: the communication layer of the unit tests and the simulator.

Each rank's protocol is advanced in lockstep. Before a phase is executed, every rank must have
issued the same collectives (op, name, root) with compatible shapes: a rank that skips a
collective, issues it under another name or in another order would hang a real Horovod job; here
it raises ``RankMismatchError`` naming the ranks and collectives.
"""

from __future__ import annotations

import time
from typing import Any, cast

import numpy as np

from ..backends import Backend, get_backend
from ..errors import RankMismatchError
from .protocol import ALLGATHER, ALLREDUCE, BROADCAST, NEIGHBOURS, Collective, Protocol


class LocalGroup:
    """A group of ``size`` simulated ranks sharing one backend (NumPy by default)."""

    def __init__(self, size: int, backend: Backend | str = "numpy"):
        if size < 1:
            raise ValueError(f"a group needs at least one rank, got size={size}")
        self.size = size
        self.backend = get_backend(backend) if isinstance(backend, str) else backend
        self.seconds = [0.0] * size   # time each rank spent in its own protocol (not collectives)

    def run(self, protocols: list[Protocol]) -> list[Any]:
        """Run one protocol per rank to completion; return each rank's result.

        A rank that raises stops there. If every other rank stops too (raising or finishing),
        rank-order's first exception is re-raised, with ``ranks_raised`` listing who raised. If
        another rank goes on to a collective instead, a real job would hang: RankMismatchError.
        """
        if len(protocols) != self.size:
            raise ValueError(f"expected {self.size} protocols (one per rank), got {len(protocols)}")
        results: list[Any] = [None] * self.size
        errors: dict[int, BaseException] = {}
        phases = [self._advance(p, None, rank, results, errors) for rank, p in enumerate(protocols)]
        while any(phase is not None for phase in phases):
            if errors:
                waiting = [rank for rank, phase in enumerate(phases) if phase is not None]
                raise RankMismatchError(
                    f"ranks {sorted(errors)} raised {next(iter(errors.values()))!r} while ranks "
                    f"{waiting} went on to a collective: a real job would hang")
            outputs = self._execute(phases)
            phases = [self._advance(p, outputs[rank], rank, results, errors) if phases[rank] is not None
                      else None for rank, p in enumerate(protocols)]
        if errors:
            first = errors[min(errors)]
            first.__dict__["ranks_raised"] = sorted(errors)   # an attribute of this error object
            raise first
        return results

    def _advance(self, protocol: Protocol, sent: list | None, rank: int, results: list,
                 errors: dict) -> list | None:
        started = time.perf_counter()
        try:
            return next(protocol) if sent is None else protocol.send(sent)
        except StopIteration as done:
            results[rank] = done.value
        except Exception as error:  # reported per rank by run()
            errors[rank] = error
        finally:
            self.seconds[rank] += time.perf_counter() - started
        return None

    def _execute(self, phases: list[list[Collective] | None]) -> list[list]:
        self._check_agreement(phases)
        issued = cast(list[list[Collective]], phases)   # all non-None: checked just above
        outputs: list[list] = [[] for _ in range(self.size)]
        for position, first in enumerate(issued[0]):
            tensors = [issued[rank][position].tensor for rank in range(self.size)]
            for rank, value in enumerate(self._collective(first, tensors)):
                outputs[rank].append(value)
        return outputs

    def _check_agreement(self, phases: list[list[Collective] | None]) -> None:
        """Raise ``RankMismatchError`` unless every rank's phase (None: finished) issues the same
        collectives with compatible shapes and dtypes."""
        def describe(phase):
            return "finished" if phase is None else [c.signature() for c in phase]

        reference = describe(phases[0])
        for rank in range(1, self.size):
            if describe(phases[rank]) != reference:
                raise RankMismatchError(
                    f"ranks issue different collectives (a real job would hang): "
                    f"rank 0 -> {reference}, rank {rank} -> {describe(phases[rank])}")
        if phases[0] is None:
            return
        b, issued = self.backend, cast(list[list[Collective]], phases)   # all alike, and not None
        for position, first in enumerate(issued[0]):
            shapes = [np.shape(b.to_numpy(p[position].tensor)) for p in issued]
            dtypes = {b.dtype_name(p[position].tensor) for p in issued}
            if len(dtypes) != 1:
                raise RankMismatchError(f"{first.name}: ranks send different dtypes {sorted(dtypes)}")
            if first.op == ALLGATHER:
                if len({s[1:] for s in shapes}) != 1 or any(len(s) == 0 for s in shapes):
                    raise RankMismatchError(f"{first.name}: allgather needs tensors of rank >= 1 "
                                            f"that agree beyond dim 0, got {shapes}")
            elif len(set(shapes)) != 1:
                raise RankMismatchError(f"{first.name}: {first.op} needs identical shapes, got {shapes}")

    def _collective(self, first: Collective, tensors: list) -> list:
        """Every rank's result, each in a buffer of its own (as in a real job: a rank may write
        into what it received)."""
        b = self.backend
        if first.op == ALLGATHER:
            gathered = b.concat(list(tensors)) if self.size > 1 else tensors[0]
            return [b.copy(gathered) for _ in range(self.size)]
        if first.op == ALLREDUCE:
            total = tensors[0]
            for t in tensors[1:]:
                total = total + t
            return [b.copy(total) for _ in range(self.size)]
        if first.op == BROADCAST:
            return [b.copy(tensors[first.root]) for _ in range(self.size)]
        if first.op == NEIGHBOURS:
            return [[b.copy(tensors[(r - 1) % self.size]), b.copy(tensors[(r + 1) % self.size])]
                    for r in range(self.size)]
        raise ValueError(f"unknown collective op {first.op!r}")
