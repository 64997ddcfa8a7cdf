"""TensorFlow face: ``compression=`` objects for stock ``hvd.DistributedGradientTape`` and the
Keras ``hvd.DistributedOptimizer`` (tf-keras).

    import horovod.tensorflow as hvd
    import hvd_sparse.tensorflow as hs
    tape = hvd.DistributedGradientTape(tape, compression=hs.TopK(density=0.01))
"""

from typing import Any

from .. import algorithms
from ..faces import face_class
from .compressor import SparseCompressor, with_model_grouping

TopK = face_class(SparseCompressor, algorithms.TopK, __name__)
ExDyna = face_class(SparseCompressor, algorithms.ExDyna, __name__)
MiCRO = face_class(SparseCompressor, algorithms.MiCRO, __name__)
DEFT = face_class(SparseCompressor, algorithms.DEFT, __name__)
LAGS = face_class(SparseCompressor, algorithms.LAGS, __name__)
RandomK = face_class(SparseCompressor, algorithms.RandomK, __name__)
Threshold = face_class(SparseCompressor, algorithms.Threshold, __name__)
GaussianK = face_class(SparseCompressor, algorithms.GaussianK, __name__)
DGC = face_class(SparseCompressor, algorithms.DGC, __name__)


def DistributedGradientTape(tape: Any, compression: Any, **kwargs: Any) -> Any:
    """``horovod.tensorflow.DistributedGradientTape`` that puts every gradient in one group
    (``num_groups=1``) for whole-model methods, unless the caller chose a grouping."""
    import horovod.tensorflow as hvd

    return hvd.DistributedGradientTape(tape, compression=compression,
                                       **with_model_grouping(compression, kwargs))


def __getattr__(name: str) -> Any:
    # The Keras callback loads Keras, which TF users without Keras should not pay for.
    if name == "CompressionCallback":
        from .callbacks import CompressionCallback

        return CompressionCallback
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["DEFT", "DGC", "LAGS", "CompressionCallback", "DistributedGradientTape", "ExDyna", "GaussianK",
           "MiCRO", "RandomK", "SparseCompressor", "Threshold", "TopK"]
