"""Kernels: fused replacements for short runs of backend operations (hvd_sparse.kernels).

A kernel gives exactly the result of the reference path (the backend's own framework ops) in
fewer passes over memory. The torch backend asks ``ops_for(tensor)`` for the op module of the
tensor's device; every op module has every op of ``KernelOps`` (hvd_sparse/backends/contract.py),
each returning the named result of the backend op it replaces, or None where it has no kernel.

* ``HVD_SPARSE_KERNELS=auto`` (default) or ``off`` in the environment, or
  ``hvd_sparse.set_kernels("auto" | "off")`` at run time, selects the kernels or the reference
  path. Both make the same decisions; ``off`` exists to compare and to rule kernels out.
* An op module that cannot load (a native library that was not built, a missing Triton) makes
  ``ops_for`` return None: the reference path runs, after one RuntimeWarning per cause naming it.
* An op returns None when it does not handle its arguments (a dtype or layout it has no kernel
  for): the caller then runs the reference ops. That is not a failure and warns nothing.

Op modules: ``hvd_sparse.kernels.cpu`` (C++ through ctypes, CPU tensors) and
``hvd_sparse.kernels.triton`` (CUDA tensors); for the TensorFlow backend, ``tensorflow_ops()``
(custom TensorFlow ops over the CPU kernels' sources). See docs/kernels.md.
"""

from __future__ import annotations

import importlib
import os
import warnings
from types import ModuleType
from typing import Any, cast

from ..backends.contract import KernelOps
from ..errors import ConfigurationError

MODES = ("auto", "off")
ENVIRONMENT = "HVD_SPARSE_KERNELS"
# Device type -> op module (a submodule of this package).
MODULES = {"cpu": "cpu", "cuda": "triton"}

class KernelUnavailable(RuntimeError):  # noqa: N818  (it names a state, not a programming error)
    """An op module cannot be used here; the message names the cause and the fix."""


_loaded: dict[str, ModuleType | None] = {}   # module name -> module, or None when it failed
_warned: set[str] = set()                    # causes already warned about


def _checked(value: str, source: str) -> str:
    if value not in MODES:
        raise ConfigurationError(f"{source} must be one of {MODES}, got {value!r}")
    return value


_mode = _checked(os.environ.get(ENVIRONMENT, "auto").strip().lower() or "auto", ENVIRONMENT)


def mode() -> str:
    """'auto' (kernels wherever one exists) or 'off' (the reference path everywhere)."""
    return _mode


def set_mode(value: str) -> None:
    """Select kernels ('auto') or the reference path ('off') for every later operation."""
    global _mode
    _mode = _checked(value, "the kernel mode")


def ops_for(tensor: Any) -> KernelOps | None:
    """The op module for ``tensor``'s device, or None: kernels off, no module for the device, or
    a module that cannot load (warned once per cause)."""
    if _mode == "off":
        return None
    device = getattr(getattr(tensor, "device", None), "type", None)
    name = MODULES.get(device) if isinstance(device, str) else None
    if name is None:
        return None
    if name not in _loaded:
        _loaded[name] = _load(name)
    return cast(KernelOps | None, _loaded[name])   # an op module has every op of KernelOps


def tensorflow_ops() -> ModuleType | None:
    """The TensorFlow op module (hvd_sparse/kernels/tf_ops.py: custom ops built against the installed
    TensorFlow from the CPU kernels' sources), or None: kernels off, or a library that cannot load
    (warned once per cause). The TensorFlow backend asks it for the ops it has."""
    if _mode == "off":
        return None
    if "tf_ops" not in _loaded:
        _loaded["tf_ops"] = _load("tf_ops")
    return _loaded["tf_ops"]


def _load(name: str) -> ModuleType | None:
    try:
        return importlib.import_module(f"{__name__}.{name}")
    except KernelUnavailable as error:
        cause = str(error)
    except (ImportError, OSError) as error:
        cause = f"{type(error).__name__}: {error}"
    if cause not in _warned:
        _warned.add(cause)
        warnings.warn(f"hvd_sparse: the {name} kernels cannot be used ({cause}); the reference path "
                      f"runs instead (same results, slower). {ENVIRONMENT}=off silences this.",
                      RuntimeWarning, stacklevel=3)
    return None


def _forget() -> None:
    """Load the op modules afresh on next use (for tests that simulate a failing module)."""
    _loaded.clear()
    _warned.clear()
