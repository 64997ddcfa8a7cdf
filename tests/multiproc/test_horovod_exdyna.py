"""Real 4-rank Horovod jobs (Gloo and MPI, PyTorch and TensorFlow) with MiCRO and ExDyna, both
rebalancer modes. Under MPI the neighbour rebalancer exchanges counts with mpi4py; under Gloo
through a Horovod alltoall. Each worker re-derives every rank's selection every step from
every rank's accumulated vector and checks aggregate, residual, partition tables and
parameters (workers/checks.py)."""

from __future__ import annotations

import pytest

from tests.multiproc.launch import assert_passed, launch

pytestmark = pytest.mark.multiproc


@pytest.mark.timeout(420)
@pytest.mark.parametrize("controller", ["gloo", "mpi"])
def test_torch_exdyna(controller):
    stdout = assert_passed(launch("torch_exdyna.py", 4, controller, timeout=400), 4)
    for config in ("exdyna/rebalance=exact", "exdyna/rebalance=neighbour",
                   "exdyna/threshold_scaling=tracking", "micro/paper"):
        assert stdout.count(f"CHECKED torch/{config} ") == 4


@pytest.mark.timeout(600)
@pytest.mark.parametrize("controller", ["gloo", "mpi"])
def test_tensorflow_exdyna(controller):
    stdout = assert_passed(launch("tf_exdyna.py", 4, controller, timeout=580), 4)
    for config in ("tape-function/exact", "tape-function/neighbour", "tape-eager/tracking", "keras/micro",
                   "ungrouped-refused"):
        assert stdout.count(f"CHECKED tf/{config} ") == 4
