"""The engine's checkpoint format, apart from the step: what ``Engine.state_dict`` writes, how a
file is checked before it is loaded, what every process adopts on an elastic reset, and how a
saved bucket comes back -- as itself, joined from the buckets of a former packing, or cut out of
a packed bucket -- at the same or another world size.

A file holds per bucket its shapes, step, residual, momentum correction's velocity, the Adam
path's second moment and the algorithm's control state (``Algorithm.control_state``). Residuals
and velocities are a rank's own; the step and the agreed control state are the same on every rank
(docs/architecture.md#checkpoints). Loading keeps the file's buckets pending (``engine._restored``)
until each bucket first appears.
"""

from __future__ import annotations

import warnings
from typing import Any, Protocol

import numpy as np

from ..algorithms.base import Algorithm, StepContext
from ..backends import Backend
from ..errors import ConfigurationError, RankMismatchError
from . import adam
from .buckets import Bucket


class Engine(Protocol):
    """What of ``core.Engine`` the format reads and restores into (core.py imports this module)."""

    algorithm: Algorithm
    backend: Backend
    rank: int
    size: int
    totals: dict[str, int]
    buckets: dict[str, Bucket]
    _restored_size: int | None

    def _context(self, bucket: Bucket) -> StepContext: ...

    def is_dense(self, sizes: tuple[int, ...]) -> bool:
        """Whether a bucket of these tensor sizes is always averaged densely."""

STATE_FORMAT = 1
FIELDS = ("residual", "momentum", "second_moment", "preconditioner")   # per-entry arrays of a bucket


def state_of(engine: Engine) -> dict:
    """This rank's state: residuals (as NumPy) and the rank-consistent control state."""
    b, algorithm = engine.backend, engine.algorithm

    def host(array: Any) -> np.ndarray | None:
        return None if array is None else b.to_numpy(array).copy()
    return {
        "format": STATE_FORMAT, "algorithm": algorithm.name, "hyperparameters": algorithm.describe(),
        "rank": engine.rank, "size": engine.size, "totals": dict(engine.totals),
        "buckets": {
            key: {"shapes": bk.shapes, "step": bk.step, "members": bk.members,
                  "residual": host(bk.residual), "momentum": host(bk.momentum),
                  "second_moment": host(bk.second_moment),
                  "control": None if bk.control is None else algorithm.control_state(bk.control)}
            for key, bk in engine.buckets.items()
        },
    }


def check_loadable(state: dict, engine: Engine) -> None:
    """Refuse a file of another format or method, or another rank's file at the same world size;
    warn at another world size (any rank's file will do there: residuals are dropped, and the
    step counter and control state are the same in every rank's file)."""
    name = engine.algorithm.name
    if state.get("format") != STATE_FORMAT:
        raise ConfigurationError(f"unknown checkpoint format {state.get('format')!r}")
    if state["algorithm"] != name:
        raise ConfigurationError(f"checkpoint is from {state['algorithm']!r}, this compressor runs "
                                 f"{name!r}: load it into the same method")
    if state["size"] != engine.size:
        warnings.warn(
            f"hvd_sparse: checkpoint taken at world size {state['size']}, resuming at {engine.size}:"
            " residuals are reset and rank-dependent control state is rebuilt", stacklevel=3)
    elif state["rank"] != engine.rank:
        raise RankMismatchError(
            f"checkpoint of rank {state['rank']} loaded on rank {engine.rank}: residuals are per "
            "rank; save and load one file per rank (e.g. suffix the path with hvd.rank())")


def agreed_part(engine: Engine, state: dict) -> dict:
    """The rank-independent part of ``state``: no residuals, each bucket's step and
    ``Algorithm.agreed_control``. What every process adopts from one rank on an elastic reset."""
    algorithm = engine.algorithm
    return {**{k: v for k, v in state.items() if k not in ("buckets", "rank", "totals")},
            "buckets": {key: {"shapes": saved["shapes"], "step": saved["step"],
                              "members": saved.get("members", ()),
                              "second_moment": saved.get("second_moment"),
                              "preconditioner": saved.get("preconditioner"),   # older files
                              "agreed_momentum": saved.get("momentum") if global_momentum(engine, saved)
                              else None,
                              "control": None if saved["control"] is None
                              else algorithm.agreed_control(saved["control"])}
                        for key, saved in state["buckets"].items()}}


def global_momentum(engine: Engine, saved: dict) -> bool:
    """Whether a saved bucket's velocity is the same on every rank: the Adam path's m up to its
    first sparse step (the dense steps take it from the average), and always in a bucket of
    ``dense_below`` tensors."""
    corrections = engine.algorithm.corrections
    if corrections.adam is None:
        return False
    sizes = tuple(int(np.prod(shape, dtype=np.int64)) for shape in saved["shapes"])
    return saved["step"] <= corrections.dense_steps or engine.is_dense(sizes)


def adopted(agreed: dict, residuals: dict[str, np.ndarray], momenta: dict[str, np.ndarray | None]) -> dict:
    """The pending buckets of an adoption: the agreed state with this process's own residuals and
    velocities (the agreed velocity where every rank has the same one)."""
    return {key: {**saved, "residual": residuals.get(key), "own_residual": True,
                  "momentum": momenta.get(key) if saved.get("agreed_momentum") is None
                  else saved["agreed_momentum"]}
            for key, saved in agreed["buckets"].items()}


