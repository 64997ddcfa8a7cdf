"""Elastic Horovod: what a compressor does when Horovod's elastic ``State`` commits, rolls back
and resets (framework-free; the faces wire it into their State objects).

A compressor holds two kinds of state (docs/usage.md#elastic-horovod):

* per process: the residual of every bucket, this process's gradient not sent yet (and the
  momentum correction's velocity, likewise). It stays valid
  at any world size and rank, so a surviving process keeps it through a reset; a process that
  leaves takes its residual with it (that mass is lost: its norm at the last commit is reported as
  ``departed_residual_norm``).
* rank-consistent: step counters, thresholds, partitions, DEFT's unit table, LAGS's densities.
  After a reset every process adopts rank 0's (``Engine.adopt``): world-size and rank dependent
  parts are rebuilt there for the new world, per-rank parts of it restart
  (``Algorithm.agreed_control``: ExDyna's neighbour layout, DGC's momentum).

The calls, as Horovod 0.28.1's ``hvd.elastic.run`` makes them (``horovod/common/elastic.py``):

* ``save`` (``state.commit()``, on every rank at the same point): one small allreduce tells every
  rank every rank's residual norm, then this process's engine state is copied to host memory.
  The collective comes first, so a failure inside it leaves the previous commit in place for the
  model and the compressor alike.
* ``restore`` (after ``HorovodInternalError``, before Horovod re-initializes): the engine and any
  step in flight are dropped; the next ``sync`` continues from the last commit, matching the model
  Horovod rolled back to. Gradient mass sent after the commit is undone with the model and is still
  in the committed residual: nothing is applied twice, nothing lost.
* ``sync`` (after every reset and at the start, on every rank, newcomers included): rank 0's
  rank-independent state is broadcast and adopted at the new rank and world size; one allreduce
  names the ranks that left since the last commit. In a running job the face checks its
  configuration here too (``FaceBase._agree_at_sync``), where newcomers and survivors meet.
* ``reset`` (a reset that Horovod does not follow with ``sync``: only hosts removed): every process
  is a survivor of the same commit, so each adopts its own rank-independent state at the new rank
  and size, without a message; departed ranks are accounted at the next commit.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

import numpy as np

from .engine.core import Engine


def residual_norm(engine: Engine | None) -> float:
    """This process's residual norm over every bucket (0 before any step)."""
    if engine is None:
        return 0.0
    b = engine.backend
    return math.sqrt(sum(b.sum_of_squares(bk.residual) for bk in engine.buckets.values()))


