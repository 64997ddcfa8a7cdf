"""TensorFlow face: ``compression=`` objects for stock ``hvd.DistributedGradientTape`` and the
Keras ``hvd.DistributedOptimizer`` (tf-keras).

    import horovod.tensorflow as hvd
    import hvd_sparse.tensorflow as hs
    tape = hvd.DistributedGradientTape(tape, compression=hs.TopK(density=0.01))
"""

from typing import Any

from . import baselines, layerwise, methods, simple_baselines
from .baselines import DGC, GaussianK, TopK
from .compressor import SparseCompressor
from .grouping import with_model_grouping
from .layerwise import DEFT, LAGS
from .methods import ExDyna, MiCRO
from .simple_baselines import RandomK, Threshold

# One face class per registered method, written by tools/generate_faces.py.
FACES = {**methods.FACES, **layerwise.FACES, **baselines.FACES, **simple_baselines.FACES}


def DistributedGradientTape(tape: Any, compression: Any, **kwargs: Any) -> Any:
    """``horovod.tensorflow.DistributedGradientTape`` that puts every gradient in one group
    (``groups=1``), unless the caller chose a grouping: whole-model methods need it, per-tensor
    ones run faster with it."""
    import horovod.tensorflow as hvd

    return hvd.DistributedGradientTape(tape, compression=compression,
                                       **with_model_grouping(compression, kwargs))


def __getattr__(name: str) -> Any:
    # The Keras callback and optimizers load Keras, which TF users without Keras should not pay for.
    if name == "CompressionCallback":
        from .callbacks import CompressionCallback

        return CompressionCallback
    if name == "optimizers":
        from . import optimizers

        return optimizers
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["DEFT", "DGC", "LAGS", "CompressionCallback", "DistributedGradientTape", "ExDyna", "GaussianK",
           "MiCRO", "RandomK", "SparseCompressor", "Threshold", "TopK", "optimizers"]
