"""Old spellings of renamed options, functions and modules, kept working for one release.

Each use of an old spelling warns with ``RenamedWarning``, a ``FutureWarning``: Python shows
those by default, where a ``DeprecationWarning`` raised inside a library is hidden. The renames
are listed in README.md ("Renamed options"). When the old spellings go, this module goes with
them.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

from .errors import ConfigurationError


class RenamedWarning(FutureWarning):
    """An option, function or module of hvd_sparse was used under its old name."""


def warn_renamed(old: str, new: str, stacklevel: int = 3) -> None:
    """Warn that ``old`` is now spelled ``new`` (``stacklevel`` 3: the caller's caller)."""
    warnings.warn(f"hvd_sparse: {old} was renamed to {new}; the old name will be removed in the "
                  "next release", RenamedWarning, stacklevel=stacklevel)


def renamed_options(**new_names: str) -> Callable:
    """Decorate an ``__init__`` so that each old keyword (the key) still works as the new one (the
    value), with a ``RenamedWarning``. The signature ``help()`` and ``inspect`` show is the new
    one; giving both spellings of one option is an error."""
    def decorate(init: Callable) -> Callable:
        @functools.wraps(init)
        def wrapper(self: Any, *args: Any, **kwargs: Any) -> None:
            for old, new in new_names.items():
                if old not in kwargs:
                    continue
                if new in kwargs:
                    raise ConfigurationError(f"{type(self).__name__}: pass {new}= only ({old}= is its "
                                             "old name)")
                warn_renamed(f"{type(self).__name__}({old}=...)", f"{new}=")
                kwargs[new] = kwargs.pop(old)
            init(self, *args, **kwargs)
        return wrapper
    return decorate
