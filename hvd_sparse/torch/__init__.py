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
RandomK = face_class(SparseCompressor, algorithms.RandomK, __name__)
Threshold = face_class(SparseCompressor, algorithms.Threshold, __name__)
GaussianK = face_class(SparseCompressor, algorithms.GaussianK, __name__)
DGC = face_class(SparseCompressor, algorithms.DGC, __name__)

__all__ = ["DGC", "GaussianK", "RandomK", "SparseCompressor", "Threshold", "TopK"]
