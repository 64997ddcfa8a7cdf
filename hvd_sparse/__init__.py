"""hvd_sparse: gradient sparsification for Horovod, for PyTorch and TensorFlow.

Framework faces: ``hvd_sparse.torch`` and ``hvd_sparse.tensorflow`` (each imports Horovod).
This top level imports no framework.
"""

from .errors import ConfigurationError, HvdSparseError, RankMismatchError, UnsupportedTensorError
from .registry import available, create

__version__ = "0.1.0"

__all__ = ["ConfigurationError", "HvdSparseError", "RankMismatchError", "UnsupportedTensorError",
           "__version__", "available", "create"]
