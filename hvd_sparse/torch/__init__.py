"""PyTorch face: ``compression=`` objects for stock ``horovod.torch.DistributedOptimizer``.

    import horovod.torch as hvd
    import hvd_sparse.torch as hs
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                   compression=hs.TopK(density=0.01,
                                                       named_parameters=model.named_parameters()))

Elastic Horovod: ``hvd.elastic.TorchState(model=model, optimizer=opt, compression=compression)``.
"""

from ..faces import face_classes
from .compressor import SparseCompressor
from .elastic import register as _register_elastic_handler

_register_elastic_handler()   # hvd.elastic.TorchState(..., compression=compression): torch/elastic.py

# One face class per registered method (TopK, ExDyna, ...), made in hvd_sparse/faces.py.
FACES = face_classes(SparseCompressor, __name__)
globals().update(FACES)

__all__ = ["SparseCompressor", *sorted(FACES)]
