"""N simulated ranks (comm/local.py) on the NumPy backend, for the tests of the baseline methods:
one bucket step on every rank, what each rank sent, and the step against tests/reference/engine.py."""

from __future__ import annotations

import numpy as np

from hvd_sparse.backends import get_backend
from hvd_sparse.engine import Engine
from tests.reference.engine import expected_step

NP = get_backend("numpy")
SHAPES = [(20, 15), (15,), (6, 5, 4)]


def make_engines(algorithm, size, **options):
    return [Engine(algorithm, NP, rank, size, **options) for rank in range(size)]


def residual_of(engine, key, numel):
    bucket = engine.buckets.get(key)
    return np.zeros(numel, np.float32) if bucket is None else bucket.residual.copy()


def heavy_tailed(rng, shape, dtype=np.float32):
    return (rng.standard_t(3, shape) * rng.uniform(0.05, 2.0)).astype(dtype)


def flat(tensors):
    return np.concatenate([np.asarray(t, np.float32).ravel() for t in tensors])


def run_step(engines, group, key, grads):
    """One step of bucket ``key`` on every rank: (accumulated vectors, flat outputs, new residuals)."""
    numel = sum(int(np.prod(np.shape(t))) for t in grads[0])
    accs = [residual_of(e, key, numel) + flat(grads[r]) for r, e in enumerate(engines)]
    outputs = group.run([e.step(key, grads[r]) for r, e in enumerate(engines)])
    return accs, [flat(o) for o in outputs], [e.buckets[key].residual.copy() for e in engines]


def sent_where(residual, acc):
    """What a rank sent, read off its new residual: the entries it cleared."""
    return np.flatnonzero((residual == 0) & (acc != 0))


def assert_step(accs, outputs, residuals, selections, pattern):
    average, expected_residuals, union = expected_step(accs, selections, pattern)
    for rank, out in enumerate(outputs):
        np.testing.assert_allclose(out, average, rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(residuals[rank], expected_residuals[rank])
    return union
