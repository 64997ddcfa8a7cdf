"""Corrections around any selection: momentum correction, warm-up, dense small tensors, local
gradient clipping, the Adam path.

Every method takes these keyword options (``hs.ExDyna(density=0.001, momentum=0.9,
warmup_steps=500, dense_below=1024)``); they are applied once, by the engine, never by a method:

* ``momentum`` (``nesterov``, ``momentum_masking``): per bucket and rank a velocity ``u`` is
  updated from the gradient, ``u <- mu*u + g`` (Nesterov: ``u <- mu*(u + g)``), and *that* is
  accumulated into the residual (Nesterov: ``u + g``), so the method selects from momentum-corrected
  values. After the exchange ``u`` is cleared wherever this rank's values left (the residual is
  cleared there too): momentum factor masking. The optimizer must then run without momentum.
* ``dense_steps``: the first S steps average every gradient densely (one allreduce per bucket);
  error feedback starts afterwards.
* ``warmup_steps``: over the next W steps the density rises from dense to ``density`` on DGC's
  exponential schedule, ``max(rho^((t+1)/(W+1)), rho)`` at warm-up step t; every method reads the
  moving target (ExDyna's threshold tracking, DEFT's k, top-k's k).
* ``dense_below``: tensors with fewer than E entries (biases, norm scales) are taken out of the
  sparse buckets and averaged densely, in one bucket of their own for whole-model and grouped
  scopes, one bucket each for per-tensor scopes.
* ``clip_norm``: local gradient clipping (DGC's): on a sparse step each rank scales its
  gradient, per bucket (per tensor in a bucket packing per-tensor steps), to an L2 norm of at most
  ``clip_norm / sqrt(N)`` before accumulating it, so that no burst of gradient enters the
  residual and is released later, stale. Error feedback then conserves the clipped gradient.
* ``adam`` (``AdamPath``; the faces set it from ``optimizer=``): error feedback on each rank's
  own Adam update after dense steps of Adam on the average (``AdamPath``'s docstring).
* ``second_moment_refresh`` (Adam path only): every K sparse steps the gradient is also averaged
  densely, and every rank takes Adam's v from that average alone, frozen in between: one v for
  all ranks, at the global batch's noise (``Corrections``' docstring).
* ``total_steps``: the length of the run, when known: the dense steps and the warm-up must end
  before it.

Defaults leave everything as it was (paper mode). The schedule is a pure function of the bucket's
step, which every rank counts identically.
"""

from __future__ import annotations

import inspect
import math
import numbers
from dataclasses import dataclass, fields
from typing import Any, TypedDict

import numpy as np

from ..errors import ConfigurationError

# The combination docs/methods.md recommends for every method (the evidence is there): the
# momentum correction in Nesterov's form (the optimizer then runs without momentum), a 200-step
# warm-up from dense to the density, and tensors under 1024 entries averaged densely. One
# definition for the scripts that measure it (convergence, end-to-end, time to accuracy).
RECOMMENDED = {"momentum": 0.9, "nesterov": True, "warmup_steps": 200, "dense_below": 1024}
# The dense steps the Adam path takes when none are given: its second moment is taken there. On
# the transformer task (docs/methods.md#adam-and-adamw) 100 of 2000 steps gave most of what 300
# or 600 give, at a third of the bytes.
ADAM_DENSE_STEPS = 100


