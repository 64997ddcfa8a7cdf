"""The model's parameters as the PyTorch faces match gradients to them: by the identity of the
gradient tensor (Horovod hands ``p.grad`` to ``compress``) or of the parameter (DDP's buckets
list their parameters). Names key every bucket, checkpoint and error message; their order is
the plan's rank-independent order."""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import Any

import torch

from ..backends import get_backend

DTYPE_NAME = get_backend("torch").dtype_name


class NamedParameters:
    """A face's ``named_parameters`` (possibly none): position and name of each parameter."""

    def __init__(self, named_parameters: Iterable | None):
        named = list(named_parameters or ())
        self.position = {name: i for i, (name, _) in enumerate(named)}
        self.by_id = {id(param): (i, name) for i, (name, param) in enumerate(named)}
        self._by_numel: dict[int, list[tuple[str, torch.nn.Parameter]]] = {}
        for name, param in named:
            self._by_numel.setdefault(param.numel(), []).append((name, param))
        self.kept = [param for _, param in named]   # keeps ``by_id`` meaningful
        self._warned_unmatched = False
        # the model's layout, checked against every rank's at the first gradient (None: unknown)
        self.layout = [(name, tuple(p.shape), DTYPE_NAME(p)) for name, p in named
                       if p.requires_grad] if named else None

    def __bool__(self) -> bool:
        return bool(self.position)

    def of_gradient(self, grad: torch.Tensor) -> tuple[str, torch.nn.Parameter] | None:
        """(name, parameter) whose ``.grad`` is ``grad``, or None."""
        for name, param in self._by_numel.get(grad.numel(), ()):
            if param.grad is grad:
                return name, param
        return None

    def name_of(self, grad: torch.Tensor) -> str | None:
        """The name of the parameter whose gradient ``grad`` is, or None (warned once when
        ``named_parameters`` was given but did not match)."""
        found = self.of_gradient(grad)
        if found is None and self.position and not self._warned_unmatched:
            self._warned_unmatched = True
            warnings.warn("hvd_sparse: a gradient did not match any of named_parameters (a "
                          "converted or sparse gradient?); it is named by its order in the step",
                          stacklevel=4)
        return None if found is None else found[0]

    def parameter_of(self, grad: torch.Tensor, optimizer: Any) -> torch.nn.Parameter | None:
        """The parameter whose gradient ``grad`` is: from ``named_parameters``, else from the
        calling optimizer's parameter groups (the Adam path delivers its update per parameter)."""
        found = self.of_gradient(grad)
        if found is not None:
            return found[1]
        for group in getattr(optimizer, "param_groups", ()):
            for param in group["params"]:
                if param.grad is grad:
                    return param
        return None

    def describe(self, grad: torch.Tensor) -> str:
        """The gradient in an error message: its parameter's name, else its shape."""
        found = self.of_gradient(grad)
        return found[0] if found is not None else f"of shape {tuple(grad.shape)}"

    def in_order(self, arrived: list[str]) -> list[str]:
        """Keys in a rank-independent order: parameter order where named (others after, in
        arrival order), else the reverse of arrival (hook) order."""
        if not self.position:
            return list(reversed(arrived))
        unknown, arrival = len(self.position), {k: i for i, k in enumerate(arrived)}
        return sorted(arrived, key=lambda k: (self.position.get(k, unknown), arrival[k]))

    def keyed(self, ordered: list[tuple[Any, Any]]) -> list[tuple[str, Any, Any]]:
        """(name, parameter, gradient) of (parameter, gradient) pairs given in model order (DDP's
        first-step buckets), sorted by position: named ones by theirs in ``named_parameters``,
        the others after, named ``p<i>`` by theirs in ``ordered`` (warned once)."""
        unknown = len(self.by_id)
        keyed = []
        for position, (param, grad) in enumerate(ordered):
            named_position, name = self.by_id.get(id(param), (unknown + position, f"p{position}"))
            keyed.append((named_position, name, param, grad))
        keyed.sort(key=lambda entry: entry[0])
        if self.by_id and any(id(param) not in self.by_id for _, _, param, _ in keyed):
            warnings.warn("hvd_sparse: some of the DDP model's parameters are not in named_parameters "
                          "(another model's?); they are named by position (p0, p1, ...)", stacklevel=3)
        return [(name, param, grad) for _, name, param, grad in keyed]
