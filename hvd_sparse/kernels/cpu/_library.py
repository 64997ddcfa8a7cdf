"""The native CPU library: every ``*.cpp`` here built into one shared object, loaded with ctypes.

setup.py builds it (plain C ABI, no Python or torch headers) as ``_native<EXT_SUFFIX>`` next to
this file, and on x86-64 a second time for the x86-64-v3 level (AVX2) as ``_native_v3``; an
editable install (``make install``) builds them in place. ``library()`` loads one of them once --
the v3 build where the CPU has that level, unless ``HVD_SPARSE_CPU_LEVEL=baseline`` -- and raises
``KernelUnavailable`` naming the cause when the library is missing, out of date or unloadable.
Both builds compute the same IEEE operations in the same order: the same results.
"""

from __future__ import annotations

import ctypes
import importlib.machinery
import os
from pathlib import Path
from typing import Any

from ...errors import ConfigurationError
from .. import KernelUnavailable

HERE = Path(__file__).resolve().parent
STEM = "_native"
STEM_V3 = "_native_v3"
LEVELS = ("auto", "baseline")
LEVEL_ENVIRONMENT = "HVD_SPARSE_CPU_LEVEL"
FIX = "rebuild it with `make install` (or `pip install -e .` in the repository)"

_library: ctypes.CDLL | None = None
_level = "baseline"   # the build loaded: "baseline" or "x86-64-v3"


def library_path(stem: str = STEM) -> Path | None:
    """The built library ``stem`` next to this file, or None."""
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = HERE / f"{stem}{suffix}"
        if path.exists():
            return path
    return None


def _open(path: Path) -> ctypes.CDLL:
    # In a source tree, a library older than a source would compute what the sources no longer
    # say: refuse it rather than run stale code.
    built = path.stat().st_mtime
    stale = [p.name for p in sorted(HERE.glob("*.cpp")) + sorted(HERE.glob("*.h"))
             if p.stat().st_mtime > built]
    if stale:
        raise KernelUnavailable(f"the native library {path.name} is older than {', '.join(stale)}: {FIX}")
    try:
        return ctypes.CDLL(str(path))
    except OSError as error:
        raise KernelUnavailable(f"cannot load {path}: {error}") from error


def _wanted_level() -> str:
    value = os.environ.get(LEVEL_ENVIRONMENT, "auto").strip().lower() or "auto"
    if value not in LEVELS:
        raise ConfigurationError(f"{LEVEL_ENVIRONMENT} must be one of {LEVELS}, got {value!r}")
    return value


def library() -> ctypes.CDLL:
    """The loaded native library (loaded on first call)."""
    global _library, _level
    if _library is None:
        path = library_path()
        if path is None:
            raise KernelUnavailable(f"the native library {HERE / STEM}*.so was not built: {FIX}")
        baseline = _open(path)
        if _wanted_level() == "auto" and baseline.hvd_sparse_x86_64_level() >= 3:
            faster = library_path(STEM_V3)
            if faster is None:
                raise KernelUnavailable(f"the native library {HERE / STEM_V3}*.so (x86-64-v3) was not "
                                        f"built: {FIX}, or set {LEVEL_ENVIRONMENT}=baseline")
            _library, _level = _open(faster), "x86-64-v3"
        else:
            _library, _level = baseline, "baseline"
    return _library


def level() -> str:
    """The build in use: "x86-64-v3" (AVX2) or "baseline" (loads the library)."""
    library()
    return _level


def value_index_types() -> list[tuple]:
    """(value dtype, its C suffix, index dtype, its C suffix) of every value/index pair the
    library's index-taking functions are instantiated for (``hvd_sparse_<op>_f32_i32`` ...)."""
    import torch  # here, not at import: _library is loaded by the ops that need torch anyway

    return [(value, v, index, i)
            for value, v in ((torch.float32, "f32"), (torch.float64, "f64"))
            for index, i in ((torch.int32, "i32"), (torch.int64, "i64"))]


def bind(name: str, restype: Any, argtypes: list) -> Any:
    """The library's function ``name`` with its C signature declared."""
    try:
        function = getattr(library(), name)
    except AttributeError as error:
        raise KernelUnavailable(f"the native library lacks {name}(): {FIX}") from error
    function.restype = restype
    function.argtypes = argtypes
    return function
