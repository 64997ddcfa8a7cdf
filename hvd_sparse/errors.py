"""Errors a user can cause, each naming its fix."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any


class HvdSparseError(Exception):
    """Base class of every error hvd_sparse raises on purpose."""


class ConfigurationError(HvdSparseError, ValueError):
    """A hyper-parameter or a combination of options that cannot work."""


class UnsupportedTensorError(HvdSparseError, TypeError):
    """A gradient this compressor cannot handle (dtype, layout)."""


class RankMismatchError(HvdSparseError, RuntimeError):
    """Ranks disagree on something they must agree on (model layout, world size, collectives)."""


def renamed_options(**new_names: str) -> Callable:
    """Decorate an ``__init__`` so that each old keyword (the key) of an option that was renamed
    (to the value) is refused with a ``ConfigurationError`` naming the new one, instead of
    Python's bare "unexpected keyword argument". The signature ``help()`` shows is unchanged."""
    def decorate(init: Callable) -> Callable:
        @functools.wraps(init)
        def wrapper(self: Any, *args: Any, **kwargs: Any) -> None:
            old = [name for name in new_names if name in kwargs]
            if old:
                renames = ", ".join(f"{name}= is now {new_names[name]}=" for name in old)
                raise ConfigurationError(f"{type(self).__name__}: {renames}")
            init(self, *args, **kwargs)
        wrapper.renamed = dict(new_names)   # type: ignore[attr-defined]  # the face modules repeat it
        return wrapper
    return decorate
