"""Old import path of the framework-free LAGS tools, kept for one release.

Why it exists: earlier releases documented ``hvd_sparse.lags.check_assumption``; code that imports
this path keeps working, with a ``RenamedWarning`` (hvd_sparse/renamed.py). Everything lives in
``hvd_sparse.algorithms.lags``: import from there.
"""

from .algorithms.lags import (
    LAGS,
    PAPER_ALPHA,
    PAPER_BETA,
    AssumptionMonitor,
    adaptive_density,
    backward_times,
    check_assumption,
    compression_errors,
    fit_allgather_model,
    plan_groups,
)
from .renamed import warn_renamed

warn_renamed("hvd_sparse.lags", "hvd_sparse.algorithms.lags", stacklevel=2)

__all__ = ["LAGS", "PAPER_ALPHA", "PAPER_BETA", "AssumptionMonitor", "adaptive_density", "backward_times",
           "check_assumption", "compression_errors", "fit_allgather_model", "plan_groups"]
