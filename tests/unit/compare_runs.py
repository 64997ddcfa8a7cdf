"""Comparisons several test modules make: the engine on the torch and TensorFlow backends against
the NumPy one, and engines resumed from a checkpoint against the engines that wrote it."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from hvd_sparse.backends import Backend, get_backend
from hvd_sparse.comm.local import LocalGroup
from hvd_sparse.engine import Engine


def run_steps(backend: Backend, engines: list[Engine], batches: list) -> list:
    """Every step's outputs, as NumPy, of ``engines`` on ``backend`` over ``batches`` (per step,
    per rank, the NumPy gradient tensors of the bucket "model")."""
    group, outs = LocalGroup(len(engines), backend), []
    for grads in batches:
        step = group.run([e.step("model", [backend.from_numpy(g) for g in grads[r]])
                          for r, e in enumerate(engines)])
        outs.append([[backend.to_numpy(t) for t in rank_out] for rank_out in step])
    return outs


def assert_backend_agrees(name: str, make_engines: Callable[[Backend], list[Engine]],
                          batches: list) -> tuple[list[Engine], list[Engine]]:
    """The engines ``make_engines`` builds give on backend ``name`` the outputs they give on NumPy
    (to fp32 rounding of the average) and exactly the same residuals; returns both engine lists
    (NumPy first) for the caller's further checks."""
    engines = {}
    outs = {}
    for backend_name in ("numpy", name):
        backend = get_backend(backend_name)
        engines[backend_name] = make_engines(backend)
        outs[backend_name] = run_steps(backend, engines[backend_name], batches)
    for a, b in zip(outs["numpy"], outs[name], strict=True):
        for rank_a, rank_b in zip(a, b, strict=True):
            for x, y in zip(rank_a, rank_b, strict=True):
                np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-7)
    residuals = {n: [get_backend(n).to_numpy(e.buckets["model"].residual) for e in engines[n]]
                 for n in ("numpy", name)}
    for x, y in zip(residuals["numpy"], residuals[name], strict=True):
        np.testing.assert_array_equal(x, y)
    return engines["numpy"], engines[name]


def assert_step_identical(group: LocalGroup, original: list[Engine], resumed: list[Engine],
                          grads: list) -> None:
    """One step of both groups of engines on the same gradients gives identical outputs."""
    expected = group.run([e.step("model", grads[r]) for r, e in enumerate(original)])
    got = group.run([e.step("model", grads[r]) for r, e in enumerate(resumed)])
    for a, b in zip(expected, got, strict=True):
        for x, y in zip(a, b, strict=True):
            np.testing.assert_array_equal(x, y)
