"""Sparsification methods, one module each, written once for every framework."""

from .base import GATHER, MODEL, SHARED, TENSOR, UNION, Algorithm, StepContext, StepOutcome
from .corrections import AdamPath
from .deft import DEFT
from .dgc import DGC
from .exdyna import ExDyna
from .gaussiank import GaussianK
from .lags import LAGS
from .micro import MiCRO
from .randomk import RandomK
from .threshold import Threshold
from .topk import TopK

# Every method, in the order the documentation lists them.
METHODS = (ExDyna, MiCRO, DEFT, LAGS, TopK, RandomK, Threshold, GaussianK, DGC)

__all__ = [
           "DEFT",
           "DGC",
           "GATHER",
           "LAGS",
           "METHODS",
           "MODEL",
           "SHARED",
           "TENSOR",
           "UNION",
           "AdamPath",
           "Algorithm",
           "ExDyna",
           "GaussianK",
           "MiCRO",
           "RandomK",
           "StepContext",
           "StepOutcome",
           "Threshold",
           "TopK",
]
