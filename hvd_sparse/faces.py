"""What the PyTorch and TensorFlow faces share, written once.

``FaceBase`` holds the options every compressor takes, the engine it drives, and the API that
does not depend on the framework: ``set_epoch``, ``stats``, ``average_stats``, ``rank``,
``state_dict``/``load_state_dict``. A face adds Horovod's ``compress``/``decompress`` and two
hooks: ``_make_engine`` (with its communication layer) and ``_sum_over_ranks``.

Every face has one class per registered method (``registry.METHODS``), written out by
tools/generate_faces.py so that tools see them: ``hvd_sparse.torch.TopK(density=0.01,
named_parameters=...)`` is the PyTorch face wrapped around ``hvd_sparse.algorithms.TopK``. Each
takes the algorithm's hyper-parameters and the face's keyword-only options together, documents
both, and builds itself with ``build_face``.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np

from . import monitor
from .algorithms.base import Algorithm, check_choice
from .algorithms.corrections import AdamPath
from .engine import Engine, summarize
from .engine.core import NONFINITE_POLICIES
from .errors import ConfigurationError


class FaceBase:
    """Options and framework-free API of a Horovod compressor running an hvd_sparse method.

    Args:
        algorithm: the method and its hyper-parameters.
        process_set: the Horovod process set the gradients are reduced over (default: global).
        prefix: prefix of every collective's name; give two compressors in one job distinct ones.
        nonfinite: what a rank does with a NaN/Inf gradient: "skip" (send zeros this step, keep
            the residual, warn), "raise" (every rank raises FloatingPointError; the step is
            applied nowhere and training can go on, docs/usage.md#non-finite-gradients) or "ignore".
        optimizer: the optimizer the compressor serves (under Horovod, the one then wrapped in
            ``hvd.DistributedOptimizer``). hvd_sparse's Adam or AdamW turns the Adam path on
            (docs/methods.md#adam-and-adamw); another optimizer is checked (momentum applied
            twice) and otherwise left as it is.
    """

    framework: ClassVar[str] = "abstract"

    def __init__(self, algorithm: Algorithm, *, process_set: Any = None, prefix: str = "hvd_sparse",
                 nonfinite: str = "skip", optimizer: Any = None):
        path = self.adam_path_of(optimizer)
        if path is not None and algorithm.corrections.adam != path:
            raise ConfigurationError(
                f"optimizer={type(optimizer).__name__}(...) asks for the Adam path {path!r}, and the "
                f"method was built with adam={algorithm.corrections.adam!r}: build it through the face "
                f"class (e.g. hvd_sparse.{self.framework}.{type(algorithm).__name__}(..., optimizer=opt)), "
                "which sets both, or give the algorithm adam= of the same betas and eps")
        self.algorithm = algorithm
        self.process_set = process_set
        self.prefix = prefix
        self.nonfinite = check_choice("nonfinite", nonfinite, NONFINITE_POLICIES)
        self._engine: Engine | None = None
        self._elastic: Any = None   # hvd_sparse.elastic.ElasticCompressor, once in an elastic State
        self._optimizer_seen = False   # an optimizer's momentum was checked (_check_optimizer)
        self._stock_adam_warned = False
        self._adam_link = self._link_optimizer(optimizer, path) if path is not None else None
        if optimizer is not None:
            self._check_optimizer(self._momentum_of(optimizer))

    # --- the framework's part ----------------------------------------------------------------------
    def _make_engine(self) -> Engine:
        """The engine on this rank, with whatever communication layer the face drives it with."""
        raise NotImplementedError

    def _sum_over_ranks(self, values: np.ndarray, name: str) -> np.ndarray:
        """One named allreduce (sum) of a small float64 vector on the compressor's process set."""
        raise NotImplementedError

    @classmethod
    def adam_path_of(cls, optimizer: Any) -> AdamPath | None:
        """The Adam path that ``optimizer`` (a face's ``optimizer=``) asks for: hvd_sparse's Adam
        and AdamW of the framework; None for an optimizer the path does not concern. Raises
        ``ConfigurationError`` naming what to use for one the path cannot serve (the framework's
        own Adam, which would normalise the path's update again)."""
        if optimizer is not None and not isinstance(optimizer, AdamPath):
            raise ConfigurationError(f"the {cls.framework} face does not take optimizer={optimizer!r}")
        return optimizer

    def _link_optimizer(self, optimizer: Any, path: AdamPath) -> Any:
        """Link ``optimizer`` to this compressor's Adam path (the framework's shared object)."""
        return None

    def _momentum_of(self, optimizer: Any) -> str | None:
        """How ``optimizer`` applies momentum of its own (``_check_optimizer``), or None."""
        return None

    def _is_stock_adam(self, optimizer: Any) -> bool:
        """Whether ``optimizer`` is an Adam-style optimizer stepping without the Adam path."""
        return False

    def _note_optimizer(self, optimizer: Any) -> None:
        """A face that sees the optimizer stepping its gradients (Horovod's, the Keras wrapper's)
        checks it once: momentum applied twice (``_check_optimizer``), and an Adam that steps
        without the Adam path, which warns once naming the fix."""
        if not self._optimizer_seen:
            self._check_optimizer(self._momentum_of(optimizer))
        if self._stock_adam_warned or self.algorithm.corrections.adam is not None:
            return
        if self._is_stock_adam(optimizer):
            self._stock_adam_warned = True
            warnings.warn(
                f"hvd_sparse: {type(optimizer).__name__} steps on {type(self.algorithm).__name__}'s "
                "sparse average without the Adam path. Adam divides each entry by its running RMS, "
                "so a residual that error feedback releases after many steps moves its weight about "
                "once, and quality falls well behind dense Adam (docs/methods.md#adam-and-adamw). "
                f"Build the optimizer as hvd_sparse.{self.framework}'s Adam/AdamW (same arguments) "
                "and pass it to the compressor as optimizer=", RuntimeWarning, stacklevel=4)

    def _extra_stats(self) -> dict:
        """Statistics only the face can measure (PyTorch: communication timing)."""
        return {}

    def _current_world(self) -> tuple[int, int]:
        """This process's (rank, size) in the compressor's process set, as Horovod has it now."""
        raise NotImplementedError

    def _forget_step(self) -> None:
        """Drop whatever the face keeps about a step in flight (an elastic reset abandons it)."""

    def _agree_at_sync(self) -> None:
        """Called on every process, at the same point, by an elastic ``sync`` that continues a
        running job (newcomers and survivors alike): a face whose configuration check would
        otherwise run where only some processes are (TensorFlow: while tracing) runs it here.
        The engine's own checks need nothing: every process rebuilds its engine at a reset."""

    def _check_optimizer(self, momentum: str | None) -> None:
        """Called by a face that can see the optimizer it serves, with how that optimizer applies
        momentum of its own (``momentum``, e.g. "SGD(momentum=0.9)"; None: it has none). With the
        momentum correction on (algorithms/corrections.py) the update would carry momentum
        twice: warn, once per compressor. Only the first optimizer seen is checked."""
        if self._optimizer_seen:
            return
        self._optimizer_seen = True
        mu = self.algorithm.corrections.momentum
        if momentum is None or mu == 0.0:
            return
        warnings.warn(
            f"hvd_sparse: {type(self.algorithm).__name__} applies the momentum correction "
            f"(momentum={mu}) and the optimizer it serves has momentum of its own ({momentum}): the "
            "update then has momentum twice. Build the optimizer without momentum (momentum=0; for "
            "an Adam-style optimizer, a first beta of 0), or drop the compressor's momentum "
            "(momentum=0)", RuntimeWarning, stacklevel=3)

    # --- elastic Horovod (hvd_sparse/elastic.py) ------------------------------------------------------
    def _drop_engine(self) -> None:
        self._engine = None
        self._forget_step()

    def _follow_world(self) -> None:
        """Where a step begins: if Horovod's rank or size changed since the engine was built (an
        elastic reset), rebuild for the new world from this process's own state when the
        compressor is in the elastic State, else refuse (it would hang or average wrongly)."""
        engine = self._engine
        if engine is None or self._current_world() == (engine.rank, engine.size):
            return
        if self._elastic is None:
            raise ConfigurationError(
                f"the Horovod world changed from rank {engine.rank} of {engine.size} to rank "
                f"{self._current_world()[0]} of {self._current_world()[1]} (an elastic reset), and "
                "this compressor is not part of the elastic state: pass it to the state, e.g. "
                "hvd.elastic.TorchState(model=..., optimizer=..., compression=compression) or "
                "hvd_sparse.tensorflow.elastic.TensorFlowKerasState(model, optimizer, "
                "compression=compression)")
        self._elastic.reset()

    # --- shared API ----------------------------------------------------------------------------------
    def _ensure_engine(self) -> Engine:
        if self._engine is None:
            self._engine = self._make_engine()
        return self._engine

    def set_epoch(self, epoch: int) -> None:
        """Tell a method with an epoch schedule (DGC's density warm-up) that ``epoch`` (0-based)
        starts; call it on every rank (``CompressionCallback`` does for Keras). It takes effect
        at the next step. Methods without a schedule ignore it."""
        hook = getattr(self.algorithm, "set_epoch", None)
        if hook is not None:
            hook(epoch)

    def stats(self) -> dict:
        """Statistics of the last step on this rank (docs/usage.md#statistics)."""
        if self._engine is None:
            return summarize([], self.algorithm.density)
        out = {**self._engine.stats(), **self._extra_stats(), "world_size": self._engine.size}
        if self._elastic is not None:
            out.update(self._elastic.stats())
        return out

    def average_stats(self, keys: Sequence[str] = monitor.DEFAULT_KEYS) -> dict[str, float]:
        """The mean over ranks of the chosen statistics, on every rank. One named allreduce:
        every rank must call it, at the same point of training."""
        engine = self._ensure_engine()
        values = np.asarray(monitor.stat_vector(self.stats(), keys), dtype=np.float64)
        summed = self._sum_over_ranks(values, f"{self.prefix}.stats")
        return monitor.mean_over_ranks(keys, list(summed), engine.size)

    @property
    def rank(self) -> int:
        """This process's rank in the compressor's process set."""
        return self._ensure_engine().rank

    def state_dict(self) -> dict:
        """This rank's state (residuals and control state); save one file per rank."""
        return self._ensure_engine().state_dict()

    def load_state_dict(self, state: dict) -> None:
        """Restore a ``state_dict`` (docs/architecture.md#checkpoints)."""
        self._ensure_engine().load_state_dict(state)

    def __repr__(self) -> str:
        return f"hvd_sparse.{self.framework}.{self.algorithm!r}"


def refuse_reduction_op(op: Any, hvd: Any) -> None:
    """Raise unless ``op`` (the calling Horovod reduction, from module ``hvd``) is Average: a
    sparsifier returns the average over ranks whatever Horovod is told to compute."""
    if op is None or op == hvd.Average:
        return
    if op == hvd.Adasum:
        raise ConfigurationError(
            "op=hvd.Adasum cannot be combined with an hvd_sparse compressor: Adasum combines whole "
            "dense tensors (in PyTorch, parameter deltas rather than gradients) with an operator a "
            "sparse exchange does not compute. Use op=hvd.Average (the default) with hvd_sparse, "
            "or Adasum without compression")
    names = {hvd.Sum: "hvd.Sum", hvd.Min: "hvd.Min", hvd.Max: "hvd.Max", hvd.Product: "hvd.Product"}
    raise ConfigurationError(
        f"op={names.get(op, op)} cannot be combined with an hvd_sparse compressor, which always "
        "returns the average over ranks: pass op=hvd.Average (the default); for a sum, scale the "
        "learning rate by hvd.size()")


def build_face(face: FaceBase, base: type[FaceBase], method: type[Algorithm],
               arguments: dict[str, Any]) -> None:
    """The ``__init__`` of every face class (the generated face modules): ``arguments`` (its
    ``locals()``) split into the method's, which build the algorithm, and the face's keyword-only
    options; an optimizer that asks for the Adam path builds the method with it (its defaults
    follow) unless ``adam=`` was given."""
    init = base.__init__
    options = {p.name for p in inspect.signature(init).parameters.values()
               if p.kind is p.KEYWORD_ONLY}
    face_kwargs = {k: v for k, v in arguments.items() if k in options}
    method_kwargs = {k: v for k, v in arguments.items()
                     if k not in options and k not in ("self", "__class__")}
    path = base.adam_path_of(face_kwargs.get("optimizer"))
    if path is not None and method_kwargs.get("adam") is None:
        method_kwargs["adam"] = path
    init(face, method(**method_kwargs), **face_kwargs)
