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

from .protocol import ALLGATHER, ALLREDUCE, BROADCAST, Collective


class HorovodTFComm:
    """Named Horovod collectives on a process set, eager or as graph ops."""

    def __init__(self, process_set: Any = None):
        import horovod.tensorflow as hvd

        self._hvd = hvd
        self.process_set = process_set if process_set is not None else hvd.global_process_set
        self.rank = self.process_set.rank()
        self.size = self.process_set.size()

    def graph_op(self, op: str, tensor: Any, name: str, root: int = 0) -> Any:
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
        return [self.graph_op(c.op, c.tensor, c.name, c.root) for c in phase]
