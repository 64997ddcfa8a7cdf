"""Real Horovod jobs (2 and 4 ranks, Gloo and MPI, PyTorch and TensorFlow) with TopK.

Each worker trains for 20 steps per configuration and checks, on every rank and every step, the
applied gradient and the residual against an independent reference built from every rank's
accumulated vector, then that all ranks hold identical parameters (workers/checks.py).
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.multiproc.launch import REPO, assert_passed, job_env, launch

pytestmark = pytest.mark.multiproc

MATRIX = [(size, controller) for size in (2, 4) for controller in ("gloo", "mpi")]


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("size", "controller"), MATRIX)
def test_torch_topk(size, controller):
    stdout = assert_passed(launch("torch_topk.py", size, controller), size)
    for config in ("tensor/gather", "tensor/union", "model/gather", "model/union"):
        assert stdout.count(f"CHECKED torch/{config} ") == size


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("size", "controller"), MATRIX)
def test_tensorflow_topk(size, controller):
    stdout = assert_passed(launch("tf_topk.py", size, controller), size)
    for config in ("tape-function/tensor/gather", "tape-function/model/union", "tape-eager/tensor/gather",
                   "stock-tape-function/tensor/gather", "keras/tensor/gather", "keras/model/union"):
        assert stdout.count(f"CHECKED tf/{config} ") == size


@pytest.mark.timeout(200)
def test_torch_topk_under_plain_mpirun():
    assert_passed(launch("torch_topk.py", 2, "mpirun", ["5"]), 2)


@pytest.mark.timeout(120)
def test_keras3_is_refused_with_the_fix_named():
    """Under Keras 3 Horovod's Keras optimizer would train unsynchronized; we refuse instead."""
    env = job_env()
    env.pop("TF_USE_LEGACY_KERAS")
    code = ("import tensorflow as tf, horovod.tensorflow as hvd\n"
            "from hvd_sparse.tensorflow import TopK, keras\n"
            "hvd.init()\n"
            "try:\n"
            "    keras.DistributedOptimizer(tf.keras.optimizers.SGD(0.1), TopK(0.01))\n"
            "except Exception as e:\n"
            "    print(type(e).__name__, e)\n")
    result = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True,
                            text=True, timeout=100, check=False)
    assert "ConfigurationError" in result.stdout, result.stdout + result.stderr[-3000:]
    assert "TF_USE_LEGACY_KERAS=1" in result.stdout