class ElasticCompressor:
    """The compressor's side of a Horovod elastic ``State`` (module docstring). ``face`` is a
    ``hvd_sparse.faces.FaceBase``."""

    def __init__(self, face: Any):
        self.face = face
        engine = face._engine
        self._committed: dict | None = None if engine is None else self._snapshot(engine)
        self._committed_rank: int | None = None if engine is None else engine.rank
        self._committed_norms: list[float] | None = None   # every rank's, at the last commit
        self._resume: dict | None = None     # state to continue from after restore()
        self._unaccounted = False            # a reset whose departed ranks are not known yet
        self.resets = 0                      # elastic resets of the job so far (rank 0's count)
        self._counted = False                # reset() counted the current one already
        self.departed_ranks: list[int] = []  # ranks (at the last commit) that left at the last reset
        self.departed_residual_norm: float | None = 0.0   # their residuals' norm; None: unknown
        face._elastic = self

    # --- Horovod's State calls ------------------------------------------------------------------
    def save(self) -> None:
        """Commit: a host copy of this rank's residuals and control state, and (one allreduce) the ranks'
        residual norms."""
        self.face._follow_world()   # a reset without sync that no step has seen yet
        engine = self.face._ensure_engine()
        size, previous = engine.size, self._committed_rank
        payload = np.zeros(2 * size, dtype=np.float64)
        payload[engine.rank] = residual_norm(engine)
        payload[size + engine.rank] = -1.0 if previous is None else previous + 1.0
        summed = self.face._sum_over_ranks(payload, f"{self.face.prefix}.elastic.commit")
        if self._unaccounted:   # a reset without sync: every process survived the last commit
            self._account([int(x) - 1 for x in summed[size:]], self._committed_norms)
        self._committed_norms = [float(x) for x in summed[:size]]
        self._committed_rank = engine.rank
        self._committed = self._snapshot(engine)
        self._resume = None
        self._counted = False

    def restore(self) -> None:
        """Roll back to the last commit (applied when the engine is next built)."""
        self._resume = self._committed
        self.face._drop_engine()

    def sync(self, broadcast_object: Callable[..., Any]) -> None:
        """After a reset: rebuild for the new rank and world size from rank 0's rank-independent state."""
        own = self._own_state()
        self.face._drop_engine()
        engine = self.face._ensure_engine()
        mine = None if own is None else {
            "agreed": engine.agreed_state(own), "norms": self._committed_norms,
            "resets": self.resets + (0 if self._counted else 1)}
        # Rank 0's (None at the start of a job). Named: Horovod would name it after the type,
        # which differs where a newcomer has nothing.
        shared = broadcast_object(mine, name=f"{self.face.prefix}.elastic.sync")
        self._resume, self._counted = None, False
        if shared is None:
            return
        self.face._agree_at_sync()
        engine.adopt(shared["agreed"], *_own_vectors(own))
        self.resets = shared["resets"]
        norms = shared["norms"]
        if norms is not None:   # which ranks of the last commit are still here: one allreduce
            mask = np.zeros(len(norms), dtype=np.float64)
            if own is not None and self._committed_rank is not None and self._committed_rank < len(norms):
                mask[self._committed_rank] = 1.0
            present = self.face._sum_over_ranks(mask, f"{self.face.prefix}.elastic.survivors")
            self._account([r for r in range(len(norms)) if present[r] > 0], norms)

    def reset(self) -> None:
        """Adopt this process's own state at Horovod's new rank and size (no message)."""
        own = self._own_state()
        self.face._drop_engine()
        engine = self.face._ensure_engine()
        if own is not None:
            engine.adopt(engine.agreed_state(own), *_own_vectors(own))
        self._resume = None
        self._unaccounted = True
        self.resets += 1
        self._counted = True

    # --- statistics -----------------------------------------------------------------------------
    def stats(self) -> dict:
        """Resets, departed ranks and their residual norm at the last commit."""
        return {"elastic_resets": self.resets, "departed_ranks": list(self.departed_ranks),
                "departed_residual_norm": self.departed_residual_norm}

    # --- internals ------------------------------------------------------------------------------
    def _own_state(self) -> dict | None:
        engine = self.face._engine
        if engine is not None:
            return engine.state_dict()
        return self._resume

    def _account(self, survivors: list[int], norms: list[float] | None) -> None:
        """Record the ranks of the last commit that are gone, and their residuals' norm."""
        self._unaccounted = False
        if norms is None:
            self.departed_ranks, self.departed_residual_norm = [], None
            return
        alive = set(survivors)
        self.departed_ranks = [r for r in range(len(norms)) if r not in alive]
        self.departed_residual_norm = math.sqrt(sum(norms[r] ** 2 for r in self.departed_ranks))

    @staticmethod
    def _snapshot(engine: Engine) -> dict:
        state = engine.state_dict()   # residuals are host copies already
        for saved in state["buckets"].values():
            saved["control"] = copy.deepcopy(saved["control"])
        return state


def _own_vectors(state: dict | None) -> tuple[dict | None, dict | None]:
    """This process's residuals and momentum-correction velocities, by bucket (None, None for a
    process without state): what it keeps at any world size."""
    if state is None:
        return None, None
    buckets = state["buckets"].items()
    return ({key: saved["residual"] for key, saved in buckets},
            {key: saved.get("momentum") for key, saved in buckets})
