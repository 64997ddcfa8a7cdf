import os

import pytest

# Quiet TensorFlow in every process we start. The repository root is on the path through
# pytest's ``pythonpath`` (pyproject.toml), so the tests import ``tests.reference`` as a package.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture
def one_torch_thread():
    """torch on one thread for the test (as every simulated rank runs), restored afterwards."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
