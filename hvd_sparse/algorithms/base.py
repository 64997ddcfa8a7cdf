"""What every sparsification method provides to the engine.

A method is a selection rule plus, where it has one, a controller. The engine owns everything the
methods share -- error feedback, the communication patterns, reconstruction, statistics,
checkpoints -- so a method module says only what is specific to it:

* ``select_local(acc, control, ctx)``: the indices this rank sends, from its accumulated vector
  (gradient + residual), using backend ops for bulk work. A method whose selection needs a
  collective (e.g. an assignment broadcast by a master) overrides the generator ``select``.
* ``prepare(control, ctx)`` (optional): a protocol run at the start of each step, before any
  gradient is read, for decisions that fix the step's selection domain (ExDyna's rebalancing).
* ``accumulate_select`` (optional): accumulation and a threshold selection as one backend op,
  which a kernel runs in a single pass over the bucket (MiCRO, ExDyna, the hard threshold).
* ``init_control`` / ``observe``: host-side control state (thresholds, partitions, k) and its
  update from what the step exchanged: small deterministic computations on NumPy/Python data
  from inputs identical on every rank, so ranks agree without extra messages. The control state
  is the bucket's own mutable object: ``observe`` may update it in place and returns it (the
  engine keeps what it returns), and a method's selection may record in it what the selection
  decided (Gaussian-k's threshold, MiCRO's probe counts, DEFT's norms taken while accumulating).
  No control state is shared between buckets or read by another rank's code.
* ``end_step`` (optional): once per training step, after every bucket has finished, a protocol
  that sees every bucket's control state and when each bucket became ready during the backward
  pass, for decisions that span buckets (LAGS's per-group density).
"""

from __future__ import annotations

import inspect
import math
import textwrap
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, ClassVar, Unpack

import numpy as np

from ..backends import Backend, Momentum, Selected
from ..comm import Protocol, finished
from ..errors import ConfigurationError
from .corrections import (  # noqa: F401
    CorrectionOptions,
    Corrections,
    corrections_doc,
    is_integer,
    is_real,
    spell_out,
)

GATHER = "gather"   # allgather (index, value) pairs; scatter-add; divide by N
UNION = "union"     # allgather indices; allreduce every rank's values at the union; divide by N
SHARED = "shared"   # indices agreed without messages; allreduce the values; divide by N
PATTERNS = (GATHER, UNION, SHARED)

# The bucket of the tensors under ``dense_below`` entries in whole-model and grouped scopes.
DENSE_BUCKET = "dense_below"

TENSOR = "tensor"   # one bucket per gradient tensor
MODEL = "model"     # the whole model as one flat vector
SCOPES = (TENSOR, MODEL)


@dataclass(frozen=True)
class StepContext:
    """Facts about the step that every rank sees identically (except ``rank``)."""

    rank: int
    size: int
    step: int           # communication rounds completed by this bucket before this one
    key: str            # the bucket's key
    numel: int
    backend: Backend
    name: str = ""      # prefix of the bucket's collective names (a method's own collectives
                        # are named f"{ctx.name}.<something>")
    sizes: tuple[int, ...] = ()  # element count of each tensor of the bucket, in bucket order
                                 # (sums to numel): the layout methods that work per layer need
    density: float | None = None  # this step's target density when the engine's schedule sets
                                  # it (algorithms/corrections.py); None: the method's ``density``
                                  # (read it through ``Algorithm.step_density``)
    momentum: Momentum | None = None  # the momentum correction's buffer, when it is on: pass it
                                      # to every backend op that accumulates
    members: tuple[str, ...] = ()  # the tensors' own keys when the bucket packs per-tensor
                                   # steps (``Algorithm.packs_tensors``); else empty


@dataclass(frozen=True)
class StepOutcome:
    """What the step exchanged, handed to ``observe`` so controllers need no extra collective."""

    selected: int                 # this rank's count
    union_size: int | None        # size of the aggregated index set when known without extra work
    gathered_indices: Any         # every rank's indices, concatenated in rank order
    own_indices: Any = None       # this rank's selection
    piggyback: Any = None         # the sum over ranks of what ``piggyback`` returned (NumPy)


