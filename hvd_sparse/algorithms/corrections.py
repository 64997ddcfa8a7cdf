"""Corrections around any selection: momentum correction, warm-up, dense small tensors.

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

Defaults leave everything as it was (paper mode). The schedule is a pure function of the bucket's
step, which every rank counts identically.
"""

from __future__ import annotations

import inspect
import math
import numbers
from dataclasses import asdict, dataclass, fields
from typing import Any, TypedDict

import numpy as np

from ..errors import ConfigurationError

# The combination docs/methods.md recommends for every method (the evidence is there): the
# momentum correction in Nesterov's form (the optimizer then runs without momentum), a 200-step
# warm-up from dense to the density, and tensors under 1024 entries averaged densely. One
# definition for the scripts that measure it (convergence, end-to-end, time to accuracy).
RECOMMENDED = {"momentum": 0.9, "nesterov": True, "warmup_steps": 200, "dense_below": 1024}


class CorrectionOptions(TypedDict, total=False):
    """The keyword options every method accepts (``Corrections``' fields)."""

    momentum: float
    nesterov: bool
    momentum_masking: bool
    dense_steps: int
    warmup_steps: int
    dense_below: int


@dataclass(frozen=True)
class Corrections:
    """Validated correction options (see the module docstring).

    Args:
        momentum: mu of the momentum correction, in [0, 1); 0 turns it off. Pair it with an
            optimizer without momentum (``SGD(..., momentum=0)``): the momentum is in the update.
        nesterov: Nesterov form of the correction.
        momentum_masking: clear ``u`` where this rank's values were sent (DGC's factor masking).
        dense_steps: steps averaged densely before sparsification starts.
        warmup_steps: steps over which the density falls exponentially from 1 to ``density``.
        dense_below: tensors with fewer entries than this are averaged densely (0: none).
    """

    momentum: float = 0.0
    nesterov: bool = False
    momentum_masking: bool = True
    dense_steps: int = 0
    warmup_steps: int = 0
    dense_below: int = 0

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
        for option in ("dense_steps", "warmup_steps", "dense_below"):
            value = getattr(self, option)
            if not is_integer(value) or value < 0:
                raise ConfigurationError(
                    f"{option} must be a non-negative integer (0 turns it off), got {value!r}")
            object.__setattr__(self, option, int(value))
        if self.nesterov and self.momentum == 0.0:
            raise ConfigurationError("nesterov=True needs momentum > 0 (e.g. momentum=0.9)")

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """The options' names, in declaration order."""
        return tuple(f.name for f in fields(cls))

    def changed(self) -> dict[str, Any]:
        """The options that differ from the defaults (what ``describe`` and ``repr`` show)."""
        default = Corrections()
        return {k: v for k, v in asdict(self).items() if getattr(default, k) != v}

    # --- the schedule ---------------------------------------------------------------------------
    def dense_at(self, step: int) -> bool:
        """Whether the bucket's step ``step`` (0-based) is averaged densely."""
        return step < self.dense_steps

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


def corrections_doc(exclude: set[str] = frozenset()) -> str:
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
