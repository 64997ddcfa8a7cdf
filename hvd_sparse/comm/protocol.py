"""What a step protocol asks of the communication layer.

An engine step is a generator (a "protocol"): it yields a *phase* -- a list of named collectives
that may run concurrently -- receives their results as a list in the same order, and finally
returns its output. Keeping the step free of any communication library lets one protocol run

* over Horovod in PyTorch, asynchronously, overlapping the backward pass (comm/horovod_torch.py),
* over Horovod in TensorFlow, blocking inside ``tf.py_function`` or as graph ops (comm/horovod_tf.py),
* in one process for N simulated ranks in lockstep (comm/local.py), which also checks that every
  rank issues the same collectives in the same order: the property that keeps real jobs from hanging.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any

ALLGATHER = "allgather"   # concatenation along dim 0, in rank order; lengths may differ per rank
ALLREDUCE = "allreduce"   # elementwise sum; shapes must match on every rank
BROADCAST = "broadcast"   # the root's tensor; shapes must match on every rank
NEIGHBOURS = "neighbours"  # [tensor of rank r-1, tensor of rank r+1]; shapes must match


@dataclass(frozen=True)
class Collective:
    """One named collective of a phase. Names are deterministic and identical on every rank."""

    op: str
    name: str
    tensor: Any
    root: int = 0

    def signature(self) -> tuple[str, str, int]:
        """What every rank must issue identically: op, name and root."""
        return (self.op, self.name, self.root)


Phase = list[Collective]
Protocol = Generator[Phase, list, Any]


def run_blocking(protocol: Protocol, execute: Callable[[Phase], list]) -> Any:
    """Drive a protocol to completion, running each phase with ``execute`` (blocking)."""
    try:
        phase = next(protocol)
        while True:
            phase = protocol.send(execute(phase))
    except StopIteration as done:
        return done.value


def run_together(protocols: dict[str, Protocol], execute: Callable[[Phase], list]
                 ) -> tuple[dict[str, Any], dict[str, Exception]]:
    """Drive ``protocols`` to completion together: each round joins the next phase of every
    protocol still running, in ``protocols``' order, into one phase. Returns (results, errors)
    by key. A protocol that raises stops there and the others go on, so that an error raised
    alike on every rank (``nonfinite="raise"``) leaves no collective half issued."""
    results: dict[str, Any] = {}
    errors: dict[str, Exception] = {}
    pending: dict[str, tuple[Protocol, Phase]] = {}

    def advance(key: str, protocol: Protocol, sent: list | None) -> None:
        try:
            phase = next(protocol) if sent is None else protocol.send(sent)
        except StopIteration as done:
            results[key] = done.value
        except Exception as error:  # reported to the caller, per protocol
            errors[key] = error
        else:
            pending[key] = (protocol, phase)

    for key, protocol in protocols.items():
        advance(key, protocol, None)
    while pending:
        running, pending = pending, {}
        joined = [c for _, phase in running.values() for c in phase]
        outputs, start = execute(joined), 0
        for key, (protocol, phase) in running.items():
            advance(key, protocol, outputs[start: start + len(phase)])
            start += len(phase)
    return results, errors


def timed(protocol: Protocol, clock: Any, field: str) -> Protocol:
    """``yield from protocol``, adding to ``clock.<field>`` the seconds the protocol itself ran
    (between being resumed and yielding or returning), not the time it spent suspended on its
    collectives: one clock read per resumption. Drivers only ``send`` into protocols."""
    sent: list | None = None
    while True:
        began = time.perf_counter()
        try:
            phase = protocol.send(sent)
        except StopIteration as done:
            setattr(clock, field, getattr(clock, field) + time.perf_counter() - began)
            return done.value
        setattr(clock, field, getattr(clock, field) + time.perf_counter() - began)
        sent = yield phase


def finished(value: Any) -> Protocol:
    """A protocol that issues no collective and returns ``value``."""
    return value
    yield  # pragma: no cover  (makes this a generator)
