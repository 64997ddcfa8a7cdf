"""Horovod (TensorFlow) execution of step protocols.

Two ways, both deadlock-free:

* ``execute`` runs a phase with eager, blocking Horovod ops. It is used inside the single
  ``tf.py_function`` of a whole-model step: one such function per step and per rank, so every
  rank issues the same collectives in the same order.
* ``graph_op`` emits one collective as a graph op (Horovod's TF ops are asynchronous kernels),
  used between the ``tf.py_function`` phases of per-tensor steps: many tensors' steps may then
  run in any order on different ranks, and Horovod still matches them by name.
"""

from __future__ import annotations

from typing import Any

from .neighbours import HorovodNeighbourChoice, neighbour_payload, neighbour_splits, split_neighbours
from .protocol import ALLGATHER, ALLREDUCE, BROADCAST, NEIGHBOURS, Collective


class HorovodTFComm(HorovodNeighbourChoice):
    """Named Horovod collectives on a process set, eager or as graph ops."""

    def __init__(self, process_set: Any = None):
        import horovod.tensorflow as hvd

        self._hvd = hvd
        self.process_set = process_set if process_set is not None else hvd.global_process_set
        self.rank = self.process_set.rank()
        self.size = self.process_set.size()
        self._mpi: Any = None       # the mpi4py exchange, decided at the first neighbour exchange
        self._mpi_decided = False

    def graph_op(self, op: str, tensor: Any, name: str, root: int = 0) -> Any:
        """The Horovod graph op of one collective (allgather, allreduce, broadcast) on ``tensor``."""
        hvd, ps = self._hvd, self.process_set
        if op == ALLGATHER:
            return hvd.allgather(tensor, name=name, ignore_name_scope=True, process_set=ps)
        if op == ALLREDUCE:
            return hvd.allreduce(tensor, op=hvd.Sum, name=name, ignore_name_scope=True, process_set=ps)
        if op == BROADCAST:
            return hvd.broadcast(tensor, root_rank=root, name=name, ignore_name_scope=True,
                                 process_set=ps)
        raise ValueError(f"unknown collective op {op!r}")

    def execute(self, phase: list[Collective]) -> list:
        """Run a phase eagerly (inside a py_function), blocking."""
        return [self._neighbours(c) if c.op == NEIGHBOURS else self.graph_op(c.op, c.tensor, c.name, c.root)
                for c in phase]

    def _neighbours(self, c: Collective) -> list:
        import tensorflow as tf

        payload = c.tensor.numpy()
        if self._mpi_exchange() is not None:
            received = self._mpi.wait(self._mpi.start(payload, c.name))
            return [tf.constant(x) for x in received]
        splits = tf.constant(neighbour_splits(self.rank, self.size, len(payload)), dtype=tf.int32)
        data = tf.constant(neighbour_payload(payload, self.rank, self.size))
        received = self._hvd.alltoall(data, splits=splits, name=c.name, ignore_name_scope=True,
                                      process_set=self.process_set)
        if isinstance(received, (tuple, list)):
            received = received[0]
        return split_neighbours(received, self.rank, self.size, len(payload))
