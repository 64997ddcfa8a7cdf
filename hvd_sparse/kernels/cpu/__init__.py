"""CPU kernels (C++ through ctypes, one thread): the op module ``ops_for`` returns for CPU tensors.

Importing it loads the native library; when that fails it raises ``KernelUnavailable`` and the
loader (hvd_sparse.kernels) falls back to the reference path with a warning. Each op returns
None for arguments it has no kernel for (the caller then runs the reference ops).
"""

from ._library import library

library()   # fail here, at import, when the library cannot be used

from .accumulate import (  # noqa: E402
    abs_at_least,
    accumulate,
    accumulate_moments,
    accumulate_norms,
    accumulate_segment_moments,
    accumulate_select,
    accumulate_select_if_finite,
    adam_accumulate,
    adam_accumulate_select,
    all_finite,
    clear,
    momentum_accumulate_select,
    select_at_least,
)
from .adam import adam_update  # noqa: E402
from .indexing import put_at, zero_at  # noqa: E402
from .momentum import momentum_accumulate  # noqa: E402
from .norms import mean_std, segment_norms  # noqa: E402
from .sampled import sampled_threshold_select  # noqa: E402
from .topk import topk_abs  # noqa: E402

__all__ = [
    "abs_at_least",
    "accumulate",
    "accumulate_moments",
    "accumulate_norms",
    "accumulate_segment_moments",
    "accumulate_select",
    "accumulate_select_if_finite",
    "adam_accumulate",
    "adam_accumulate_select",
    "adam_update",
    "all_finite",
    "clear",
    "mean_std",
    "momentum_accumulate",
    "momentum_accumulate_select",
    "put_at",
    "sampled_threshold_select",
    "segment_norms",
    "select_at_least",
    "topk_abs",
    "zero_at",
]
