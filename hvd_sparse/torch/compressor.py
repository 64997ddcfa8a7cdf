"""The PyTorch face: a Horovod ``Compressor`` that runs an hvd_sparse method.

Stock ``hvd.DistributedOptimizer`` calls ``compress(grad)`` once per gradient (in a backward
hook) and allreduces whatever it returns, then calls ``decompress`` for each gradient when the
optimizer steps (docs/architecture.md#pytorch-face). This class lives inside that contract unpatched:

* ``compress`` returns a one-element placeholder (Horovod's allreduce of it is tiny and fused)
  and files the gradient into its bucket (algorithms/base.py ``plan``: per tensor, the whole
  model, or merged groups). When a bucket is complete its protocol starts right there, its
  collectives named after the bucket and issued asynchronously, so communication overlaps the
  rest of the backward pass.
* The first ``decompress`` of a step (by then every rank has issued every ``compress`` of the
  step) starts any bucket not started yet -- on the first step, before the plan is known, that is
  all of them -- and drives all protocols to completion, phase by phase; then runs the
  algorithm's once-per-step protocol (``Engine.end_step``, blocking: every rank is there) with the
  time each bucket became ready; later calls return their piece.
* The first ``compress`` of the job checks, with one tiny blocking allgather, that every rank
  runs the same method and options on the same parameters (engine/agreement.py): no collective
  of the step has been issued yet on any rank, so a rank that differs, even by an extra layer,
  fails with the others instead of hanging (the layout is known there only from
  ``named_parameters``; without it, it is checked at the first ``decompress``). A step that
  raises on every rank (``nonfinite="raise"``) finishes every other bucket's collectives, takes
  their step back and leaves the face ready for the next step.
* The optimizer that calls ``compress`` is visible there (horovod_internals.py): with the
  momentum correction on (``momentum=``) and an optimizer that has momentum of its own, the
  first ``compress`` warns once (``optimizer_momentum`` says what counts).
* Timing is cheap: a few clock reads per ``compress`` and ``decompress`` and a non-blocking poll
  of the collectives in flight, so ``stats()`` (and, without any pass over data,
  ``step_times()``) can say where the step's time went on this rank: inside the hooks, inside
  ``decompress``, in each part of the engine's step, blocked on collectives
  (``comm_wait_seconds``) against how long communication was in flight
  (``comm_inflight_seconds``) and how much of it the backward pass hid; and
  ``communication_timeline()`` / ``collective_timeline()`` when each bucket's collectives (each
  collective) were issued and seen complete. Only in the steps where the algorithm measures the
  backward pass (LAGS's profiling) and on a GPU, each hook also waits for the device, so that the
  clock reads when a gradient was computed rather than when its kernels were queued.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field
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
from ..engine.assembly import Arrivals, Plan
from ..engine.buckets import check_gradient_dtype
from ..faces import FaceBase, refuse_reduction_op
from .horovod_internals import calling_optimizer
from .optim import LinksTorchOptimizer, optimizer_momentum  # noqa: F401  (public here too)

_PLACEHOLDER_DTYPES = (torch.float16, torch.float32, torch.float64)
_SPARSIFIABLE = (*_PLACEHOLDER_DTYPES, torch.bfloat16)


@dataclass
class _Step:
    """One training step as the face sees it, from its first ``compress`` to its last
    ``decompress``: a new one at the step's first gradient and at a reset (``_forget_step``); the
    last step's stays until then (``communication_timeline`` reads it between steps)."""

    measuring: bool = False            # hooks wait for the device (LAGS's profiling steps, GPU)
    arrivals: Arrivals = field(default_factory=Arrivals)   # the gradients, when, buckets started
    flushed: bool = False              # the first decompress has finished every bucket
    outstanding: int = 0               # compress calls not yet matched by a decompress
    failed: FloatingPointError | None = None   # raised at the step's last decompress
    ordinal: int = 0                   # gradients named by their order so far (no named_parameters)
    hook_seconds: float = 0.0          # time inside compress (Horovod's gradient hooks)
    decompress_seconds: float = 0.0    # time inside decompress (finishing the step, end_step)
    end_step_seconds: float = 0.0      # the once-per-step protocol (Engine.end_step)
    backward_end: float = 0.0          # perf_counter() when the last compress returned
    decompress_began: float = 0.0      # perf_counter() when the first decompress was entered
    decompress_ended: float = 0.0      # ... when the last one so far returned

    @property
    def began(self) -> float:
        """perf_counter() at the step's first gradient."""
        return self.arrivals.began


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
        self._param_order: dict[str, int] = {}
        self._params_by_numel: dict[int, list[tuple[str, torch.nn.Parameter]]] = {}
        self._declared_layout: list | None = None   # the model's layout, from named_parameters
        if named_parameters is not None:
            named_parameters = list(named_parameters)
            for position, (name, param) in enumerate(named_parameters):
                self._param_order[name] = position
                self._params_by_numel.setdefault(param.numel(), []).append((name, param))
            dtype_name = get_backend("torch").dtype_name
            self._declared_layout = [(name, tuple(param.shape), dtype_name(param))
                                     for name, param in named_parameters if param.requires_grad]
        self._config_checked = False
        self._protocols: AsyncProtocols | None = None       # made with the engine
        self._planned = Plan()                              # the method's buckets over the keys
        self._warned_unmatched = False
        self._param_of: dict[str, torch.nn.Parameter | None] = {}   # Adam path: key -> parameter
        self._step = _Step()

    # --- Horovod's interface --------------------------------------------------------------------
    def compress(self, tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Horovod's call per gradient, in its backward hook: file the gradient into its bucket and
        start the bucket's protocol as soon as the bucket is complete, so communication overlaps
        the rest of the backward pass. Returns the one-element placeholder Horovod allreduces (in
        the gradient's precision where Horovod can move it) and the gradient's key, which
        ``decompress`` receives back."""
        # Refuse what cannot work before anything else, so that every rank fails here and none has
        # issued a collective of this step. Both reads of the caller happen here, in compress itself
        # (calling_optimizer reads the stack from compress's caller; the warning points there).
        entered = time.perf_counter()
        optimizer, op = calling_optimizer(self)
        refuse_reduction_op(op, hvd)
        if optimizer is not None and not (self._optimizer_seen and self._stock_adam_warned):
            self._note_optimizer(optimizer)
        self._refuse_dtype(tensor)
        first = self._step.outstanding == 0   # the first gradient of a new step
        if first:
            self._follow_world()
        engine = self._ensure_engine()
        if not self._config_checked:
            self._agree_on_config(engine, tensor)
        key = self._file(tensor, self._arrival_time(engine, tensor, first))
        if self._adam_link is not None and key not in self._param_of:
            self._param_of[key] = self._parameter_of(tensor, optimizer)
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
            if step.failed is not None:
                return self._after_failure(ctx)
            bucket, position = self._planned.bucket_of[ctx]
            return self._running().results[bucket][position]
        finally:
            step.decompress_ended = time.perf_counter()
            step.decompress_seconds += step.decompress_ended - entered

    # --- the parts of a step ----------------------------------------------------------------------
    def _refuse_dtype(self, tensor: torch.Tensor) -> None:
        """Refuse a gradient dtype the engine cannot sparsify, naming the parameter."""
        if tensor.dtype not in _SPARSIFIABLE:
            check_gradient_dtype(self._describe(tensor), get_backend("torch").dtype_name(tensor))

    def _agree_on_config(self, engine: Engine, tensor: torch.Tensor) -> None:
        """The first gradient of the job (or after an elastic reset, which re-arms the check on
        every rank, newcomers included), before Horovod has issued any collective of the step:
        every rank gets here, whatever its model. A rank with another method, options or (with
        named_parameters) another model fails now, with every other rank, instead of hanging on
        a collective the others never issue."""
        self._config_checked = True
        run_blocking(engine.agree_on_config(self._declared_layout, like=tensor), self._running().comm.execute)

    def _arrival_time(self, engine: Engine, tensor: torch.Tensor, first: bool) -> float:
        """When the gradient arrived (waiting for the device first in a measuring step); the first
        gradient of a step begins the step there."""
        measuring = engine.measuring() and tensor.is_cuda if first else self._step.measuring
        if measuring:
            torch.cuda.synchronize(tensor.device)
        now = time.perf_counter()
        if first:
            self._begin_step(now, measuring)
        return now

    def _file(self, tensor: torch.Tensor, now: float) -> str:
        """Keep the gradient for its bucket and start the bucket if it is complete; its key."""
        step = self._step
        step.outstanding += 1
        key = self._key_for(tensor)
        step.arrivals.file(key, tensor, now)
        planned = self._planned.bucket_of.get(key)
        if planned is not None and step.arrivals.complete(self._planned, planned[0]):
            self._start(planned[0])  # the bucket is complete: communicate during backward
        return key

    def _finish_step(self, like: torch.Tensor) -> None:
        """At the first decompress of a step: plan the buckets (first step, or a changed set of
        gradients), check the layout where ``named_parameters`` could not, start every bucket not
        started yet, drive every protocol to completion, then run the once-per-step protocol."""
        engine, protocols, step = self._ensure_engine(), self._running(), self._step
        arrived = step.arrivals.tensors
        if not self._planned.covers(arrived):
            self._make_plan()
        if not engine.config_agreed():  # without named_parameters: the layout seen now
            layout = [(key, tuple(t.shape), get_backend("torch").dtype_name(t))
                      for keys in self._planned.members.values() for key in keys for t in [arrived[key]]]
            run_blocking(engine.agree_on_config(layout, like=like), protocols.comm.execute)
        for bucket in step.arrivals.ready(self._planned):   # every bucket not started yet
            self._start(bucket)
        try:
            protocols.finish_all()
        except FloatingPointError as error:
            # Raised on every rank alike (a non-finite gradient with nonfinite="raise"): the
            # buckets that finished take their step back, so it is applied nowhere. The error
            # waits for the step's last decompress (_after_failure).
            engine.take_back(list(protocols.results))
            step.failed = error
            return
        except Exception:
            engine.take_back(list(protocols.results))
            step.outstanding = 0
            raise
        ready = step.arrivals.ready_times(self._planned)
        began = time.perf_counter()
        run_blocking(engine.end_step(ready), protocols.comm.execute)
        step.end_step_seconds += time.perf_counter() - began
        self._deliver(p for p in (self._param_of.get(key) for key in arrived) if p is not None)

    def _after_failure(self, key: str) -> torch.Tensor:
        """A decompress of a step that raised: raise at the last one, so Horovod has waited for
        every placeholder allreduce of the step first. Raising earlier would leave some in flight,
        and the next step's hooks would reuse their names while Horovod still holds them. The
        earlier ones give the gradient back unchanged; the next compress begins a new step
        (docs/usage.md#non-finite-gradients)."""
        step = self._step
        if step.outstanding > 0:
            return step.arrivals.tensors[key]
        raise step.failed

    # --- what only this face measures -----------------------------------------------------------
    def _extra_stats(self) -> dict:
        return self.step_times()

    def step_times(self) -> dict:
        """Where this step's time went on this rank (the last step's, between steps), in seconds;
        cheap (no pass over any data), so it may be read every step. ``stats()`` includes it.

        ``hook_seconds``: inside ``compress`` (Horovod's gradient hooks: filing gradients, and the
        engine's work on buckets complete during the backward pass); ``decompress_seconds``:
        inside ``decompress`` (driving every bucket to completion, ``end_step``);
        ``end_step_seconds``: the once-per-step protocol; ``<part>_seconds``: the engine's parts
        (engine/stats.py ``StepTimes``), wherever they ran; ``comm_wait_seconds``: blocked on
        collectives in ``decompress``; ``comm_inflight_seconds``: wall time with at least one
        collective in flight, of which ``comm_hidden_seconds`` before the last gradient hook
        returned (hidden by the backward pass) and ``comm_exposed_seconds`` after it."""
        protocols, step = self._running(), self._step
        inflight = protocols.inflight_seconds()
        hidden = protocols.inflight_seconds(until=step.backward_end) if step.backward_end else 0.0
        return {**self._ensure_engine().step_times(),
                "hook_seconds": step.hook_seconds, "decompress_seconds": step.decompress_seconds,
                "end_step_seconds": step.end_step_seconds,
                "comm_wait_seconds": protocols.wait_seconds, "comm_inflight_seconds": inflight,
                "comm_hidden_seconds": hidden, "comm_exposed_seconds": inflight - hidden}

    def step_marks(self) -> dict:
        """When this step's landmarks happened, as ``time.perf_counter()`` values (the last step's
        between steps): ``began`` (the first gradient hook), ``backward_end`` (the last hook
        returned), ``decompress_began`` (the first decompress was entered: Horovod waited for its
        own allreduces before), ``decompress_ended`` (the last decompress so far returned). For
        profilers that read the same clock."""
        step = self._step
        return {"began": step.began, "backward_end": step.backward_end,
                "decompress_began": step.decompress_began, "decompress_ended": step.decompress_ended}

    def collective_timeline(self) -> list[dict]:
        """Every collective of this step (the last step's, between steps), in the order issued:
        ``name``, ``op``, ``bytes`` (this rank's input), ``issued`` and ``completed`` (seconds after
        the step's first gradient; ``completed`` None while not seen complete). Polls first."""
        if self._protocols is None:
            return []
        self._protocols.poll()
        began = self._step.began
        return [{"name": name, "op": op, "bytes": size, "issued": issued - began,
                 "completed": None if done is None else done - began}
                for name, op, size, issued, done in self._protocols.collectives]

    def communication_timeline(self) -> dict[str, tuple[float, float | None]]:
        """This step's buckets (the last step's, between steps): (issued, completed) in seconds
        after the step's first gradient, ``completed`` None while not seen complete. Polls the
        collectives in flight first, so it may be called from a backward hook."""
        if self._protocols is None:
            return {}
        self._protocols.poll()
        began = self._step.began
        return {key: (issued - began, None if done is None else done - began)
                for key, (issued, done) in self._protocols.timeline().items()}

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

    def _parameter_name(self, tensor: torch.Tensor) -> str | None:
        """The name of the parameter whose gradient ``tensor`` is (from ``named_parameters``), or
        None."""
        for name, param in self._params_by_numel.get(tensor.numel(), ()):
            if param.grad is tensor:
                return name
        return None

    def _parameter_of(self, tensor: torch.Tensor, optimizer: Any) -> torch.nn.Parameter | None:
        """The parameter whose gradient ``tensor`` is: from ``named_parameters``, else from the
        calling optimizer's parameter groups (the Adam path delivers its update per parameter)."""
        for _name, param in self._params_by_numel.get(tensor.numel(), ()):
            if param.grad is tensor:
                return param
        for group in getattr(optimizer, "param_groups", ()):
            for param in group["params"]:
                if param.grad is tensor:
                    return param
        return None

    def _describe(self, tensor: torch.Tensor) -> str:
        """The gradient in an error message: its parameter's name, else its shape."""
        return self._parameter_name(tensor) or f"of shape {tuple(tensor.shape)}"

    def _make_engine(self) -> Engine:
        comm = HorovodTorchComm(self.process_set)
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
        self._step = _Step()

    def _begin_step(self, now: float, measuring: bool) -> None:
        """A new step from its first gradient, at ``now``; the last step's protocols are dropped."""
        self._running().clear()
        self._step = _Step(measuring=measuring, arrivals=Arrivals(began=now))

    def _start(self, bucket: str) -> None:
        """Start the bucket's protocol (its collectives issued asynchronously)."""
        tensors = self._step.arrivals.take(self._planned, bucket)
        members = self.algorithm.step_members(self._planned.members[bucket])
        self._running().start(bucket, self._ensure_engine().step(bucket, tensors, members=members))

    def _make_plan(self) -> None:
        """Buckets over the gradients that arrived, in a rank-independent order: parameter order
        when named_parameters was given, else the reverse of arrival (hook) order."""
        arrived = self._step.arrivals.tensors
        if self._param_order:
            unknown = len(self._param_order)
            arrival = {k: i for i, k in enumerate(arrived)}
            keys = sorted(arrived, key=lambda k: (self._param_order.get(k, unknown), arrival[k]))
        else:
            keys = list(reversed(arrived))
        dtype_name = get_backend("torch").dtype_name
        self._planned.replan(self._plan, keys, [arrived[k].numel() for k in keys],
                             [dtype_name(arrived[k]) for k in keys], self._step.arrivals.started)

    def _key_for(self, tensor: torch.Tensor) -> str:
        """The gradient's key: its parameter's name, else its order in the step ("t0", "t1", ...;
        warned once when named_parameters was given but did not match)."""
        name = self._parameter_name(tensor)
        if name is not None:
            return name
        if self._params_by_numel and not self._warned_unmatched:
            self._warned_unmatched = True
            warnings.warn("hvd_sparse: a gradient did not match any of named_parameters (a "
                          "converted or sparse gradient?); it is named by its order in the step",
                          stacklevel=4)
        self._step.ordinal += 1
        return f"t{self._step.ordinal - 1}"
