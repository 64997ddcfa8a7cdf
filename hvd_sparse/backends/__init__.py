"""Backends: the bulk array operations of each framework (the interface: base.py; the named
results of the fused ops: contract.py; the numerics every path shares: exact.py)."""

from __future__ import annotations

from .base import Backend, Momentum, index_dtype_for, top_magnitudes
from .contract import Moments, Norms, SampledSegment, Selected, ThresholdBand, Velocity

__all__ = [
    "Backend",
    "Moments",
    "Momentum",
    "Norms",
    "SampledSegment",
    "Selected",
    "ThresholdBand",
    "Velocity",
    "get_backend",
    "index_dtype_for",
    "top_magnitudes",
]

_INSTANCES: dict[str, Backend] = {}


def get_backend(name: str) -> Backend:
    """The backend for 'numpy', 'torch' or 'tensorflow' (imported on first use)."""
    if name not in _INSTANCES:
        if name == "numpy":
            from .numpy_backend import NumpyBackend

            _INSTANCES[name] = NumpyBackend()
        elif name == "torch":
            from .torch_backend import TorchBackend

            _INSTANCES[name] = TorchBackend()
        elif name == "tensorflow":
            from .tf_backend import TensorFlowBackend

            _INSTANCES[name] = TensorFlowBackend()
        else:
            raise ValueError(f"unknown backend {name!r}: use 'numpy', 'torch' or 'tensorflow'")
    return _INSTANCES[name]
