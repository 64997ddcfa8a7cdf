"""Real Horovod jobs with LAGS-SGD (PyTorch and TensorFlow, Gloo and MPI).

Each worker runs several configurations for 20 steps and checks, on every rank and step, the
applied gradient and the residual of every group against an independent reference, then that all
ranks hold identical parameters and per-group densities. The PyTorch worker also checks that
each group's allgathers are issued, and complete, before the backward pass ends.
"""

from __future__ import annotations

import pytest

from tests.multiproc.launch import assert_passed, launch

pytestmark = pytest.mark.multiproc

TORCH_CONFIGS = ("merged", "per-tensor", "adaptive-calibrated", "adaptive-given")
TF_CONFIGS = ("function/merged", "function/one-group", "function/per-tensor", "eager/per-tensor",
              "function/adaptive")


@pytest.mark.timeout(400)
@pytest.mark.parametrize(("size", "controller"), [(2, "gloo"), (2, "mpi"), (3, "gloo")])
def test_torch_lags(size, controller):
    stdout = assert_passed(launch("torch_lags.py", size, controller, timeout=360), size)
    for config in TORCH_CONFIGS:
        assert stdout.count(f"CHECKED torch/{config} ") == size


@pytest.mark.timeout(400)
@pytest.mark.parametrize(("size", "controller"), [(2, "gloo"), (2, "mpi")])
def test_tensorflow_lags(size, controller):
    stdout = assert_passed(launch("tf_lags.py", size, controller, timeout=360), size)
    for config in TF_CONFIGS:
        assert stdout.count(f"CHECKED tf/{config} ") == size
