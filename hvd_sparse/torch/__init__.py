"""PyTorch faces: ``compression=`` objects for stock ``horovod.torch.DistributedOptimizer``, and
DistributedDataParallel communication hooks (``hvd_sparse.torch.ddp``, which needs no Horovod).

    import horovod.torch as hvd
    import hvd_sparse.torch as hs
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                   compression=hs.TopK(density=0.01,
                                                       named_parameters=model.named_parameters()))

Elastic Horovod: ``hvd.elastic.TorchState(model=model, optimizer=opt, compression=compression)``.

Adam and AdamW (the Adam path, docs/methods.md#adam-and-adamw): build the optimizer as
``hvd_sparse.torch.optim.AdamW`` (torch's arguments) and pass it as ``optimizer=``.
"""

from ..registry import METHODS
from . import optim

try:
    from .compressor import SparseCompressor  # imports horovod.torch
except ImportError as missing:   # no (working) Horovod: the DDP face works without it
    _HOROVOD_MISSING: ImportError | None = missing
    FACES: dict = {}
else:
    from .elastic import register as _register_elastic_handler

    _HOROVOD_MISSING = None
    _register_elastic_handler()   # hvd.elastic.TorchState(..., compression=compression): torch/elastic.py
    # One face class per registered method, written by tools/generate_faces.py.
    from . import baselines, layerwise, methods, simple_baselines
    from .baselines import DGC, GaussianK, TopK
    from .layerwise import DEFT, LAGS
    from .methods import ExDyna, MiCRO
    from .simple_baselines import RandomK, Threshold

    FACES = {**methods.FACES, **layerwise.FACES, **baselines.FACES, **simple_baselines.FACES}

_HOROVOD_NAMES = {"SparseCompressor", *(cls.__name__ for cls in METHODS.values())}


def __getattr__(name: str):
    """Without Horovod, the Horovod face's names raise an ImportError that says so."""
    if name in _HOROVOD_NAMES and _HOROVOD_MISSING is not None:
        raise ImportError(
            f"hvd_sparse.torch.{name} is the Horovod face and needs horovod.torch, which did not "
            f"import ({_HOROVOD_MISSING}): install Horovod (make install), or use the DDP face, "
            f"hvd_sparse.torch.ddp.{name}") from _HOROVOD_MISSING
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["optim"]
if _HOROVOD_MISSING is None:
    __all__ += ["DEFT", "DGC", "LAGS", "ExDyna", "GaussianK", "MiCRO", "RandomK", "SparseCompressor",
                "Threshold", "TopK"]