@dataclass(frozen=True)
class StepEnd:
    """What a driver saw of a finished training step, handed to ``Algorithm.end_step``."""

    controls: dict[str, Any]          # bucket -> its control state on this rank
    numels: dict[str, int]            # bucket -> elements
    ready: dict[str, float] | None    # bucket -> seconds from the step's first gradient to the
                                      # arrival of the bucket's last one; None where not observable
    like: Any                         # a tensor on the buckets' device, for collective payloads


def check_density(density: Any) -> float:
    """Validate a target density, raising an error that names the fix. Any real number is
    accepted (NumPy scalars such as ``np.float32(0.01)`` included) and kept as a Python float."""
    if not is_real(density) or not math.isfinite(density):
        raise ConfigurationError(
            f"density must be a real number in (0, 1] (e.g. 0.01), got {density!r} of type "
            f"{type(density).__name__}")
    if not 0.0 < density <= 1.0:
        raise ConfigurationError(
            f"density must be in (0, 1] (the fraction of gradient entries sent each step, e.g. 0.01),"
            f" got {density!r}")
    return float(density)


def check_choice(option: str, value: Any, choices: tuple) -> Any:
    """``value`` if it is one of ``choices``, else a ``ConfigurationError`` naming ``option``."""
    if value not in choices:
        raise ConfigurationError(f"{option} must be one of {choices}, got {value!r}")
    return value


