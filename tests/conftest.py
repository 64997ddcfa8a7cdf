import os
import sys

# tests/ on the path for the shared reference module; quiet TensorFlow in every process we start.
sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
