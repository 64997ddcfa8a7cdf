"""The DDP face's machinery: ``SparseHookState`` (one per model: its worker thread, process group
and step assembly) and ``hook``, the communication hook every method registers. Users import them,
and the state class of every method, from ``hvd_sparse.torch.ddp`` (docs/ddp.md).

DDP calls the hook once per gradient bucket, in bucket order, and waits for the futures only at
the end of backward: the hook hands the bucket to the worker thread and returns at once. The
engine's buckets are the method's own, keyed by parameter (engine/assembly.py); one runs as soon as
its last tensor has arrived, and a DDP bucket's future completes once every engine bucket holding
one of its tensors has finished. The first step waits for the last DDP bucket: it learns the
parameter layout and checks that every rank runs the same method, options and layout.
"""

import contextlib
import time
import weakref
from collections.abc import Iterable
from datetime import timedelta
from functools import partial
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ..algorithms.base import Algorithm
from ..backends import get_backend
from ..comm.torch_distributed import SerialWorker, TorchDistributedComm, own_group
from ..engine import Engine
from ..engine.buckets import check_gradient_dtype
from ..errors import ConfigurationError, UnsupportedTensorError
from ..faces import FaceBase
from .ddp_steps import Arrival, DDPSteps
from .optim import LinksTorchOptimizer
from .parameters import DTYPE_NAME, NamedParameters