class Algorithm:
    """Base class: hyper-parameters in ``__init__``, selection and control in methods."""

    name: ClassVar[str] = "abstract"
    patterns: ClassVar[tuple[str, ...]] = (GATHER,)
    scopes: ClassVar[tuple[str, ...]] = (TENSOR, MODEL)
    exclusive: ClassVar[bool] = False   # ranks' selections never overlap: union = concatenation
    # In scope "tensor", whether one bucket may pack several tensors and the method select in each
    # as it would in a bucket of its own (``tensor_segments``): the same decisions in one step,
    # which the faces take, since every step costs Python and collectives per bucket
    # (docs/architecture.md: TensorFlow face, PyTorch face).
    packs_tensors: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Every method takes the correction options (``**corrections``): its ``help()`` and
        signature list them by name, with their descriptions."""
        super().__init_subclass__(**kwargs)
        init = cls.__dict__.get("__init__")
        if init is None or not any(p.kind is p.VAR_KEYWORD
                                   for p in inspect.signature(init).parameters.values()):
            return
        named = set(Corrections.names()) & set(inspect.signature(init).parameters)   # DGC's own
        init.__signature__ = spell_out(init)
        if cls.__doc__ and "Args:" in cls.__doc__:
            extra = textwrap.indent(corrections_doc(exclude=named), "    ")
            cls.__doc__ = (cls.__doc__.rstrip() + "\n\n    Corrections (every method, applied by the "
                           "engine: algorithms/corrections.py):\n" + extra + "\n")

    def __init__(self, density: float, *, pattern: str | None = None, scope: str | None = None,
                 **corrections: Unpack[CorrectionOptions]):
        self.density = check_density(density)
        self.pattern = check_choice("pattern", pattern or self.patterns[0], self.patterns)
        self.scope = check_choice("scope", scope or self.scopes[0], self.scopes)
        unknown = set(corrections) - set(Corrections.names())
        if unknown:
            raise TypeError(f"{type(self).__name__}() got unexpected keyword arguments "
                            f"{sorted(unknown)}")
        # Momentum correction, warm-up, dense small tensors: applied by the engine for every
        # method (algorithms/corrections.py).
        self._corrections = Corrections(**corrections)

    @property
    def corrections(self) -> Corrections:
        """The corrections every method takes (momentum, warm-up, dense steps, dense small tensors)."""
        return self._corrections

    @property
    def select_collectives(self) -> bool:
        """Whether a step issues collectives of its own besides the pattern's (in ``prepare`` or
        ``select``), so that its phases are not known before it runs. Default: no."""
        return False

    def group(self, keys: list[str], sizes: list[int]) -> list[tuple[str, list[str]]]:
        """Group the sparsified gradients into buckets, by ``scope``: one bucket per tensor, or
        the whole model as one bucket named "model". Methods with groups of their own override
        it (LAGS)."""
        if self.scope == MODEL:
            return [("model", list(keys))]
        return [(key, [key]) for key in keys]

    @property
    def tensor_packing(self) -> bool:
        """Whether this instance packs per-tensor steps: a method that can (``packs_tensors``), in
        scope "tensor" (in scope "model" one k covers the whole bucket)."""
        return self.packs_tensors and self.scope == TENSOR

    def tensor_segments(self, ctx: StepContext) -> list[tuple[int, int, str]]:
        """(offset, size, key) of each tensor the step selects in on its own: every member of a
        bucket packing per-tensor steps (``packs_tensors``), else the whole bucket."""
        if not ctx.members:
            return [(0, ctx.numel, ctx.key)]
        offsets = np.cumsum((0, *ctx.sizes[:-1])).tolist()
        return list(zip(offsets, ctx.sizes, ctx.members, strict=True))

    def step_density(self, ctx: StepContext) -> float:
        """This step's target density: the warm-up schedule's, else the method's ``density``."""
        return self.density if ctx.density is None else ctx.density

    def k(self, numel: int, density: float | None = None) -> int:
        """Entries to send from a bucket of ``numel`` at ``density`` (default: the method's):
        floor(density * numel), at least one."""
        density = self.density if density is None else density
        return max(1, min(numel, int(density * numel)))

    # --- accumulation and selection -------------------------------------------------------------
    def accumulate(self, residual: Any, tensors: list, control: Any, ctx: StepContext) -> Any:
        """The vector selection sees: gradient + residual (error feedback), built in the residual
        buffer. Methods that transform the gradient first (DGC's momentum correction, clipping)
        override this; whatever is not sent of the returned vector becomes the next residual."""
        return ctx.backend.accumulate(residual, tensors, momentum=ctx.momentum)

    def plain_accumulation(self, control: Any) -> bool:
        """Whether ``accumulate`` is the plain ``a = g + e`` of ``Backend.accumulate`` (with the
        step's momentum): the engine may then run it as one op with the finite check and the
        clearing of inputs it overwrites later. Default: whether ``accumulate`` is not overridden."""
        return type(self).accumulate is Algorithm.accumulate

    def accumulate_select(self, residual: Any, tensors: list, control: Any, ctx: StepContext,
                          clear_inputs: bool, check_finite: bool) -> Selected | None:
        """``Selected`` (accumulated vector, this rank's indices, probe counts, finite) from one
        backend op -- the contract of ``Backend.accumulate_select`` and of the kernels
        (backends/contract.py) -- for a method whose selection is a threshold on the accumulated
        vector and needs no collective; the inputs are cleared in the same pass with
        ``clear_inputs``. With ``check_finite``, inputs holding NaN/Inf leave everything untouched
        and the result is not finite (the engine then selects from zeros). Default None: the
        engine calls ``accumulate`` and then ``select``."""
        return None

    def prepare(self, control: Any, ctx: StepContext) -> Protocol:
        """Protocol run at the start of every step, before the gradient is read (so that the
        selection can run in the accumulating pass): decisions that fix this step's selection
        domain, such as ExDyna's partition boundaries. It may issue named collectives -- the same
        on every rank. Default: nothing."""
        return finished(None)

    def target_k(self, control: Any, ctx: StepContext) -> int:
        """The count this bucket aims to send this step (the ``k`` statistic), summed over the
        tensors of a bucket packing per-tensor steps."""
        density = self.step_density(ctx)
        return sum(self.k(size, density) for _, size, _ in self.tensor_segments(ctx))

    def select(self, acc: Any, control: Any, ctx: StepContext) -> Protocol:
        """Protocol returning this rank's indices (int64, non-empty). Default: no collective."""
        return finished(self.select_local(acc, control, ctx))

    def select_local(self, acc: Any, control: Any, ctx: StepContext) -> Any:
        """This rank's indices, chosen from ``acc`` alone (``select`` without collectives)."""
        raise NotImplementedError

    def piggyback(self, control: Any, ctx: StepContext) -> Any:
        """A few floats (backend vector) this rank adds to the step's value allreduce (union and
        shared patterns); ``observe`` receives their sum over ranks. Control data thus travels
        without a collective of its own. Called after ``select``. Default: nothing."""
        return None

    def select_per_tensor(self, acc: Any, control: Any, ctx: StepContext,
                          select: Callable[[Any, int], Any]) -> Any:
        """``select(part, numel)`` (indices into ``part``) on each tensor of a bucket packing
        per-tensor steps, as on a bucket of its own: an empty selection sends that tensor's
        ``fallback`` index, as the engine would send for it alone. One tensor: ``select(acc)``."""
        segments = self.tensor_segments(ctx)
        if len(segments) == 1:
            return select(acc, ctx.numel)
        b, parts = ctx.backend, []
        for offset, size, key in segments:
            idx = select(b.slice(acc, offset, offset + size), size)
            if b.numel(idx) == 0:
                alone = replace(ctx, key=key, numel=size, sizes=(size,), members=())
                idx = b.from_numpy(b.to_numpy(self.fallback(control, alone)), like=acc)
            parts.append(idx + offset if offset else idx)
        return b.concat(parts)

    def fallback(self, control: Any, ctx: StepContext) -> Any:
        """The single index sent when the selection is empty (a collective must never be empty).
        Exclusive methods override it to stay inside their own partition."""
        return ctx.backend.arange(ctx.step % ctx.numel, ctx.step % ctx.numel + 1)

    def union_indices(self, gathered: Any, control: Any, ctx: StepContext) -> Any:
        """The aggregated index set of the union pattern, identical on every rank: the
        concatenation when selections are disjoint by construction, else the distinct indices."""
        return gathered if self.exclusive else ctx.backend.unique(gathered)

    def masks_momentum(self, control: Any, ctx: StepContext) -> bool | list[bool]:
        """Whether the momentum correction's factor masking applies after this step (with
        ``momentum_masking``; the engine never masks a dense step), or, in a bucket packing
        per-tensor steps, whether it applies in each tensor. Default: yes."""
        return True

    # --- control state ----------------------------------------------------------------------------
    def init_control(self, ctx: StepContext) -> Any:
        """Host-side state of one bucket, created at its first step."""
        return None

    def observe(self, control: Any, outcome: StepOutcome, ctx: StepContext) -> Any:
        """The control state after a step: ``control`` updated in place (or a new object), returned;
        the engine keeps what it returns. Deterministic from ``outcome`` and ``ctx``, which every
        rank sees alike (module docstring)."""
        return control

    def end_step(self, end: StepEnd, ctx: StepContext) -> Protocol:
        """Protocol run once per training step on every rank, after every bucket of the step has
        finished and outside the backward pass (drivers run it blocking). It may issue named
        collectives -- the same on every rank -- and returns the updated control states
        (bucket -> control), or None to leave them. ``ctx`` describes the whole model: ``key``
        is empty, ``numel`` the total, ``name`` the compressor's prefix. Default: nothing."""
        return finished(None)

    def measuring(self, controls: dict[str, Any]) -> bool:
        """Whether the next step's readiness times matter (bucket -> control): drivers then make
        them exact at some cost, e.g. by waiting for the device in each gradient hook."""
        return False

    def control_stats(self, control: Any) -> dict:
        """Extra statistics of the last step (e.g. ``threshold``)."""
        return {}

    def model_stats(self, controls: dict[str, Any]) -> dict:
        """Extra statistics spanning buckets (bucket -> control), e.g. per-bucket densities."""
        return {}

    def control_state(self, control: Any) -> Any:
        """Picklable control state for a checkpoint."""
        return control

    def agreed_control(self, state: Any) -> Any:
        """The part of a ``control_state`` that does not depend on the rank holding it: what
        another process may adopt (an elastic reset hands rank 0's to every rank; per-rank parts
        left out restart in ``load_control``). Default: all of it."""
        return state

    def load_control(self, state: Any, ctx: StepContext, saved_size: int) -> Any:
        """Control state restored from a checkpoint taken at world size ``saved_size``."""
        return state

    def describe(self) -> dict:
        """Hyper-parameters, for logs and checkpoints (corrections where they are set)."""
        own = {k: v for k, v in vars(self).items() if not k.startswith("_")}
        return {**own, **self.corrections.changed()}

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.describe().items())
        return f"{type(self).__name__}({args})"