@dataclass(frozen=True)
class AdamPath:
    """What the engine needs of a linked Adam or AdamW optimizer (the faces build it from
    ``optimizer=``; docs/methods.md#adam-and-adamw).

    Adam divides each entry by its running root mean square, so a residual released after T
    steps moves the weight about once, not T times, and inflates the second moment for the steps
    after: error feedback on the gradient conserves what Adam then throws away. The path makes
    what is conserved be what moves the weights:

    * the dense steps (``dense_steps``): every gradient is averaged densely, and every rank takes
      Adam's moments of the average alike, m <- beta1*m + (1-beta1)*g, v <- beta2*v +
      (1-beta2)*g^2, and hands the optimizer the update m_hat / (sqrt(v_hat) + eps);
    * afterwards each rank carries both moments on from its own gradient (each rank steps Adam
      locally) and accumulates its own update m_hat / (sqrt(v_hat) + eps) into the residual; the
      method selects from that, and the average of what is sent is the update every rank
      applies. Error feedback then conserves exactly what moves the weights, as it does under
      SGD. Each step's update is clipped to ``update_bound``, the largest step Adam itself takes.

    Freezing v after the dense steps instead (1-bit Adam's way to make the update linear in the
    gradient) was this path's first design: on the transformer task at ρ = 0.01 it closed a
    fifth of ExDyna's gap to dense AdamW, the rank's own v two thirds (docs/methods.md), as a v
    frozen early keeps the step sizes of the first hundred steps for the whole run.

    The optimizer (``hvd_sparse.torch.optim.AdamW``, ``hvd_sparse.tensorflow.optimizers.AdamW``)
    applies the learning rate and, decoupled, the weight decay to that update.

    Args:
        beta1: Adam's first-moment factor, in [0, 1).
        beta2: Adam's second-moment factor, in [0, 1).
        eps: Adam's epsilon, a positive number.
    """

    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8

    def __post_init__(self) -> None:
        for option in ("beta1", "beta2"):
            value = getattr(self, option)
            if not is_real(value) or not math.isfinite(value) or not 0.0 <= value < 1.0:
                raise ConfigurationError(
                    f"Adam's {option} must be a number in [0, 1) (e.g. betas=(0.9, 0.999)), got {value!r}")
            object.__setattr__(self, option, float(value))
        if not is_real(self.eps) or not math.isfinite(self.eps) or self.eps <= 0.0:
            raise ConfigurationError(f"Adam's eps must be a positive number (e.g. 1e-8), got {self.eps!r}")
        object.__setattr__(self, "eps", float(self.eps))

    @property
    def update_bound(self) -> float:
        """The largest step Adam can take, in units of the learning rate (Kingma and Ba, section
        2.1): (1 - beta1) / sqrt(1 - beta2) where that exceeds 1, else 1 (3.16 at the defaults)."""
        return max(1.0, (1.0 - self.beta1) / math.sqrt(1.0 - self.beta2))

    def first_scale(self, updates: int) -> float:
        """1 / (1 - beta1^t): the bias correction of m after ``updates`` = t updates."""
        return 1.0 / (1.0 - self.beta1 ** updates) if self.beta1 else 1.0

    def second_scale(self, updates: int) -> float:
        """1 / (1 - beta2^t): the bias correction of v after ``updates`` = t updates."""
        return 1.0 / (1.0 - self.beta2 ** updates) if self.beta2 else 1.0


class CorrectionOptions(TypedDict, total=False):
    """The keyword options every method accepts (``Corrections``' fields)."""

    momentum: float
    nesterov: bool
    momentum_masking: bool
    dense_steps: int
    warmup_steps: int
    dense_below: int
    clip_norm: float | None
    adam: AdamPath | None
    second_moment_refresh: int
    total_steps: int | None


