"""The shape of Horovod that hvd_sparse/{torch,tensorflow}/horovod_internals.py rely on.

The faces refuse Adasum and reductions other than Average by reading Horovod's private structure
(there is no public way: Horovod hands ``compress`` the tensor alone). If a Horovod upgrade
changes that structure, the refusals would silently stop; these checks fail instead, naming what
changed. tests/multiproc/test_horovod_refusals.py provokes the refusals in real Horovod jobs.
"""

from __future__ import annotations

import inspect
import os
import types

import pytest

BUMP = ("re-check every fact listed in the module docstring against the new Horovod, then update "
        "WRITTEN_FOR")


def names_used(code: types.CodeType) -> set[str]:
    """Global and attribute names a function's code uses, nested code (comprehensions) included."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= names_used(const)
    return names


def test_torch_optimizer_shape():
    horovod = pytest.importorskip("horovod")
    pytest.importorskip("torch")
    from horovod.torch import optimizer

    from hvd_sparse.torch import horovod_internals as internals

    assert horovod.__version__ == internals.WRITTEN_FOR, BUMP
    # DistributedOptimizer builds its class from the private classes' dicts, Adasum's for op=Adasum.
    builder = names_used(optimizer.DistributedOptimizer.__code__)
    assert {"_DistributedOptimizer", "_DistributedAdasumOptimizer", "Adasum", "__dict__"} <= builder
    # The functions that call compress: with self._compression, and self.op for the reduction.
    for code in internals.OPTIMIZER_COMPRESS_CALLERS:
        assert {"_compression", "compress", "op"} <= names_used(code), code.co_name
        assert code.co_varnames[0] == "self"
    adasum = internals.ADASUM_COMPRESS_CALLER
    assert {"_compression", "compress", "Adasum"} <= names_used(adasum)
    assert "op" not in names_used(adasum)      # it has no op to read: its code object identifies it
    # The grouped caller compresses in a comprehension (its own frame before Python 3.12, with
    # ``self`` as a free variable): the search must reach one frame further.
    grouped = internals.OPTIMIZER_COMPRESS_CALLERS[1]
    assert "compress" not in grouped.co_names and "compress" in names_used(grouped)
    assert internals.CALLER_DEPTH >= 2


def test_tensorflow_allreduce_shape():
    horovod = pytest.importorskip("horovod")
    pytest.importorskip("tensorflow")
    import horovod.tensorflow as hvd

    from hvd_sparse.tensorflow import horovod_internals as internals

    assert horovod.__version__ == internals.WRITTEN_FOR, BUMP
    for function in (hvd.allreduce, hvd.grouped_allreduce):
        code = inspect.unwrap(function).__code__
        assert {"compression", "op"} <= set(inspect.signature(function).parameters), function
        assert {"compression", "op", "average_in_framework"} <= set(code.co_varnames), function
        assert "compress" in names_used(code)
    # Horovod's Keras optimizer: the package whose frames mark its gradient reduction.
    import horovod._keras

    assert internals.KERAS_PACKAGE in os.path.dirname(horovod._keras.__file__) + os.sep
