"""The DDP face's machinery: ``SparseHookState`` (one per model: its worker thread, process group
and engine) and ``hook``, the communication hook every method registers. Users import them, and
the state class of every method, from ``hvd_sparse.torch.ddp`` (docs/ddp.md):

* DDP calls the hook once per gradient bucket, in bucket order, on every rank, and waits for the
  returned futures only at the end of backward. The hook hands the bucket to the state's worker
  thread and returns at once; it never blocks.
* The engine's buckets are the method's own (``Algorithm.plan``: per tensor, the whole model, LAGS's
  groups), keyed by parameter, not by DDP bucket: DDP's first iteration uses another bucket
  layout than later ones (it rebuilds them after the first step), which therefore changes
  nothing. An engine bucket runs as soon as its last tensor has arrived (per-tensor methods and
  LAGS groups: during backward; whole-model methods: at the last DDP bucket), and a DDP bucket's
  future completes once every engine bucket holding one of its tensors has finished.
* The first step waits for the last bucket: it learns the parameter layout, checks on every rank
  that every rank runs the same method, options and layout (engine/agreement.py), then runs.
"""

import contextlib
import time
import warnings
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import timedelta
from functools import partial
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ..algorithms.base import Algorithm
from ..backends import get_backend
from ..comm import run_blocking
from ..comm.torch_distributed import SerialWorker, TorchDistributedComm, run_together
from ..engine import Engine
from ..engine.assembly import Arrivals, Plan
from ..engine.buckets import check_gradient_dtype
from ..errors import ConfigurationError, UnsupportedTensorError
from ..faces import FaceBase
from .optim import LinksTorchOptimizer

_DTYPE_NAME = get_backend("torch").dtype_name


@dataclass
class _Arrival:
    """One DDP bucket, as the hook saw it."""

    index: int
    is_last: bool
    buffer: torch.Tensor
    params: list[torch.Tensor]
    grads: list[torch.Tensor]     # views into ``buffer``, one per parameter
    seen: float                   # perf_counter when the hook ran
    future: torch.futures.Future
    ready: Any = None             # a CUDA event recorded on the hook's stream, or None


