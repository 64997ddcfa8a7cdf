"""``python -m hvd_sparse.info``: what an install has, and a self-test of every method that fails
when a method stops conserving the gradient."""

from __future__ import annotations

import subprocess
import sys

import numpy as np

from hvd_sparse import info
from hvd_sparse.registry import METHODS
from tests.multiproc.launch import REPO


def test_the_self_test_passes_every_method_on_numpy():
    results = info.self_test("numpy")
    assert set(results) == set(METHODS)
    assert all(verdict == "ok" for verdict in results.values()), results


def test_the_self_test_catches_a_method_that_loses_gradient(monkeypatch):
    """A residual that forgets part of what was not sent must fail the check."""
    original = info._check_bucket

    def lossy(engines, bucket, backend, grads, old, outputs):
        engines[0].buckets[bucket].residual[np.nonzero(engines[0].buckets[bucket].residual)[0][:1]] *= 0.5
        original(engines, bucket, backend, grads, old, outputs)

    monkeypatch.setattr(info, "_check_bucket", lossy)
    results = info.self_test("numpy")
    assert all(verdict.startswith("FAILED: AssertionError") for verdict in results.values()), results


def test_the_command_prints_versions_builds_kernels_and_exits_by_the_self_test():
    result = subprocess.run([sys.executable, "-m", "hvd_sparse.info"], cwd=REPO.parent, capture_output=True,
                            text=True, timeout=300, check=False, env={"PYTHONPATH": str(REPO),
                                                                       "OMP_NUM_THREADS": "1",
                                                                       "PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stdout + result.stderr
    for heading in ("versions:", "horovod builds:", "kernels:", "self-test (numpy"):
        assert heading in result.stdout
    assert "hvd_sparse: " in result.stdout and "cpu: " in result.stdout
