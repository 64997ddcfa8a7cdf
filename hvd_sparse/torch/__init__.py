"""PyTorch face: ``compression=`` objects for stock ``horovod.torch.DistributedOptimizer``.

    import horovod.torch as hvd
    import hvd_sparse.torch as hs
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                   compression=hs.TopK(density=0.01,
                                                       named_parameters=model.named_parameters()))
"""

from .. import algorithms
from ..faces import face_class
from .compressor import SparseCompressor

TopK = face_class(SparseCompressor, algorithms.TopK, __name__)
LAGS = face_class(SparseCompressor, algorithms.LAGS, __name__)

__all__ = ["LAGS", "SparseCompressor", "TopK"]
