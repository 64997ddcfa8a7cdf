"""PyTorch face: ``compression=`` objects for stock ``horovod.torch.DistributedOptimizer``.

    import horovod.torch as hvd
    import hvd_sparse.torch as hs
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                   compression=hs.TopK(density=0.01,
                                                       named_parameters=model.named_parameters()))

Elastic Horovod: ``hvd.elastic.TorchState(model=model, optimizer=opt, compression=compression)``.
"""

from .. import algorithms
from ..faces import face_class
from .compressor import SparseCompressor
from .elastic import register as _register_elastic_handler

_register_elastic_handler()   # hvd.elastic.TorchState(..., compression=compression): torch/elastic.py

TopK = face_class(SparseCompressor, algorithms.TopK, __name__)
ExDyna = face_class(SparseCompressor, algorithms.ExDyna, __name__)
MiCRO = face_class(SparseCompressor, algorithms.MiCRO, __name__)
DEFT = face_class(SparseCompressor, algorithms.DEFT, __name__)
LAGS = face_class(SparseCompressor, algorithms.LAGS, __name__)
RandomK = face_class(SparseCompressor, algorithms.RandomK, __name__)
Threshold = face_class(SparseCompressor, algorithms.Threshold, __name__)
GaussianK = face_class(SparseCompressor, algorithms.GaussianK, __name__)
DGC = face_class(SparseCompressor, algorithms.DGC, __name__)

__all__ = ["DEFT", "DGC", "LAGS", "ExDyna", "GaussianK", "MiCRO", "RandomK", "SparseCompressor",
           "Threshold", "TopK"]
