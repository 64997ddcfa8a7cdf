"""Sparsification methods, one module each, written once for every framework."""

from .base import GATHER, MODEL, SHARED, TENSOR, UNION, Algorithm, StepContext, StepOutcome
from .dgc import DGC
from .gaussiank import GaussianK
from .randomk import RandomK
from .threshold import Threshold
from .topk import TopK

__all__ = ["DGC", "GATHER", "MODEL", "SHARED", "TENSOR", "UNION", "Algorithm", "GaussianK", "RandomK",
           "StepContext", "StepOutcome", "Threshold", "TopK"]
