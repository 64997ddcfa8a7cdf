import os

# Quiet TensorFlow in every process we start. The repository root is on the path through
# pytest's ``pythonpath`` (pyproject.toml), so the tests import ``tests.reference`` as a package.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
