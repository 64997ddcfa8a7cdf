"""The native CPU library: every kernels/cpu/*.cpp built into one shared object, loaded with ctypes.

setup.py builds it (plain C ABI, no Python or torch headers) as ``_native<EXT_SUFFIX>`` next to
this file; an editable install (``make install``) builds it in place. ``library()`` loads it once
and raises ``KernelUnavailable`` naming the cause when it is missing, out of date or unloadable.
"""

from __future__ import annotations

import ctypes
import importlib.machinery
from pathlib import Path

from .. import KernelUnavailable

HERE = Path(__file__).resolve().parent
STEM = "_native"
FIX = "rebuild it with `make install` (or `pip install -e .` in the repository)"

_library: ctypes.CDLL | None = None


def library_path() -> Path | None:
    """The built library next to this file, or None."""
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = HERE / f"{STEM}{suffix}"
        if path.exists():
            return path
    return None


def library() -> ctypes.CDLL:
    """The loaded native library (loaded on first call)."""
    global _library
    if _library is None:
        path = library_path()
        if path is None:
            raise KernelUnavailable(f"the native library {HERE / STEM}*.so was not built: {FIX}")
        # In a source tree, a library older than a source would compute what the sources no longer
        # say: refuse it rather than run stale code.
        built = path.stat().st_mtime
        stale = [p.name for p in sorted(HERE.glob("*.cpp")) + sorted(HERE.glob("*.h"))
                 if p.stat().st_mtime > built]
        if stale:
            raise KernelUnavailable(f"the native library {path.name} is older than {', '.join(stale)}: {FIX}")
        try:
            _library = ctypes.CDLL(str(path))
        except OSError as error:
            raise KernelUnavailable(f"cannot load {path}: {error}") from error
    return _library


def value_index_types() -> list[tuple]:
    """(value dtype, its C suffix, index dtype, its C suffix) of every value/index pair the
    library's index-taking functions are instantiated for (``hvd_sparse_<op>_f32_i32`` ...)."""
    import torch  # here, not at import: _library is loaded by the ops that need torch anyway

    return [(value, v, index, i)
            for value, v in ((torch.float32, "f32"), (torch.float64, "f64"))
            for index, i in ((torch.int32, "i32"), (torch.int64, "i64"))]


def bind(name: str, restype, argtypes: list) -> ctypes._CFuncPtr:
    """The library's function ``name`` with its C signature declared."""
    try:
        function = getattr(library(), name)
    except AttributeError as error:
        raise KernelUnavailable(f"the native library lacks {name}(): {FIX}") from error
    function.restype = restype
    function.argtypes = argtypes
    return function
