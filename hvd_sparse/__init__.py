"""hvd_sparse: gradient sparsification for Horovod, for PyTorch and TensorFlow.

Framework faces: ``hvd_sparse.torch`` and ``hvd_sparse.tensorflow`` (each imports Horovod), and
``hvd_sparse.torch.ddp``: PyTorch DDP communication hooks (no Horovod needed).
This top level imports no framework. ``set_kernels`` selects the fused kernels (hvd_sparse.kernels,
default "auto") or the reference path ("off"); the environment variable HVD_SPARSE_KERNELS sets
the initial mode. See docs/kernels.md.
"""

from .errors import ConfigurationError, HvdSparseError, RankMismatchError, UnsupportedTensorError
from .registry import available, create


def set_kernels(mode: str) -> None:
    """Use the fused kernels where one exists for a tensor's device and dtype ("auto", the
    default) or the reference path everywhere ("off"). Both give identical results."""
    from . import kernels
    kernels.set_mode(mode)


def kernels_mode() -> str:
    """The current kernel mode: "auto" or "off"."""
    from . import kernels
    return kernels.mode()


__version__ = "0.1.0"

__all__ = ["ConfigurationError", "HvdSparseError", "RankMismatchError", "UnsupportedTensorError",
           "__version__", "available", "create", "kernels_mode", "set_kernels"]
