"""Sparsification methods, one module each, written once for every framework."""

from .base import GATHER, MODEL, SHARED, TENSOR, UNION, Algorithm, StepContext, StepOutcome
from .lags import LAGS
from .topk import TopK

__all__ = ["GATHER", "LAGS", "MODEL", "SHARED", "TENSOR", "UNION", "Algorithm", "StepContext", "StepOutcome",
           "TopK"]