@dataclass(frozen=True)
class Corrections:
    """Validated correction options (see the module docstring).

    Args:
        momentum: mu of the momentum correction, in [0, 1); 0 turns it off. Pair it with an
            optimizer without momentum (``SGD(..., momentum=0)``): the momentum is in the update.
        nesterov: Nesterov form of the correction.
        momentum_masking: clear ``u`` where this rank's values were sent (DGC's factor masking).
        dense_steps: steps averaged densely before sparsification starts (default 0; with
            ``adam``, ``ADAM_DENSE_STEPS``).
        warmup_steps: steps over which the density falls exponentially from 1 to ``density``.
        dense_below: tensors with fewer entries than this are averaged densely (0: none).
        clip_norm: local gradient clipping: each rank's gradient of a sparse bucket is scaled to
            an L2 norm of at most ``clip_norm / sqrt(N)`` before it is accumulated (None: off).
            The dense recipe's clipping norm, or 1.0 where it has none: it keeps bursts out of
            the residual at small k (docs/methods.md#corrections).
        adam: the Adam path (``AdamPath``), which the faces set from their ``optimizer=``.
        second_moment_refresh: on the Adam path, K > 0 shares Adam's v among the ranks: every K
            sparse steps the raw gradient is also allreduced densely (1/K of dense's bytes) and v
            is refreshed from that average, identically on every rank, and frozen in between.
            0 (default): each rank's own v, from its own batch. A rank's own v holds its batch's
            noise, N times the average's, so its steps are up to sqrt(N) smaller than dense
            AdamW's. At 16 ranks K = 20 took TopK and LAGS to dense's quality in 550 steps
            instead of 1200 (dense: 450); at 4 ranks it brought TopK, DGC and LAGS within 2.3%
            of dense's perplexity at ρ = 0.01. It hurts ExDyna and DEFT: leave it off for them
            (docs/methods.md#adam-and-adamw).
        total_steps: the run's length in steps, when known: checked against the dense steps and
            the warm-up, which must end before it.
    """

    momentum: float = 0.0
    nesterov: bool = False
    momentum_masking: bool = True
    dense_steps: int | None = None
    warmup_steps: int = 0
    dense_below: int = 0
    clip_norm: float | None = None
    adam: AdamPath | None = None
    second_moment_refresh: int = 0
    total_steps: int | None = None

    def __post_init__(self) -> None:
        mu = self.momentum
        if not is_real(mu) or not math.isfinite(mu) or not 0.0 <= mu < 1.0:
            raise ConfigurationError(
                f"momentum must be a number in [0, 1) (e.g. 0.9; 0 turns the correction off), got "
                f"{mu!r}")
        object.__setattr__(self, "momentum", float(mu))
        for option in ("nesterov", "momentum_masking"):
            if not isinstance(getattr(self, option), bool):
                raise ConfigurationError(f"{option} must be True or False, got {getattr(self, option)!r}")
        if self.adam is not None and not isinstance(self.adam, AdamPath):
            raise ConfigurationError(
                f"adam must be an hvd_sparse.algorithms.AdamPath, got {self.adam!r}; a face builds it "
                "from its optimizer= (hvd_sparse.torch.optim.AdamW, hvd_sparse.tensorflow.optimizers.AdamW)")
        if self.dense_steps is None:
            object.__setattr__(self, "dense_steps", ADAM_DENSE_STEPS if self.adam is not None else 0)
        for option in ("dense_steps", "warmup_steps", "dense_below", "second_moment_refresh"):
            value = getattr(self, option)
            if not is_integer(value) or value < 0:
                raise ConfigurationError(
                    f"{option} must be a non-negative integer (0 turns it off), got {value!r}")
            object.__setattr__(self, option, int(value))
        if self.nesterov and self.momentum == 0.0:
            raise ConfigurationError("nesterov=True needs momentum > 0 (e.g. momentum=0.9)")
        clip = self.clip_norm
        if clip is not None:
            if not is_real(clip) or not math.isfinite(clip) or clip <= 0:
                raise ConfigurationError(
                    f"clip_norm must be in (0, inf): a positive number (e.g. 1.0; None turns local "
                    f"clipping off), got {clip!r}")
            object.__setattr__(self, "clip_norm", float(clip))
        self._check_adam()
        self._check_total_steps()

    def _check_adam(self) -> None:
        """The Adam path's own demands: dense steps to start its moments from, and no second
        momentum on top of Adam's first moment."""
        if self.adam is None:
            if self.second_moment_refresh:
                raise ConfigurationError(
                    f"second_moment_refresh={self.second_moment_refresh} shares the Adam path's "
                    "second moment, and this method is not on the Adam path: pass optimizer= with "
                    "hvd_sparse's Adam or AdamW (docs/methods.md#adam-and-adamw), or drop the option")
            return
        if self.momentum:
            raise ConfigurationError(
                f"momentum={self.momentum} (the momentum correction) and the Adam path both apply "
                "a momentum: the path's is Adam's beta1. Pass momentum=0")
        if self.dense_steps == 0:
            raise ConfigurationError(
                "the Adam path starts every rank's Adam moments from the average's over its dense "
                f"steps: dense_steps must be at least 1 (default {ADAM_DENSE_STEPS})")

    def _check_total_steps(self) -> None:
        if self.total_steps is None:
            return
        if not is_integer(self.total_steps) or self.total_steps < 1:
            raise ConfigurationError(f"total_steps must be a positive integer, got {self.total_steps!r}")
        object.__setattr__(self, "total_steps", int(self.total_steps))
        if self.dense_steps + self.warmup_steps >= self.total_steps:
            raise ConfigurationError(
                f"dense_steps={self.dense_steps} and warmup_steps={self.warmup_steps} leave no sparse "
                f"step in a run of total_steps={self.total_steps}: shorten them (the sparse steps "
                "are where the exchange saves bytes)")

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """The options' names, in declaration order."""
        return tuple(f.name for f in fields(cls))

    def changed(self) -> dict[str, Any]:
        """The options that differ from the defaults (what ``describe`` and ``repr`` show)."""
        default = Corrections()
        return {f.name: getattr(self, f.name) for f in fields(self)
                if getattr(default, f.name) != getattr(self, f.name)}

    # --- the schedule ---------------------------------------------------------------------------
    def dense_at(self, step: int) -> bool:
        """Whether the bucket's step ``step`` (0-based) is averaged densely."""
        return step < self.dense_steps

    def refreshes_at(self, step: int) -> bool:
        """Whether the sparse step ``step`` also refreshes the shared second moment
        (``second_moment_refresh``): the first sparse step, then every K-th."""
        every = self.second_moment_refresh
        return bool(every) and step >= self.dense_steps and (step - self.dense_steps) % every == 0

    def second_moment_updates(self, step: int) -> int:
        """How many steps' gradients the shared v stands for at step ``step`` (its bias
        correction): the dense steps, and K for each refresh up to and including this step's."""
        refreshes = (step - self.dense_steps) // self.second_moment_refresh + 1
        return self.dense_steps + refreshes * self.second_moment_refresh

    def density_at(self, density: float, step: int) -> float:
        """The target density of step ``step``: 1 during the dense steps, DGC's exponential
        schedule during warm-up, ``density`` afterwards."""
        if self.dense_at(step):
            return 1.0
        return warmup_density(density, self.warmup_steps, step - self.dense_steps)

    def is_dense_tensor(self, numel: int) -> bool:
        """Whether a tensor of ``numel`` entries is averaged densely (``dense_below``)."""
        return numel < self.dense_below