class SparseHookState(LinksTorchOptimizer, FaceBase):
    """State of ``hook``, a DDP communication hook running ``algorithm``.

    Args:
        algorithm: the method and its hyper-parameters.
        named_parameters: the model's ``named_parameters()`` (recommended): buckets, checkpoints
            and errors then use the parameters' names, and the whole-model vector is laid out in
            this order, as under Horovod. Without it parameters are named ``p0``, ``p1``, ... in
            the order of DDP's first-iteration buckets (the model's parameter order when every
            parameter has one dtype).
        process_group: the group DDP reduces over (default: the default group); pass DDP's own.
            The state runs its collectives on a new group over the same ranks (created here, on
            every rank of that group), so that they never interleave with DDP's or the
            training loop's own.
        nonfinite: what a rank does with a NaN/Inf gradient: "skip" (send zeros this step, keep
            the residual, warn), "raise" (every rank's ``loss.backward()`` raises; the step is
            applied nowhere and training can go on, docs/ddp.md) or "ignore".
        timeout: how long one of the state's collectives may wait for the other ranks before it
            fails (a ``datetime.timedelta``; default: torch.distributed's default for the backend).
        optimizer: the torch optimizer stepping the DDP model. ``hvd_sparse.torch.optim.AdamW``
            (or ``Adam``) turns the Adam path on (docs/methods.md#adam-and-adamw); torch's own
            Adam/AdamW is refused, naming that fix; another optimizer is only checked.
    """

    framework = "ddp"

    def __init__(self, algorithm: Algorithm, *, named_parameters: Iterable | None = None,
                 process_group: Any = None, nonfinite: str = "skip", timeout: timedelta | None = None,
                 optimizer: Any = None):
        FaceBase.__init__(self, algorithm, process_set=process_group, nonfinite=nonfinite,
                          optimizer=optimizer)
        if timeout is not None and not isinstance(timeout, timedelta):
            raise ConfigurationError(f"timeout must be a datetime.timedelta, got {timeout!r}")
        self._comm = TorchDistributedComm(own_group(process_group, timeout))
        self._worker = SerialWorker(f"hvd_sparse.ddp.{algorithm.name}")
        # A state dropped without close() still ends its thread (local, safe at any moment). Its
        # group is only destroyed by close(): garbage collection runs at another moment on every
        # rank, and tearing a group down may be collective (NCCL).
        self._release = weakref.finalize(self, self._worker.close)
        self._release.atexit = False
        self._steps = DDPSteps(algorithm, self._comm, NamedParameters(named_parameters),
                               self._ensure_engine, self._deliver)
        self._device = torch.device("cpu")

    # --- the hook's side (the autograd thread) -------------------------------------------------------
    def _bucket_ready(self, bucket: dist.GradBucket) -> torch.futures.Future:
        """Hand the bucket to the worker; return the future of its averaged gradients."""
        buffer = bucket.buffer()
        self._refuse(bucket, buffer)
        if self._steps.measuring and buffer.is_cuda:
            torch.cuda.synchronize(buffer.device)
        self._device = buffer.device
        arrival = Arrival(bucket.index(), bucket.is_last(), buffer, bucket.parameters(),
                          bucket.gradients(), time.perf_counter(), torch.futures.Future(
                              devices=[buffer.device] if buffer.is_cuda else None))
        if buffer.is_cuda:   # the worker's stream waits for the gradients' kernels
            arrival.ready = torch.cuda.Event()
            arrival.ready.record()
        self._worker.submit(partial(self._steps.arrive, arrival))
        return arrival.future.then(_unwrap)

    def _refuse(self, bucket: dist.GradBucket, buffer: torch.Tensor) -> None:
        """Errors that need no message, the same on every rank: raised by the hook itself, before
        any collective (DDP cannot go on after them)."""
        if self._steps.failed is not None:
            raise self._steps.failed
        if buffer.is_sparse or any(g.is_sparse for g in bucket.gradients()):
            raise UnsupportedTensorError(
                "DDP hands hvd_sparse a sparse gradient (an nn.Embedding or EmbeddingBag with "
                "sparse=True): the sparsifiers take dense gradients. Build the layer with "
                "sparse=False; the sparsifier makes its exchange sparse anyway")
        check_gradient_dtype(f"in DDP bucket {bucket.index()}", DTYPE_NAME(buffer))
        key_of = self._steps.key_of
        if key_of and any(id(p) not in key_of for p in bucket.parameters()):
            raise ConfigurationError(
                "a DDP bucket holds parameters this state has not seen in its first step: a state "
                "serves one model. Build one state per DDP model (and a new one for a new model)")

    # --- FaceBase ------------------------------------------------------------------------------------
    def _make_engine(self) -> Engine:
        # DDP hands over its bucket; the average is written into the bucket's views of it.
        return Engine(self.algorithm, get_backend("torch"), self._comm.rank, self._comm.size,
                      self.prefix, self.nonfinite, write_into_inputs=True)

    def _current_world(self) -> tuple[int, int]:
        return self._comm.rank, self._comm.size

    def _sum_over_ranks(self, values: np.ndarray, name: str) -> np.ndarray:
        def allreduce() -> np.ndarray:
            summed = torch.from_numpy(values).to(self._device)
            dist.all_reduce(summed, op=dist.ReduceOp.SUM, group=self._comm.group)
            return summed.cpu().numpy()
        return self._worker.call(allreduce)

    def _extra_stats(self) -> dict:
        if self._steps.last is None:
            return {"comm_wait_seconds": 0.0, "comm_inflight_seconds": 0.0}
        return {"comm_wait_seconds": max(self._steps.tail_seconds(), 0.0),
                "comm_inflight_seconds": self._comm.wait_seconds}

    # The worker may be inside a step: what reads or changes the engine waits for it.
    def stats(self) -> dict:
        """The last step's statistics (FaceBase.stats), read once the worker has finished it."""
        return self._worker.call(super().stats)

    def state_dict(self) -> dict:
        """This rank's checkpoint (FaceBase.state_dict), taken between steps on the worker."""
        return self._worker.call(super().state_dict)

    def load_state_dict(self, state: dict) -> None:
        """Restore a checkpoint (FaceBase.load_state_dict) on the worker, between steps."""
        self._worker.call(partial(FaceBase.load_state_dict, self, state))

    def communication_timeline(self) -> dict[str, tuple[float, float]]:
        """The last step's engine buckets: (issued, completed), seconds after its first bucket's
        hook; ``"step"``: (0, when the step's last future was set)."""
        return self._worker.call(self._steps.timeline)

    def close(self) -> None:
        """Let go of what the state holds beyond its engine: its worker thread (after the steps
        in flight) and its process group. Call it on every rank at the same point, like any group
        teardown; the state serves no further step. A state dropped without it ends its thread
        when it is garbage-collected, and its group stays until torch.distributed is torn down."""
        self._worker.call(lambda: None)
        self._release()
        if self._comm.size == dist.get_world_size() and dist.is_initialized():
            # A group over only some of the ranks is named after them: another state's would take
            # its name (``own_group``), so such a group is kept.
            with contextlib.suppress(ValueError, RuntimeError):   # already torn down with the others
                dist.destroy_process_group(self._comm.group)

    def __repr__(self) -> str:
        return f"hvd_sparse.torch.ddp.{self.algorithm!r}"


def hook(state: SparseHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The communication hook of every hvd_sparse method:
    ``model.register_comm_hook(hvd_sparse.torch.ddp.TopK(density=0.01), hvd_sparse.torch.ddp.hook)``."""
    if not isinstance(state, SparseHookState):
        raise ConfigurationError(
            f"hvd_sparse.torch.ddp.hook got state {state!r}; register it with an hvd_sparse DDP "
            "state: model.register_comm_hook(hvd_sparse.torch.ddp.TopK(density=0.01), "
            "hvd_sparse.torch.ddp.hook)")
    return state._bucket_ready(bucket)


def _unwrap(future: torch.futures.Future) -> torch.Tensor:
    """The worker sets an error as the value (DDP would read an exception set with
    ``set_exception`` as a value); raising it here makes the future fail, and backward raise."""
    value = future.value()
    if isinstance(value, BaseException):
        raise value
    return value


