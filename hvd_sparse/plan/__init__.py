"""Plan a job before running it: what each method's step costs at a given N, network and model.

``network``: a collective's seconds on a stated network (alpha-beta, the algorithm per op);
``traffic``: what a step puts into collectives, recorded from the engine or derived from a
method's plan at any N; ``step``: computation, selection and collectives composed on the
method's critical path. Every figure built from these is a projection, and says so.
"""

from .network import Network, parse_rate
from .step import ComputeProfile, SelectionCost, StepTime, step_time
from .traffic import BucketTraffic, RecordingGroup, Transfer, bytes_per_rank, dense_traffic, steady_traffic

__all__ = ["BucketTraffic", "ComputeProfile", "Network", "RecordingGroup", "SelectionCost", "StepTime",
           "Transfer", "bytes_per_rank", "dense_traffic", "parse_rate", "steady_traffic", "step_time"]
