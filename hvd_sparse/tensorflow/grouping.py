"""Horovod's grouping for the TensorFlow face: whole-model methods need every gradient in one
Horovod group (docs/architecture.md#tensorflow-face). Used by the tape (``__init__.py``) and the
Keras optimizer (``keras.py``), which the compressor itself imports.
"""

from __future__ import annotations

from typing import Any

from ..algorithms.base import TENSOR


def with_model_grouping(compression: Any, kwargs: dict) -> dict:
    """Horovod keyword arguments with every gradient in one group (``num_groups=1``) when
    ``compression`` buckets several tensors together and the caller chose no grouping."""
    algorithm = getattr(compression, "algorithm", None)
    if algorithm is not None and algorithm.scope != TENSOR and "groups" not in kwargs:
        kwargs = {**kwargs, "num_groups": kwargs.get("num_groups") or 1}
    return kwargs