def take_saved(pending: dict[str, dict], bucket: Bucket) -> dict | None:
    """A new bucket's saved state, taken out of ``pending``: its own, or -- across a change of
    packing (``Engine.step``'s ``members``) -- its members' states joined, or its part of a packed
    bucket's."""
    if bucket.key in pending:
        return pending.pop(bucket.key)
    if bucket.members and all(m in pending for m in bucket.members):
        return joined([pending.pop(m) for m in bucket.members])
    for key, saved in pending.items():
        if bucket.key in saved.get("members", ()):
            taken = {*saved.get("taken", ()), bucket.key}
            if len(taken) == len(saved["members"]):
                del pending[key]   # every part taken
            else:
                pending[key] = {**saved, "taken": taken}
            return part_of(saved, saved["members"].index(bucket.key))
    return None


def restore(engine: Engine, bucket: Bucket, saved: dict, like: Any) -> None:
    """Put a saved state into ``bucket``: its step, and at the same world size (or this process's
    own, after an adoption) its residual and velocity; the Adam path's moments; the control state
    through ``Algorithm.load_control``, which rebuilds what depends on the world size."""
    if tuple(map(tuple, saved["shapes"])) != bucket.shapes:
        raise ConfigurationError(f"checkpoint bucket {bucket.key!r} has shapes {saved['shapes']}, the "
                                 f"model has {bucket.shapes}")
    b = engine.backend
    bucket.step = int(saved["step"])
    if engine._restored_size == engine.size or saved.get("own_residual"):   # per process
        dtype = b.dtype_name(bucket.residual)
        if saved["residual"] is not None:
            bucket.residual = b.from_numpy(saved["residual"].astype(dtype), like=like)
        # Checkpoints taken before the engine kept DGC's velocity hold it in DGC's control.
        momentum = saved.get("momentum", (saved["control"] or {}).get("momentum")
                             if isinstance(saved["control"], dict) else None)
        if momentum is not None:
            bucket.momentum = b.from_numpy(np.asarray(momentum).astype(dtype), like=like)
    if saved.get("second_moment") is not None or saved.get("preconditioner") is not None:
        _restore_adam(engine, bucket, saved, like)
    if saved["control"] is None:   # saved during the dense steps, or a dense bucket
        return
    ctx = engine._context(bucket)
    with warnings.catch_warnings():
        if saved.get("own_residual"):   # an elastic reset: "rebuilt for N ranks" is expected
            warnings.simplefilter("ignore")
        bucket.control = engine.algorithm.load_control(saved["control"], ctx, engine._restored_size)


def _restore_adam(engine: Engine, bucket: Bucket, saved: dict, like: Any) -> None:
    """The Adam path's moments at any world size: a rank's own m and v (the same on every rank
    during the dense steps) are a sound start for any process, as the ranks' moments differ
    only by their gradients' noise. Files of the frozen path hold v's preconditioner instead."""
    b, dtype = engine.backend, engine.backend.dtype_name(bucket.residual)
    corrections = engine.algorithm.corrections
    second = adam.saved_second_moment(saved, corrections.adam, corrections.dense_steps)
    for field, value in (("second_moment", second), ("momentum", saved.get("momentum"))):
        if value is not None:
            setattr(bucket, field, b.from_numpy(np.asarray(value).astype(dtype), like=like))


def joined(parts: list[dict]) -> dict:
    """Saved states of buckets of one tensor each as the state of one bucket packing them: the
    residuals and velocities end to end (zeros where a part has none), the step of the first (every
    rank steps every bucket together), no control state (the packed bucket starts its own)."""
    sizes = [int(np.prod(part["shapes"][0], dtype=np.int64)) for part in parts]

    def end_to_end(field: str) -> np.ndarray | None:
        arrays = [part.get(field) for part in parts]
        if all(a is None for a in arrays):
            return None
        return np.concatenate([np.zeros(n, np.float64) if a is None else np.asarray(a).reshape(-1)
                               for a, n in zip(arrays, sizes, strict=True)])
    return {"shapes": [tuple(part["shapes"][0]) for part in parts], "step": parts[0]["step"],
            **{field: end_to_end(field) for field in FIELDS}, "control": None,
            "own_residual": parts[0].get("own_residual", False)}


def part_of(saved: dict, position: int) -> dict:
    """The saved state of the ``position``-th tensor of a packed bucket as a bucket of its own
    (no control state: it starts its own)."""
    sizes = [int(np.prod(shape, dtype=np.int64)) for shape in saved["shapes"]]
    lo = sum(sizes[:position])

    def part(field: str) -> np.ndarray | None:
        array = saved.get(field)
        return None if array is None else np.asarray(array).reshape(-1)[lo:lo + sizes[position]].copy()
    return {"shapes": [tuple(saved["shapes"][position])], "step": saved["step"],
            **{field: part(field) for field in FIELDS}, "control": None,
            "own_residual": saved.get("own_residual", False)}
