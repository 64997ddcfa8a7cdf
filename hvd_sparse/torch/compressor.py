"""The PyTorch face: a Horovod ``Compressor`` that runs an hvd_sparse method.

Stock ``hvd.DistributedOptimizer`` calls ``compress(grad)`` once per gradient (in a backward
hook) and allreduces whatever it returns, then calls ``decompress`` for each gradient when the
optimizer steps (HOROVOD.md 1.3). This class lives inside that contract without patching Horovod:

* ``compress`` returns a one-element placeholder (Horovod's allreduce of it is tiny and fused).
  Scope "tensor": the gradient's protocol starts right there, its collectives named after the
  parameter and issued asynchronously, so communication overlaps the rest of the backward pass.
  Scope "model": the gradient is stashed.
* The first ``decompress`` of a step starts the whole-model protocol (by then every rank has issued
  every ``compress`` of the step) and drives all protocols to completion, phase by phase; later
  calls return their piece.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import Any

import torch
from horovod.torch.compression import Compressor

from ..algorithms.base import MODEL, Algorithm
from ..backends import get_backend
from ..comm.horovod_torch import AsyncProtocols, HorovodTorchComm
from ..engine import Engine, summarize

_PLACEHOLDER_DTYPES = (torch.float16, torch.float32, torch.float64)
MODEL_BUCKET = "model"


class SparseCompressor(Compressor):
    """Horovod compressor running ``algorithm`` (an ``hvd_sparse.algorithms.Algorithm``).

    Args:
        algorithm: the method and its hyper-parameters.
        named_parameters: the model's ``named_parameters()`` (recommended). Gradients are then
            matched to parameters by identity and collectives are named after the parameter;
            without it they are named by their order within the step, which relies on every rank
            running the backward hooks in the same order.
        process_set: the Horovod process set the optimizer reduces over (default: global).
        prefix: prefix of every collective's name; give two compressors in one job distinct ones.
    """

    def __init__(self, algorithm: Algorithm, *, named_parameters: Iterable | None = None,
                 process_set: Any = None, prefix: str = "hvd_sparse"):
        self.algorithm = algorithm
        self.process_set = process_set
        self.prefix = prefix
        self._param_order: dict[str, int] = {}
        self._params_by_numel: dict[int, list[tuple[str, torch.nn.Parameter]]] = {}
        if named_parameters is not None:
            for position, (name, param) in enumerate(named_parameters):
                self._param_order[name] = position
                self._params_by_numel.setdefault(param.numel(), []).append((name, param))
        self._engine: Engine | None = None
        self._protocols: AsyncProtocols | None = None
        self._stash: dict[str, torch.Tensor] = {}
        self._model_slot: dict[str, int] = {}
        self._outstanding = 0
        self._ordinal = 0
        self._warned_unmatched = False

    # --- Horovod's interface --------------------------------------------------------------------
    def compress(self, tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        engine, protocols = self._ensure_engine()
        if self._outstanding == 0:  # first gradient of a new step
            protocols.clear()
            self._stash.clear()
            self._model_slot.clear()
            self._ordinal = 0
        self._outstanding += 1
        key = self._key_for(tensor)
        if self.algorithm.scope == MODEL:
            self._stash[key] = tensor
        else:
            protocols.start(key, engine.step(key, [tensor]))
        dtype = tensor.dtype if tensor.dtype in _PLACEHOLDER_DTYPES else torch.float32
        return torch.zeros(1, dtype=dtype, device=tensor.device), key

    def decompress(self, tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        key = ctx
        engine, protocols = self._ensure_engine()
        if self.algorithm.scope == MODEL and MODEL_BUCKET not in protocols.results:
            arrival = {k: i for i, k in enumerate(self._stash)}
            unknown = len(self._param_order)
            order = sorted(self._stash, key=lambda k: (self._param_order.get(k, unknown), arrival[k]))
            self._model_slot = {k: i for i, k in enumerate(order)}
            protocols.start(MODEL_BUCKET, engine.step(MODEL_BUCKET, [self._stash[k] for k in order]))
            self._stash.clear()
        protocols.finish_all()
        self._outstanding -= 1
        if self.algorithm.scope == MODEL:
            return protocols.results[MODEL_BUCKET][self._model_slot[key]]
        return protocols.results[key][0]

    # --- statistics and checkpoints -------------------------------------------------------------
    def stats(self) -> dict:
        """Statistics of the last step on this rank (see README, "Statistics")."""
        if self._engine is None:
            return summarize([], self.algorithm.density)
        return self._engine.stats()

    def state_dict(self) -> dict:
        """This rank's state (residuals and control state); save one file per rank."""
        return self._ensure_engine()[0].state_dict()

    def load_state_dict(self, state: dict) -> None:
        self._ensure_engine()[0].load_state_dict(state)

    def __repr__(self) -> str:
        return f"hvd_sparse.torch.{self.algorithm!r}"

    # --- internals --------------------------------------------------------------------------------
    def _ensure_engine(self) -> tuple[Engine, AsyncProtocols]:
        if self._engine is None:
            comm = HorovodTorchComm(self.process_set)
            self._engine = Engine(self.algorithm, get_backend("torch"), comm.rank, comm.size, self.prefix)
            self._protocols = AsyncProtocols(comm)
        return self._engine, self._protocols  # type: ignore[return-value]

    def _key_for(self, tensor: torch.Tensor) -> str:
        for name, param in self._params_by_numel.get(tensor.numel(), ()):
            if param.grad is tensor:
                return name
        if self._params_by_numel and not self._warned_unmatched:
            self._warned_unmatched = True
            warnings.warn("hvd_sparse: a gradient did not match any of named_parameters (a "
                          "converted or sparse gradient?); it is named by its order in the step",
                          stacklevel=3)
        self._ordinal += 1
        return f"t{self._ordinal - 1}"
