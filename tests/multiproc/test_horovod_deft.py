"""Real Horovod jobs (4 ranks, Gloo and MPI, PyTorch and TensorFlow) with DEFT.

Each worker runs several configurations for 20 steps and checks, on every rank and every step, the
applied gradient, the residual and the statistics against an independent re-derivation of the
DEFT step from every rank's accumulated vector (workers/deft_checks.py), then that all ranks hold
identical parameters.
"""

from __future__ import annotations

import re

import pytest

from tests.multiproc.launch import assert_passed, launch

pytestmark = pytest.mark.multiproc

SIZE = 4


def fallbacks(stdout: str, label: str) -> list[int]:
    return [int(m) for m in re.findall(rf"CHECKED {re.escape(label)} .*fallbacks=(\d+)", stdout)]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("controller", ["gloo", "mpi"])
def test_torch_deft(controller):
    stdout = assert_passed(launch("torch_deft.py", SIZE, controller, timeout=380), SIZE)
    for config in ("paper", "agreed-heap-groups2", "dense-fallback"):
        assert stdout.count(f"CHECKED torch/{config} ") == SIZE
    assert all(count > 0 for count in fallbacks(stdout, "torch/dense-fallback"))


@pytest.mark.timeout(600)
@pytest.mark.parametrize("controller", ["gloo", "mpi"])
def test_tensorflow_deft(controller):
    stdout = assert_passed(launch("tf_deft.py", SIZE, controller, timeout=580), SIZE)
    for config in ("tape-function/paper", "tape-eager/agreed-heap", "tape-function/dense-fallback",
                   "keras/paper"):
        assert stdout.count(f"CHECKED tf/{config} ") == SIZE
    assert stdout.count("REFUSED tf/ungrouped-tape ") == SIZE
    assert all(count > 0 for count in fallbacks(stdout, "tf/tape-function/dense-fallback"))
