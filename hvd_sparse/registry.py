"""Methods by name, for command-line tools and configuration files."""

from __future__ import annotations

import importlib
from typing import Any

from . import algorithms
from .errors import ConfigurationError

METHODS: dict[str, type[algorithms.Algorithm]] = {cls.name: cls for cls in algorithms.METHODS}

_FACES = {"torch": "hvd_sparse.torch", "pytorch": "hvd_sparse.torch",
          "tensorflow": "hvd_sparse.tensorflow", "tf": "hvd_sparse.tensorflow",
          "ddp": "hvd_sparse.torch.ddp"}


def available() -> list[str]:
    """Names accepted by ``create``."""
    return sorted(METHODS)


def create(method: str, framework: str | None = None, **options: Any) -> Any:
    """Build a method by name.

    ``create("topk", framework="torch", density=0.01)`` returns ``hvd_sparse.torch.TopK(...)``;
    ``framework="tensorflow"`` the TensorFlow face; ``framework="ddp"`` the state of a PyTorch
    DDP communication hook (``hvd_sparse.torch.ddp``); ``framework=None`` the framework-free
    algorithm object (for the engine and the simulator).
    """
    cls = METHODS.get(method.lower())
    if cls is None:
        raise ConfigurationError(f"unknown method {method!r}; available: {', '.join(available())}")
    if framework is None:
        return cls(**options)
    module = _FACES.get(framework.lower())
    if module is None:
        raise ConfigurationError(f"unknown framework {framework!r}: use 'torch', 'tensorflow' or 'ddp'")
    return getattr(importlib.import_module(module), cls.__name__)(**options)
