"""One training step as Horovod's calls to the PyTorch face show it, from its first ``compress``
to its last ``decompress``, and what the face reports of it: where the time went
(``step_times``) and when its landmarks happened (``step_marks``). The gradients themselves are
the step assembly's (engine/assembly.py)."""

from __future__ import annotations

from dataclasses import dataclass

from ..comm.horovod_torch import AsyncProtocols


@dataclass
class HorovodStep:
    """One training step as Horovod's calls show it, from its first ``compress`` to its last
    ``decompress`` (the gradients themselves are the assembly's); the last step's stays until the
    next begins (``communication_timeline`` reads it between steps)."""

    measuring: bool = False            # hooks wait for the device (LAGS's profiling steps, GPU)
    flushed: bool = False              # the first decompress has finished every bucket
    outstanding: int = 0               # compress calls not yet matched by a decompress
    failed: FloatingPointError | None = None   # raised at the step's last decompress
    ordinal: int = 0                   # gradients named by their order so far (no named_parameters)
    hook_seconds: float = 0.0          # time inside compress (Horovod's gradient hooks)
    decompress_seconds: float = 0.0    # time inside decompress (finishing the step, end_step)
    end_step_seconds: float = 0.0      # the once-per-step protocol (Engine.end_step)
    backward_end: float = 0.0          # perf_counter() when the last compress returned
    decompress_began: float = 0.0      # perf_counter() when the first decompress was entered
    decompress_ended: float = 0.0      # ... when the last one so far returned

    def times(self, protocols: AsyncProtocols) -> dict:
        """The face's part of ``step_times``. ``hook_seconds``: inside ``compress`` (Horovod's
        gradient hooks: filing gradients, and the engine's work on buckets complete during the
        backward pass); ``decompress_seconds``: inside ``decompress`` (driving every bucket to
        completion, ``end_step``); ``end_step_seconds``: the once-per-step protocol;
        ``comm_wait_seconds``: blocked on collectives in ``decompress``;
        ``comm_inflight_seconds``: wall time with at least one collective in flight, of which
        ``comm_hidden_seconds`` before the last gradient hook returned (hidden by the backward
        pass) and ``comm_exposed_seconds`` after it."""
        inflight = protocols.inflight_seconds()
        hidden = protocols.inflight_seconds(until=self.backward_end) if self.backward_end else 0.0
        return {"hook_seconds": self.hook_seconds, "decompress_seconds": self.decompress_seconds,
                "end_step_seconds": self.end_step_seconds,
                "comm_wait_seconds": protocols.wait_seconds, "comm_inflight_seconds": inflight,
                "comm_hidden_seconds": hidden, "comm_exposed_seconds": inflight - hidden}

    def marks(self, began: float) -> dict:
        """The landmarks of ``step_marks``, as perf_counter() values; ``began``: the step's first
        gradient (the assembly's)."""
        return {"began": began, "backward_end": self.backward_end,
                "decompress_began": self.decompress_began, "decompress_ended": self.decompress_ended}
