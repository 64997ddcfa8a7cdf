"""Horovod's grouping for the TensorFlow face: whole-model methods need every gradient in one
Horovod group, and per-tensor methods run every gradient's phases in shared py_functions with it
(docs/architecture.md#tensorflow-face). Used by the tape (``__init__.py``) and the Keras optimizer
(``keras.py``), which the compressor itself imports.
"""

from __future__ import annotations

from typing import Any


def with_model_grouping(compression: Any, kwargs: dict) -> dict:
    """Horovod keyword arguments with every gradient in one group (``groups=1``: Horovod 0.28's
    name; ``num_groups=1`` means the same with a DeprecationWarning) when ``compression`` is an
    hvd_sparse compressor and the caller chose no grouping."""
    algorithm = getattr(compression, "algorithm", None)
    if algorithm is not None and kwargs.get("groups") is None and not kwargs.get("num_groups"):
        kwargs = {**kwargs, "groups": 1}
    return kwargs
