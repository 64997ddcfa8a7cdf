"""Communication: the protocol vocabulary and the drivers that execute it."""

from .protocol import (
    ALLGATHER,
    ALLREDUCE,
    BROADCAST,
    NEIGHBOURS,
    Collective,
    Phase,
    Protocol,
    finished,
    run_blocking,
    run_together,
    timed,
)

__all__ = ["ALLGATHER", "ALLREDUCE", "BROADCAST", "NEIGHBOURS", "Collective", "Phase", "Protocol",
           "finished", "run_blocking", "run_together", "timed"]