def spell_out(init: Any) -> inspect.Signature:
    """The signature of a method's ``__init__`` with ``**corrections`` written out as the keyword
    options it takes (those the method does not name itself, as DGC names ``momentum``), so that
    ``help()`` and the faces' generated classes show every option."""
    signature = inspect.signature(init)
    params = [p for p in signature.parameters.values() if p.kind is not p.VAR_KEYWORD]
    named = {p.name for p in params}
    params += [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default,
                                 annotation=f.type)
               for f in fields(Corrections) if f.name not in named]
    return signature.replace(parameters=params)


def corrections_doc(exclude: frozenset[str] | set[str] = frozenset()) -> str:
    """The "name: description" entries of the correction options (``Corrections``' Args), for
    the docstring of every method; ``exclude``: options the method documents itself."""
    doc = inspect.cleandoc(Corrections.__doc__ or "").partition("Args:\n")[2]
    entries, keep = [], True
    for line in doc.splitlines():
        if line.strip() and not line.startswith("        "):
            keep = line.strip().split(":")[0] not in exclude
        if keep:
            entries.append(line)
    return "\n".join(entries)


def warmup_density(density: float, warmup: int, t: int) -> float:
    """DGC's exponential warm-up: max(rho^((t+1)/(W+1)), rho) for t < W, then rho."""
    if warmup <= 0 or t >= warmup:
        return density
    return max(density ** ((t + 1) / (warmup + 1)), density)


def is_real(value: Any) -> bool:
    """A real number, NumPy scalars included (``np.float32(0.5)``), booleans excluded."""
    return isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))


def is_integer(value: Any) -> bool:
    """An integer, NumPy integers included (``np.int64(8)``), booleans excluded."""
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))
