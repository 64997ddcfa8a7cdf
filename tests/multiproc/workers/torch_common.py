"""What the PyTorch workers share."""

from __future__ import annotations

import functools

import horovod.torch as hvd
import numpy as np
import torch


def allgather_rows(vector: np.ndarray, name: str) -> np.ndarray:
    """(N, ...) every rank's copy of ``vector``, by rank."""
    return hvd.allgather(torch.from_numpy(np.ascontiguousarray(vector))[None], name=name).numpy()


class RawGradients:
    """Each parameter's gradient as backward computed it (summed over the passes of a step, as
    p.grad accumulates it), caught by a tensor hook before Horovod's hook hands p.grad to the
    compressor. p.grad itself is not the raw gradient after backward(): the compressor may zero
    it in the pass that reads it (the kernels do) and writes the average into it while the step's
    collectives run, as stock Horovod's in-place allreduce does."""

    def __init__(self, named: list):
        self.grads: dict[str, torch.Tensor] = {}
        for name, param in named:
            param.register_hook(functools.partial(self._keep, name))

    def _keep(self, name: str, grad: torch.Tensor) -> None:
        kept = self.grads.get(name)
        self.grads[name] = grad.detach().clone() if kept is None else kept.add_(grad.detach())

    def take(self) -> dict[str, torch.Tensor]:
        """This step's gradients (and forget them for the next step)."""
        grads, self.grads = self.grads, {}
        return grads
