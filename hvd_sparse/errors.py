"""Errors a user can cause, each naming its fix."""


class HvdSparseError(Exception):
    """Base class of every error hvd_sparse raises on purpose."""


class ConfigurationError(HvdSparseError, ValueError):
    """A hyper-parameter or a combination of options that cannot work."""


class UnsupportedTensorError(HvdSparseError, TypeError):
    """A gradient this compressor cannot handle (dtype, layout)."""


class RankMismatchError(HvdSparseError, RuntimeError):
    """Ranks disagree on something they must agree on (model layout, world size, collectives)."""
