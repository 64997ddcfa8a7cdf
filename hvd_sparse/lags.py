"""LAGS-SGD tools that need no framework: the assumption check (docs/algorithms.md#assumption-check) and the
grouping and density rules (the method itself is ``hvd_sparse.torch.LAGS`` /
``hvd_sparse.tensorflow.LAGS``; its code lives in ``hvd_sparse/algorithms/lags.py``)."""

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

__all__ = ["LAGS", "PAPER_ALPHA", "PAPER_BETA", "AssumptionMonitor", "adaptive_density", "backward_times",
           "check_assumption", "compression_errors", "fit_allgather_model", "plan_groups"]
