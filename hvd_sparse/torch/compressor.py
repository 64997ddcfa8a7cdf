"""The PyTorch face: a Horovod ``Compressor`` running an hvd_sparse method, an adapter of the step
assembly (engine/assembly.py) onto Horovod's contract, unpatched. ``compress`` (each gradient's
backward hook) files the gradient, starts a bucket it completes with asynchronous collectives
(``AsyncProtocols``) and returns a one-element placeholder for Horovod to allreduce; the step's
first ``decompress`` (every rank has issued every ``compress`` by then) finishes the step, and
every ``decompress`` returns its piece. The first ``compress`` of the job checks that every rank
runs the same method, options and model (engine/agreement.py). docs/architecture.md#pytorch-face
says why each part is where it is.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import horovod.torch as hvd
import numpy as np
import torch
from horovod.torch.compression import Compressor

from ..algorithms.base import Algorithm
from ..backends import get_backend
from ..comm import run_blocking
from ..comm.horovod_torch import AsyncProtocols, HorovodTorchComm
from ..engine import Engine
from ..engine.assembly import StepAssembly
from ..engine.buckets import check_gradient_dtype
from ..faces import FaceBase, refuse_reduction_op
from .horovod_internals import calling_optimizer
from .optim import LinksTorchOptimizer, optimizer_momentum  # noqa: F401  (public here too)
from .parameters import DTYPE_NAME, NamedParameters
from .step_record import HorovodStep

_PLACEHOLDER_DTYPES = (torch.float16, torch.float32, torch.float64)
_SPARSIFIABLE = (*_PLACEHOLDER_DTYPES, torch.bfloat16)


class SparseCompressor(LinksTorchOptimizer, FaceBase, Compressor):
    """Horovod compressor running ``algorithm`` (an ``hvd_sparse.algorithms.Algorithm``).

    Args:
        algorithm: the method and its hyper-parameters.
        named_parameters: the model's ``named_parameters()`` (recommended). Gradients are then
            matched to parameters by identity and collectives are named after the parameter;
            without it they are named by their order within the step, which relies on every rank
            running the backward hooks in the same order. With it, the first gradient hook also
            checks that every rank has the same model (docs/usage.md#ranks-that-disagree).
        process_set: the Horovod process set the optimizer reduces over (default: global).
        prefix: prefix of every collective's name; give two compressors in one job distinct ones.
        nonfinite: what a rank does with a NaN/Inf gradient: "skip" (send zeros this step, keep
            the residual, warn), "raise" (every rank raises FloatingPointError; the step is
            applied nowhere and training can go on, docs/usage.md#non-finite-gradients) or "ignore".
        optimizer: the torch optimizer then wrapped in ``hvd.DistributedOptimizer``.
            ``hvd_sparse.torch.optim.AdamW`` (or ``Adam``) turns the Adam path on
            (docs/methods.md#adam-and-adamw); torch's own Adam/AdamW is refused, naming that fix;
            another optimizer is only checked.
    """

    framework = "torch"

    def __init__(self, algorithm: Algorithm, *, named_parameters: Iterable | None = None,
                 process_set: Any = None, prefix: str = "hvd_sparse", nonfinite: str = "skip",
                 optimizer: Any = None):
        FaceBase.__init__(self, algorithm, process_set=process_set, prefix=prefix, nonfinite=nonfinite,
                          optimizer=optimizer)
        self._params = NamedParameters(named_parameters)
        self._config_checked = False
        self._protocols: AsyncProtocols | None = None       # made with the engine
        self._assembly = StepAssembly(algorithm, get_backend("torch"))
        self._param_of: dict[str, torch.nn.Parameter | None] = {}   # Adam path: key -> parameter
        self._step = HorovodStep()

    # --- Horovod's interface --------------------------------------------------------------------
    def compress(self, tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Horovod's call per gradient, in its backward hook: file the gradient and start its
        bucket if that completes it. Returns the one-element placeholder Horovod allreduces (in
        the gradient's precision where Horovod can move it) and the gradient's key, which
        ``decompress`` receives back."""
        # Refused before anything else, so that every rank fails here before any collective; the
        # caller is read here, in compress itself (calling_optimizer reads compress's caller).
        entered = time.perf_counter()
        optimizer, op = calling_optimizer(self)
        refuse_reduction_op(op, hvd)
        if optimizer is not None and not (self._optimizer_seen and self._stock_adam_warned):
            self._note_optimizer(optimizer)
        if tensor.dtype not in _SPARSIFIABLE:
            check_gradient_dtype(self._params.describe(tensor), DTYPE_NAME(tensor))
        first = self._step.outstanding == 0   # the first gradient of a new step
        if first:
            self._follow_world()
        engine = self._ensure_engine()
        if not self._config_checked:
            self._agree_on_config(engine, tensor)
        key = self._file(tensor, self._arrival_time(engine, tensor, first))
        if self._adam_link is not None and key not in self._param_of:
            self._param_of[key] = self._params.parameter_of(tensor, optimizer)
        self._running().poll()
        dtype = tensor.dtype if tensor.dtype in _PLACEHOLDER_DTYPES else torch.float32
        placeholder = torch.zeros(1, dtype=dtype, device=tensor.device)
        step = self._step
        step.backward_end = time.perf_counter()
        step.hook_seconds += step.backward_end - entered
        return placeholder, key

    def decompress(self, tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        """Horovod's call per gradient when the optimizer steps: the gradient's average over ranks.
        The first call of a step finishes the whole step (by then every rank has issued every
        ``compress``), the later ones return their piece."""
        entered, step = time.perf_counter(), self._step
        try:
            if not step.flushed:
                step.flushed = True
                step.decompress_began = entered
                self._finish_step(tensor)
            step.outstanding -= 1
            if step.failed is None:
                return self._assembly.result(ctx)
            if step.outstanding > 0:
                # Raised at the last decompress only, so that Horovod has waited for every
                # placeholder allreduce of the step: raising earlier would leave some in flight, and
                # the next step's hooks would reuse their names (docs/usage.md#non-finite-gradients).
                return self._assembly.arrivals.tensors[ctx]
            raise step.failed
        finally:
            step.decompress_ended = time.perf_counter()
            step.decompress_seconds += step.decompress_ended - entered

    # --- the parts of a step ----------------------------------------------------------------------
    def _agree_on_config(self, engine: Engine, tensor: torch.Tensor) -> None:
        """At the job's first gradient (and after an elastic reset), before any collective of the
        step: a rank that differs fails now, with every other rank, instead of hanging."""
        self._config_checked = True
        run_blocking(engine.agree_on_config(self._params.layout, like=tensor), self._running().execute)

    def _arrival_time(self, engine: Engine, tensor: torch.Tensor, first: bool) -> float:
        """When the gradient arrived (waiting for the device first in a measuring step); the first
        gradient of a step begins the step there and drops the last step's protocols."""
        measuring = engine.measuring() and tensor.is_cuda if first else self._step.measuring
        if measuring:
            torch.cuda.synchronize(tensor.device)
        now = time.perf_counter()
        if first:
            self._running().clear()
            self._step = HorovodStep(measuring=measuring)
            self._assembly.begin(now)
        return now

    def _file(self, tensor: torch.Tensor, now: float) -> str:
        """Keep the gradient and start its bucket if it is complete; its key."""
        step = self._step
        step.outstanding += 1
        key = self._params.name_of(tensor)
        if key is None:   # named by its order in the step: "t0", "t1", ...
            key, step.ordinal = f"t{step.ordinal}", step.ordinal + 1
        bucket = self._assembly.file(key, tensor, now)
        if bucket is not None:   # complete: communicate during backward
            self._assembly.start(bucket, self._ensure_engine(), self._running())
        return key

    def _finish_step(self, like: torch.Tensor) -> None:
        """At the first decompress of a step: plan the buckets (first step, or a changed set of
        gradients), check the layout where ``named_parameters`` could not, start every bucket not
        started yet, drive every protocol to completion, then run the once-per-step protocol."""
        engine, protocols, assembly = self._ensure_engine(), self._running(), self._assembly
        assembly.plan_arrived(self._params.in_order)
        if not engine.config_agreed():  # without named_parameters: the layout seen now
            run_blocking(engine.agree_on_config(assembly.layout(), like=like), protocols.execute)
        assembly.start_ready(engine, protocols)
        try:
            assembly.finish(engine, protocols)
        except FloatingPointError as error:   # alike on every rank; raised at the last decompress
            self._step.failed = error
            return
        except Exception:
            self._step.outstanding = 0
            raise
        began = time.perf_counter()
        assembly.end(engine, protocols)
        self._step.end_step_seconds += time.perf_counter() - began
        self._deliver(p for p in map(self._param_of.get, assembly.arrivals.tensors) if p is not None)

    # --- what only this face measures -----------------------------------------------------------
    def _extra_stats(self) -> dict:
        return self.step_times()

    def step_times(self) -> dict:
        """Where this step's time went on this rank (the last step's, between steps), in seconds;
        cheap (no pass over any data), so it may be read every step; ``stats()`` includes it. The
        engine's parts (engine/stats.py ``StepTimes``) and the face's (``HorovodStep.times``:
        in the hooks, in ``decompress``, blocked on collectives, in flight, hidden by the
        backward pass and exposed after it), as docs/usage.md#statistics lists them."""
        return {**self._ensure_engine().step_times(), **self._step.times(self._running())}

    def step_marks(self) -> dict:
        """When this step's landmarks happened, as ``time.perf_counter()`` values (the last step's
        between steps): ``began`` (the first gradient hook), ``backward_end`` (the last hook
        returned), ``decompress_began`` (the first decompress was entered: Horovod waited for its
        own allreduces before), ``decompress_ended`` (the last decompress so far returned). For
        profilers that read the same clock."""
        return self._step.marks(self._assembly.arrivals.began)

    def collective_timeline(self) -> list[dict]:
        """Every collective of this step (the last step's, between steps), in the order issued:
        ``name``, ``op``, ``bytes`` (this rank's input), ``issued`` and ``completed`` (seconds after
        the step's first gradient; ``completed`` None while not seen complete). Polls first."""
        began = self._assembly.arrivals.began
        return [] if self._protocols is None else self._protocols.collective_timeline(began)

    def communication_timeline(self) -> dict[str, tuple[float, float | None]]:
        """This step's buckets (the last step's, between steps): (issued, completed) in seconds
        after the step's first gradient, ``completed`` None while not seen complete. Polls the
        collectives in flight first, so it may be called from a backward hook."""
        return {} if self._protocols is None else self._protocols.timeline(self._assembly.arrivals.began)

    def _sum_over_ranks(self, values: np.ndarray, name: str) -> np.ndarray:
        summed = hvd.allreduce(torch.from_numpy(values), op=hvd.Sum, name=name,
                               process_set=self._running().comm.process_set)
        return summed.numpy()

    # --- internals --------------------------------------------------------------------------------
    def _running(self) -> AsyncProtocols:
        """The protocols in flight on the engine's communication layer (made with the engine)."""
        self._ensure_engine()
        assert self._protocols is not None, "_make_engine makes them"
        return self._protocols

    def _make_comm(self) -> HorovodTorchComm:
        """The collectives' layer: Horovod's (a unit test's threads: comm/threads.py)."""
        return HorovodTorchComm(self.process_set)

    def _make_engine(self) -> Engine:
        comm = self._make_comm()
        self._protocols = AsyncProtocols(comm)
        # Horovod hands over each p.grad and replaces it with what decompress returns, so the
        # average can be written into the gradient tensors themselves.
        return Engine(self.algorithm, get_backend("torch"), comm.rank, comm.size, self.prefix,
                      self.nonfinite, write_into_inputs=True)

    def _current_world(self) -> tuple[int, int]:
        process_set = self.process_set if self.process_set is not None else hvd.global_process_set
        return process_set.rank(), process_set.size()

    def _forget_step(self) -> None:
        """A reset (elastic): the step in flight is abandoned, the next engine comes with its own
        protocols, and every rank, dropping its engine together, checks the configuration again."""
        self._protocols = None
        self._config_checked = False
        self._step = HorovodStep()
        self._assembly.begin(0.0)
