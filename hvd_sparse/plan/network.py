"""What a collective costs on a stated network: the alpha-beta model with the algorithms that
Horovod (Gloo or MPI), NCCL and torch.distributed use for each op.

A link moves ``bandwidth`` bits per second in each direction at once (full duplex, as a switched
Ethernet port or an NVLink lane) after a latency of ``latency`` seconds per message; every
collective also pays ``overhead`` seconds of software time once (Horovod's negotiation and
background-thread cycle, a framework's launch), which on small messages is most of the cost.
The formulas (Thakur, Rabenseifner and Gropp, "Optimization of collective communication
operations in MPICH", 2005; Patarasuk and Yuan, 2009, for the ring's bandwidth optimality), for
N ranks, B the bytes of one rank's tensor, b_i the bytes rank i contributes:

* ring allreduce (Gloo's and NCCL's for large tensors): reduce-scatter then allgather, 2(N-1)
  steps of B/N bytes: ``2(N-1)·alpha + 2(N-1)/N · B/beta``;
* tree allreduce (NCCL's for small tensors at scale; recursive doubling in MPI; ``auto`` takes
  the faster of the two):
  ``2·ceil(log2 N)·alpha + 2·B/beta`` with pipelining (the bandwidth term of a pipelined binary
  tree is twice the message);
* ring allgather of unequal parts (Gloo's allgatherv, NCCL's allgather): N-1 steps; the slowest
  rank receives everything but its own part: ``(N-1)·alpha + (sum b - min b)/beta``;
* broadcast (pipelined chain or binomial tree): ``ceil(log2 N)·alpha + B/beta``;
* neighbour exchange (each rank sends B to each of its two ring neighbours, both directions of
  its link busy at once): ``alpha + 2B/beta`` when both go over one port.

Everything this model assumes is in ``Network.describe()``, which every report prints.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from ..comm.protocol import ALLGATHER, ALLREDUCE, BROADCAST, NEIGHBOURS

RING, TREE, AUTO = "ring", "tree", "auto"
ALGORITHMS = (RING, TREE, AUTO)
UNITS = {"gbit": 1e9, "mbit": 1e6, "kbit": 1e3}


def parse_rate(text: str | float) -> float:
    """Bits per second from ``25gbit``, ``100mbit``, ``1e9`` or a number."""
    if isinstance(text, (int, float)):
        return float(text)
    lowered = text.strip().lower()
    for unit, scale in UNITS.items():
        if lowered.endswith(unit):
            return float(lowered[: -len(unit)]) * scale
    return float(lowered)


@dataclass(frozen=True)
class Network:
    """A homogeneous network of full-duplex links, one port per rank.

    Args:
        bandwidth: bits per second per direction of a rank's link.
        latency: seconds per message (alpha).
        overhead: software seconds per collective, paid once (Horovod's cycle and negotiation).
        allreduce: "ring", "tree" or "auto" (the faster of the two for each message, as NCCL
            chooses by size; Gloo's allreduce is a ring).
        name: how reports call it.
        per_op: {op: (overhead, bandwidth)} measured for an op (a calibration: Horovod's Gloo
            allgather, for one, moves its bytes at about half the allreduce's rate), replacing
            ``overhead`` and ``bandwidth`` for it.
    """

    bandwidth: float
    latency: float = 20e-6
    overhead: float = 0.0
    allreduce: str = RING
    name: str = ""
    per_op: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.bandwidth > 0 or self.latency < 0 or self.overhead < 0:
            raise ValueError(f"bandwidth must be > 0 and latency, overhead >= 0, got {self}")
        if self.allreduce not in ALGORITHMS:
            raise ValueError(f"allreduce must be one of {ALGORITHMS}, got {self.allreduce!r}")

    def describe(self) -> dict:
        """The assumptions, as reports print them."""
        return {**asdict(self), "bandwidth_gbit_s": self.bandwidth / 1e9}

    def seconds(self, op: str, parts: Sequence[int]) -> float:
        """Seconds of one collective whose ranks contribute ``parts`` bytes each (one entry per
        participating rank; for an allreduce or broadcast every entry is the tensor's size)."""
        size = len(parts)
        if size <= 1:
            return 0.0
        overhead, bandwidth = self.per_op.get(op, (self.overhead, self.bandwidth))
        alpha, beta = self.latency, bandwidth / 8.0
        if op == ALLREDUCE:
            return overhead + allreduce_seconds(max(parts), size, alpha, beta, self.allreduce)
        if op == ALLGATHER:
            return overhead + (size - 1) * alpha + (sum(parts) - min(parts)) / beta
        if op == BROADCAST:
            return overhead + math.ceil(math.log2(size)) * alpha + max(parts) / beta
        if op == NEIGHBOURS:
            return overhead + alpha + 2 * max(parts) / beta
        raise ValueError(f"unknown collective op {op!r}")


def allreduce_seconds(nbytes: int, size: int, alpha: float, beta: float, algorithm: str) -> float:
    """An allreduce of ``nbytes`` per rank over ``size`` ranks, without the software overhead."""
    ring = 2 * (size - 1) * alpha + 2 * (size - 1) / size * nbytes / beta
    tree = 2 * math.ceil(math.log2(size)) * alpha + 2 * nbytes / beta
    return {RING: ring, TREE: tree, AUTO: min(ring, tree)}[algorithm]
