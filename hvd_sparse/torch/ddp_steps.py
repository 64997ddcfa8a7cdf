"""The worker's side of the DDP face: DDP's gradient buckets, as the hook hands them over, mapped
onto the step assembly (engine/assembly.py). Everything here runs on the state's worker thread, one
job per DDP bucket, so collectives are issued in one order on every rank."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..algorithms.base import Algorithm
from ..backends import get_backend
from ..comm import run_blocking
from ..comm.torch_distributed import TorchDistributedComm
from ..engine import Engine
from ..engine.assembly import StepAssembly, Together
from .parameters import DTYPE_NAME, NamedParameters


@dataclass
class Arrival:
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
    """What the worker keeps of the step in progress besides its gradients (the assembly's), and,
    once it ended, what ``stats()`` and ``communication_timeline()`` read of it: they run on the
    worker between DDP buckets, so the next step may have begun in the assembly by then."""

    began: float                      # perf_counter() at the first bucket's hook
    held: list[Arrival] = field(default_factory=list)   # first step: DDP buckets held until the last
    waiting: list[tuple[Arrival, list[str]]] = field(default_factory=list)  # futures not set yet
    error: Exception | None = None
    last_seen: float | None = None    # perf_counter() at the last bucket's hook
    ended: float = 0.0                # seconds from the first bucket's hook to the last future
    timeline: dict[str, tuple[float, float | None]] = field(default_factory=dict)  # engine buckets


class DDPSteps:
    """The steps of one DDP state: parameter keys learnt at the first step, the assembly, the
    step in progress and the last one (for its timings). ``engine`` gives the state's engine (a
    new one after a restore); ``deliver`` hands the Adam path its parameters after a step."""

    def __init__(self, algorithm: Algorithm, comm: TorchDistributedComm, params: NamedParameters,
                 engine: Callable[[], Engine], deliver: Callable[[Iterable], None]):
        self.comm, self.params = comm, params
        self.driver = Together(comm.execute)
        self.assembly = StepAssembly(algorithm, get_backend("torch"))
        self.key_of: dict[int, str] = {}        # id(param) -> key, from the first step
        self.step: _Step | None = None
        self.last: _Step | None = None          # the last finished step, for its timings
        self.failed: Exception | None = None    # a configuration error: every step fails
        self.measuring = False                  # LAGS profiles: the hooks wait for the device
        self._engine, self._deliver = engine, deliver

    def arrive(self, arrival: Arrival) -> None:
        """Worker job for one DDP bucket: file it, run what became ready, complete what is done."""
        if arrival.ready is not None:
            torch.cuda.set_device(arrival.buffer.device)
            arrival.ready.wait()
        if arrival.index == 0 or self.step is None:
            self._begin(arrival.seen)
        step = self.step
        try:
            if not self.key_of:   # first step: everything at the last bucket
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
        if self.step is not None:   # an earlier backward stopped half-way: nobody waits for it
            self._fail_waiting(self.step, RuntimeError("hvd_sparse: step abandoned"))
        self.step = _Step(began=seen)
        self.assembly.begin(seen)
        self.comm.wait_seconds = 0.0

    def _learn_layout(self, arrivals: list[Arrival]) -> None:
        """First step: name every parameter, plan the engine's buckets, check that every rank
        runs the same method, options and layout (one tiny allgather; the same error on every
        rank otherwise, before any gradient is exchanged)."""
        # DDP's first-iteration buckets, last bucket first, hold the parameters in model order.
        ordered = sorted(((-a.index, i, p, g) for a in arrivals for i, (p, g) in
                          enumerate(zip(a.params, a.grads, strict=True))), key=lambda e: e[:2])
        keyed = self.params.keyed([(p, g) for _, _, p, g in ordered])
        self.key_of = {id(param): name for name, param, _ in keyed}
        self.params.kept.extend(param for _, param, _ in keyed)
        self.assembly.replan([name for name, _, _ in keyed], [grad.numel() for _, _, grad in keyed],
                              [DTYPE_NAME(grad) for _, _, grad in keyed])
        layout = [(name, tuple(grad.shape), DTYPE_NAME(grad)) for name, _, grad in keyed]
        engine = self._engine()
        try:
            run_blocking(engine.agree_on_config(layout, like=keyed[0][2]), self.comm.execute)
        except Exception as error:
            self.failed = error   # every later step fails with it, without a collective
            raise

    def _file(self, step: _Step, arrival: Arrival) -> None:
        keys = [self.key_of[id(p)] for p in arrival.params]
        step.waiting.append((arrival, keys))
        for key, grad in zip(keys, arrival.grads, strict=True):
            self.assembly.file(key, grad, arrival.seen)

    def _run_ready(self, step: _Step) -> None:
        """Run, together, every engine bucket whose tensors have all arrived, in plan order."""
        engine, assembly = self._engine(), self.assembly
        if not assembly.start_ready(engine, self.driver, check_layout=False):
            return
        try:
            results = assembly.finish(engine, self.driver, keep=False)
        except Exception as error:   # every bucket finished this step is taken back
            step.error = step.error or error
            return
        for bucket, averaged in results.items():
            views = (assembly.arrivals.tensors[key] for key in assembly.plan.members[bucket])
            for view, out in zip(views, averaged, strict=True):
                if out is not view:   # written elsewhere (a non-contiguous gradient): copy back
                    view.copy_(out)

    def _complete_done(self, step: _Step) -> None:
        """Set the futures of the DDP buckets whose engine buckets have all finished."""
        if step.error is not None:
            return   # they fail at the end of the step, with the error
        finished, bucket_of = set(self.assembly.done), self.assembly.plan.bucket_of
        still = []
        for arrival, keys in step.waiting:
            if all(bucket_of[k][0] in finished for k in keys):
                arrival.future.set_result(arrival.buffer)
            else:
                still.append((arrival, keys))
        step.waiting = still

    def _end(self, step: _Step) -> None:
        """The last bucket is in: the step's end (every engine bucket must have run; the method's
        once-per-step protocol), and every future completes (with the error, if any)."""
        engine = self._engine()
        if step.error is None:
            try:
                self.assembly.end(engine, self.driver)
                self.measuring = engine.measuring()
            except Exception as error:
                step.error = error
        if step.error is not None:
            self.assembly.take_back(engine)   # nothing of the step is applied anywhere
            self._fail_waiting(step, for_ddp(step.error))
        else:
            self._deliver(self.params.kept)   # before the futures: the optimizer steps after them
            self._complete_done(step)
        step.ended = time.perf_counter() - step.began
        step.timeline = {**self.assembly.timeline(), "step": (0.0, step.ended)}
        self.last, self.step = step, None

    def _fail_waiting(self, step: _Step, error: Exception) -> None:
        for arrival, _ in step.waiting:
            arrival.future.set_result(error)
        for arrival in step.held:
            if not arrival.future.done():
                arrival.future.set_result(error)
        step.waiting, step.held = [], []

    def timeline(self) -> dict[str, tuple[float, float | None]]:
        """The last step's engine buckets and ``"step"`` (``SparseHookState.communication_timeline``)."""
        return {} if self.last is None else dict(self.last.timeline)

    def tail_seconds(self) -> float:
        """How long the last step went on after its last bucket's hook (0 before any step)."""
        last = self.last
        if last is None:
            return 0.0
        return last.ended - (last.last_seen - last.began) if last.last_seen is not None else last.ended


def for_ddp(error: Exception) -> Exception:
    """A non-finite step's error, with what to do under DDP instead of under Horovod."""
    if isinstance(error, FloatingPointError):
        what = str(error).split(" In PyTorch training can go on")[0]
        return FloatingPointError(
            f"{what} Under DDP this reaches loss.backward() on every rank as a RuntimeError; "
            "training can go on: catch it there, call optimizer.zero_grad() and skip "
            "optimizer.step() (no rank applies this step). Or pass nonfinite='skip' to drop such "
            "a rank's contribution for the step instead")
    return error
