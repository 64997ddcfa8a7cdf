"""Sparsification methods, one module each, written once for every framework."""

from .base import GATHER, MODEL, SHARED, TENSOR, UNION, Algorithm, StepContext, StepOutcome
from .deft import DEFT
from .exdyna import ExDyna
from .lags import LAGS
from .micro import MiCRO
from .topk import TopK

__all__ = ["DEFT", "GATHER", "LAGS", "MODEL", "SHARED", "TENSOR", "UNION", "Algorithm", "ExDyna",
           "MiCRO", "StepContext", "StepOutcome", "TopK"]