@dataclass
class _Step:
    """What the worker keeps of the step in progress."""

    held: list[_Arrival] = field(default_factory=list)   # first step: DDP buckets held until the last
    waiting: list[tuple[_Arrival, list[str]]] = field(default_factory=list)  # futures not set yet
    arrivals: Arrivals = field(default_factory=Arrivals)   # gradients by parameter key, when
    finished: list[str] = field(default_factory=list)  # ... finished without error
    error: Exception | None = None
    timeline: dict[str, tuple[float, float]] = field(default_factory=dict)
    last_seen: float | None = None                    # the last bucket's hook

    @property
    def began(self) -> float:
        """perf_counter() at the first bucket's hook."""
        return self.arrivals.began


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
        self._comm = TorchDistributedComm(_own_group(process_group, timeout))
        self._worker = SerialWorker(f"hvd_sparse.ddp.{algorithm.name}")
        # A state dropped without close() still ends its thread (local, safe at any moment). Its
        # group is only destroyed by close(): garbage collection runs at another moment on every
        # rank, and tearing a group down may be collective (NCCL).
        self._release = weakref.finalize(self, self._worker.close)
        self._release.atexit = False
        self._named: dict[int, tuple[int, str]] = {}   # id(param) -> (position, name)
        self._kept_params: list[torch.Tensor] = []     # keeps those ids meaningful
        for position, (name, param) in enumerate(named_parameters or ()):
            self._named[id(param)] = (position, name)
            self._kept_params.append(param)
        self._key_of: dict[int, str] = {}              # id(param) -> key, from the first step
        self._planned = Plan()                         # engine buckets over the parameter keys
        self._step: _Step | None = None
        self._last: _Step | None = None                # the last finished step, for its timings
        self._failed: Exception | None = None          # a configuration error: every step fails
        self._measuring = False                        # LAGS profiles: wait for the device in hooks
        self._device = torch.device("cpu")

    # --- the hook's side (the autograd thread) -------------------------------------------------------
    def _bucket_ready(self, bucket: dist.GradBucket) -> torch.futures.Future:
        """Hand the bucket to the worker; return the future of its averaged gradients."""
        buffer = bucket.buffer()
        self._refuse(bucket, buffer)
        if self._measuring and buffer.is_cuda:
            torch.cuda.synchronize(buffer.device)
        self._device = buffer.device
        arrival = _Arrival(bucket.index(), bucket.is_last(), buffer, bucket.parameters(),
                           bucket.gradients(), time.perf_counter(), torch.futures.Future(
                               devices=[buffer.device] if buffer.is_cuda else None))
        if buffer.is_cuda:   # the worker's stream waits for the gradients' kernels
            arrival.ready = torch.cuda.Event()
            arrival.ready.record()
        self._worker.submit(partial(self._arrive, arrival))
        return arrival.future.then(_unwrap)

    def _refuse(self, bucket: dist.GradBucket, buffer: torch.Tensor) -> None:
        """Errors that need no message, the same on every rank: raised by the hook itself, before
        any collective (DDP cannot go on after them)."""
        if self._failed is not None:
            raise self._failed
        if buffer.is_sparse or any(g.is_sparse for g in bucket.gradients()):
            raise UnsupportedTensorError(
                "DDP hands hvd_sparse a sparse gradient (an nn.Embedding or EmbeddingBag with "
                "sparse=True): the sparsifiers take dense gradients. Build the layer with "
                "sparse=False; the sparsifier makes its exchange sparse anyway")
        check_gradient_dtype(f"in DDP bucket {bucket.index()}", _DTYPE_NAME(buffer))
        if self._key_of and any(id(p) not in self._key_of for p in bucket.parameters()):
            raise ConfigurationError(
                "a DDP bucket holds parameters this state has not seen in its first step: a state "
                "serves one model. Build one state per DDP model (and a new one for a new model)")

    # --- the worker's side --------------------------------------------------------------------------
    def _arrive(self, arrival: _Arrival) -> None:
        """Worker job for one DDP bucket: file it, run what became ready, complete what is done."""
        if arrival.ready is not None:
            torch.cuda.set_device(arrival.buffer.device)
            arrival.ready.wait()
        if arrival.index == 0 or self._step is None:
            self._begin(arrival.seen)
        step = self._step
        try:
            if not self._key_of:   # first step: everything at the last bucket
                step.held.append(arrival)
                if not arrival.is_last:
                    return
                self._learn_layout(step.held)
                for held in step.held:
                    self._file(step, held)
            else:
                self._file(step, arrival)
            if step.error is None:
                self._run_ready(step)
        except Exception as error:   # this step fails on this rank; the futures say why
            step.error = step.error or error
        if arrival.is_last:
            step.last_seen = arrival.seen
            self._end(step)
        else:
            self._complete_done(step)

    def _begin(self, seen: float) -> None:
        if self._step is not None:   # an earlier backward stopped half-way: nobody waits for it
            self._fail_waiting(self._step, RuntimeError("hvd_sparse: step abandoned"))
        self._step = _Step(arrivals=Arrivals(began=seen))
        self._comm.wait_seconds = 0.0

    def _learn_layout(self, arrivals: list[_Arrival]) -> None:
        """First step: name every parameter, plan the engine's buckets, check that every rank
        runs the same method, options and layout (one tiny allgather; the same error on every
        rank otherwise, before any gradient is exchanged)."""
        # DDP's first-iteration buckets, last bucket first, hold the parameters in model order.
        ordered = [(a.index, i, p, g) for a in arrivals for i, (p, g) in enumerate(zip(a.params, a.grads,
                                                                                          strict=True))]
        ordered.sort(key=lambda entry: (-entry[0], entry[1]))
        unknown = len(self._named)
        keyed = []
        for position, (_, _, param, grad) in enumerate(ordered):
            named_position, name = self._named.get(id(param), (unknown + position, f"p{position}"))
            keyed.append((named_position, name, param, grad))
        keyed.sort(key=lambda entry: entry[0])
        if self._named and any(name not in {n for _, n in self._named.values()} for _, name, _, _ in keyed):
            warnings.warn("hvd_sparse: some of the DDP model's parameters are not in named_parameters "
                          "(another model's?); they are named by position (p0, p1, ...)", stacklevel=2)
        self._key_of = {id(param): name for _, name, param, _ in keyed}
        self._kept_params.extend(param for _, _, param, _ in keyed)
        keys = [name for _, name, _, _ in keyed]
        self._planned.replan(self._plan, keys, [grad.numel() for _, _, _, grad in keyed],
                             [_DTYPE_NAME(grad) for _, _, _, grad in keyed], set())
        layout = [(name, tuple(grad.shape), _DTYPE_NAME(grad)) for _, name, _, grad in keyed]
        engine = self._ensure_engine()
        try:
            run_blocking(engine.agree_on_config(layout, like=keyed[0][3]), self._comm.execute)
        except Exception as error:
            self._failed = error   # every later step fails with it, without a collective
            raise

    def _file(self, step: _Step, arrival: _Arrival) -> None:
        keys = [self._key_of[id(p)] for p in arrival.params]
        step.waiting.append((arrival, keys))
        for key, grad in zip(keys, arrival.grads, strict=True):
            step.arrivals.file(key, grad, arrival.seen)

    def _run_ready(self, step: _Step) -> None:
        """Run, together, every engine bucket whose tensors have all arrived, in plan order."""
        engine = self._ensure_engine()
        ready = step.arrivals.ready(self._planned)
        if not ready:
            return
        issued = time.perf_counter() - step.began
        protocols = {b: engine.step(b, step.arrivals.take(self._planned, b), check_layout=False,
                                    members=self.algorithm.step_members(self._planned.members[b]))
                     for b in ready}
        results, errors = run_together(protocols, self._comm.execute)
        done = time.perf_counter() - step.began
        for b, averaged in results.items():
            for view, out in zip((step.arrivals.tensors[k] for k in self._planned.members[b]), averaged,
                                 strict=True):
                if out is not view:   # written elsewhere (a non-contiguous gradient): copy back
                    view.copy_(out)
            step.finished.append(b)
            step.timeline[b] = (issued, done)
        if errors:
            step.error = step.error or next(iter(errors.values()))

    def _complete_done(self, step: _Step) -> None:
        """Set the futures of the DDP buckets whose engine buckets have all finished."""
        if step.error is not None:
            return   # they fail at the end of the step, with the error
        finished = set(step.finished)
        still = []
        for arrival, keys in step.waiting:
            if all(self._planned.bucket_of[k][0] in finished for k in keys):
                arrival.future.set_result(arrival.buffer)
            else:
                still.append((arrival, keys))
        step.waiting = still

    def _end(self, step: _Step) -> None:
        """The last bucket is in: every engine bucket must have run; then the method's
        once-per-step protocol, and every future completes (with the error, if any)."""
        engine = self._ensure_engine()
        missing = step.arrivals.missing(self._planned)
        if step.error is None and missing:
            step.error = ConfigurationError(
                f"the step ended without the gradients of {missing[:5]}; a state serves one "
                "fixed set of parameters: create a new one")
        if step.error is None:
            try:
                ready = step.arrivals.ready_times(self._planned)
                run_blocking(engine.end_step(ready), self._comm.execute)
                self._measuring = engine.measuring()
            except Exception as error:
                step.error = error
        if step.error is not None:
            engine.take_back(step.finished)   # nothing of the step is applied anywhere
            self._fail_waiting(step, _for_ddp(step.error))
        else:
            self._deliver(self._kept_params)   # before the futures: the optimizer steps after them
            self._complete_done(step)
        self._last, self._step = step, None
        step.timeline["step"] = (0.0, time.perf_counter() - step.began)

    def _fail_waiting(self, step: _Step, error: Exception) -> None:
        for arrival, _ in step.waiting:
            arrival.future.set_result(error)
        for arrival in step.held:
            if not arrival.future.done():
                arrival.future.set_result(error)
        step.waiting, step.held = [], []

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
        step = self._last
        if step is None:
            return {"comm_wait_seconds": 0.0, "comm_inflight_seconds": 0.0}
        total = step.timeline["step"][1]
        tail = total - (step.last_seen - step.began) if step.last_seen is not None else total
        return {"comm_wait_seconds": max(tail, 0.0), "comm_inflight_seconds": self._comm.wait_seconds}

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
        return self._worker.call(lambda: dict(self._last.timeline) if self._last else {})

    def close(self) -> None:
        """Let go of what the state holds beyond its engine: its worker thread (after the steps
        in flight) and its process group. Call it on every rank at the same point, like any group
        teardown; the state serves no further step. A state dropped without it ends its thread
        when it is garbage-collected, and its group stays until torch.distributed is torn down."""
        self._worker.call(lambda: None)
        self._release()
        if self._comm.size == dist.get_world_size() and dist.is_initialized():
            # A group over only some of the ranks is named after them: another state's would take
            # its name (``_own_group``), so such a group is kept.
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


def _for_ddp(error: Exception) -> Exception:
    """A non-finite step's error, with what to do under DDP instead of under Horovod."""
    if isinstance(error, FloatingPointError):
        what = str(error).split(" In PyTorch training can go on")[0]
        return FloatingPointError(
            f"{what} Under DDP this reaches loss.backward() on every rank as a RuntimeError; "
            "training can go on: catch it there, call optimizer.zero_grad() and skip "
            "optimizer.step() (no rank applies this step). Or pass nonfinite='skip' to drop such "
            "a rank's contribution for the step instead")
    return error


def _own_group(process_group: Any, timeout: timedelta | None) -> Any:
    """A new group over ``process_group``'s ranks, with its backend, for the state alone."""
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
