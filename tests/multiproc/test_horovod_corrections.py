"""Real Horovod jobs (2 ranks, Gloo) with the corrections every method takes: momentum (plain and
Nesterov), warmup_steps, dense_steps and dense_below (hvd_sparse/algorithms/corrections.py).

Each worker (workers/torch_corrections.py, workers/tf_corrections.py) trains every method, across
the gather, union and shared patterns and the tensor, model and LAGS group scopes, and checks on
every rank and step, from every rank's accumulated vector (the momentum-corrected gradient plus
the residual, computed from ``state_dict()`` before the step): the applied gradient, exact error
feedback, the velocity masked where sent and the step's target density; at the end identical
parameters (workers/correction_checks.py). Then a checkpoint resume with momentum, both non-finite
policies with momentum, what TensorFlow's per-tensor graphs refuse, and the warning about a second
momentum in the optimizer. The elastic reset with momentum is in test_horovod_elastic.py.
"""

from __future__ import annotations

import pytest

from tests.multiproc.launch import assert_passed, launch

pytestmark = pytest.mark.multiproc

SIZE = 2
TORCH_CONFIGS = ("topk/tensor/gather", "topk/model/union", "randomk/model/shared", "threshold/tensor/union",
                 "gaussiank/tensor/gather", "dgc/model/gather", "lags/groups/gather", "exdyna/model/union",
                 "micro/model/union", "deft/model/union")
TF_CONFIGS = ("exdyna/model/union", "topk/model/union", "deft/model/union", "lags/groups/gather",
              "lags/groups/dense-steps", "topk/tensor/gather", "randomk/model/shared",
              "threshold/tensor/union", "gaussiank/tensor/gather", "dgc/tensor/gather", "micro/model/union")


def assert_on_every_rank(stdout: str, lines: list[str]) -> None:
    for line in lines:
        assert stdout.count(f"{line} rank=") == SIZE, line


@pytest.mark.timeout(300)
def test_torch_corrections():
    stdout = assert_passed(launch("torch_corrections.py", SIZE, "gloo", timeout=280), SIZE)
    assert_on_every_rank(stdout, [f"CHECKED torch/{config}" for config in TORCH_CONFIGS])
    assert_on_every_rank(stdout, ["CHECKED resume/exdyna", "CHECKED resume/lags", "CHECKED nonfinite/exdyna",
                                  "CHECKED nonfinite/topk-tensor", "CHECKED warning"])
    # nonfinite="skip": rank 1 kept residual and velocity in every bucket (two LAGS groups and
    # the dense_below bucket; ExDyna's model and dense_below buckets), and only rank 1
    assert stdout.count("SKIPPED lags/groups/gather step 5 rank=1") == 3
    assert stdout.count("SKIPPED exdyna/model/union step 6 rank=1") == 2
    assert stdout.count("SKIPPED") == 5


@pytest.mark.timeout(420)
def test_tensorflow_corrections():
    stdout = assert_passed(launch("tf_corrections.py", SIZE, "gloo", timeout=400), SIZE)
    assert_on_every_rank(stdout, [f"CHECKED tf/{config}" for config in TF_CONFIGS])
    assert_on_every_rank(stdout, ["REFUSED tf/dense-steps-per-tensor", "CHECKED resume/exdyna",
                                  "CHECKED nonfinite/exdyna", "CHECKED warning"])
    assert stdout.count("SKIPPED topk/tensor/gather step 5 rank=1") == 6   # one bucket per tensor
    assert stdout.count("SKIPPED") == 6
