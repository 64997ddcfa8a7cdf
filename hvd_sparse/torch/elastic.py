"""Elastic Horovod in PyTorch: the compressor as one more keyword of ``hvd.elastic.TorchState``.

    state = hvd.elastic.TorchState(model=model, optimizer=optimizer, compression=compression, epoch=0)

Horovod's TorchState saves, restores and synchronizes each keyword through the handler its
registry assigns to the value's type (``horovod.torch.elastic.state``, ``set_handler_registry``:
the extension point Horovod provides; nothing of Horovod is replaced). Importing
``hvd_sparse.torch`` adds one entry for hvd_sparse compressors, whose handler delegates to
``hvd_sparse.elastic.ElasticCompressor``: ``commit()`` saves the compressor with the model, a
rollback restores both, and every reset rebuilds the compressor for the new rank and world size.
Without the entry, TorchState would treat the compressor as a plain object and replace it on every
rank with a pickled copy of rank 0's, which the optimizer does not use.
"""

from __future__ import annotations

from typing import Any

from horovod.torch.elastic import state as horovod_state
from horovod.torch.functions import broadcast_object

from ..elastic import ElasticCompressor
from .compressor import SparseCompressor


class CompressorStateHandler(horovod_state.StateHandler):
    """TorchState's handler for an hvd_sparse compressor (module docstring)."""

    def __init__(self, compression: SparseCompressor):
        super().__init__(compression)
        self._elastic = ElasticCompressor(compression)

    def save(self) -> None:
        """Commit the compressor (``ElasticCompressor.save``)."""
        self._elastic.save()

    def restore(self) -> None:
        """Roll back to the last commit."""
        self._elastic.restore()

    def sync(self) -> None:
        """Rebuild for the new world from rank 0's state."""
        self._elastic.sync(broadcast_object)

    def set_value(self, value: Any) -> None:
        """Another compressor: its state now is the committed one (no message)."""
        self.value = value
        self._elastic = ElasticCompressor(value)   # its state now is the committed one (no message)


def register() -> None:
    """Add the handler to Horovod's registry (once)."""
    registry = horovod_state.get_handler_registry()
    if not any(handler is CompressorStateHandler for _, handler in registry):
        horovod_state.set_handler_registry([*registry, (SparseCompressor, CompressorStateHandler)])
