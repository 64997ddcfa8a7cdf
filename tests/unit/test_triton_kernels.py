"""The Triton kernels give the reference path's results bit for bit (cases: tests/triton_cases.py).

* On a GPU (TRITON_INTERPRET unset): the cases run here, compiled, on CUDA tensors.
* With TRITON_INTERPRET=1 in the environment: the cases run here, in Triton's interpreter.
* Otherwise (a CPU machine, the usual CI run): one test runs the cases in a child pytest with
  TRITON_INTERPRET=1. Triton decides at import time whether its kernels are interpreted, and
  reads the variable again while they run, so it cannot be set for this module alone in a
  shared process without leaking into every later test; the child keeps it to itself.

Skipped only where Triton is not installed (tools/install.sh installs it, so CI runs these).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
if importlib.util.find_spec("triton") is None:
    pytest.skip("Triton is not installed (tools/install.sh installs it)", allow_module_level=True)

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
REPO = Path(__file__).resolve().parents[2]

if INTERPRETED or torch.cuda.is_available():
    from triton_cases import *  # noqa: F403  (the cases, collected here)
else:
    def test_triton_kernels_in_the_interpreter():
        env = dict(os.environ, TRITON_INTERPRET="1")
        child = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--timeout=280",
             str(Path(__file__).resolve())],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=290)
        report = child.stdout[-8000:] + child.stderr[-2000:]
        assert child.returncode == 0, f"the Triton kernel cases failed in the interpreter:\n{report}"
        assert " passed" in child.stdout and " skipped" not in child.stdout, report
