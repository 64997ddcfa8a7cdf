"""What this install of hvd_sparse has and whether it works: ``python -m hvd_sparse.info``.

Put its output in bug reports. It prints the versions of everything hvd_sparse runs with, how
Horovod was built for each framework (its public build queries: MPI, Gloo, NCCL, CUDA), which
kernels load (the CPU library and its instruction level, the TensorFlow ops, Triton on a GPU)
and a one-process self-test of every method: two simulated ranks (hvd_sparse.comm.local) step a
small model three times on NumPy and, where torch is installed, on torch with the kernels; each
step must conserve the gradient (what was sent plus the new residual is the gradient plus the
old residual) and give every rank the same average. The exit status is 1 when a self-test fails.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import platform
import sys
from typing import Any

import numpy as np

from .comm.local import LocalGroup
from .engine import Engine
from .engine.planning import plan_buckets
from .registry import METHODS

# name -> its distributions, the first installed one reported
PACKAGES = {"numpy": ("numpy",), "torch": ("torch",), "tensorflow": ("tensorflow", "tensorflow-cpu"),
            "tf-keras": ("tf-keras",), "horovod": ("horovod",), "triton": ("triton",)}
SELF_TEST_SIZES = (3000, 40, 2000, 10)   # a small model: two weights, two biases
# Plain error feedback everywhere (DGC's default momentum correction accumulates u, not g).
SELF_TEST_OPTIONS: dict[str, dict[str, Any]] = {"lags": {"merge_threshold": 0}, "dgc": {"momentum": 0.0}}


def versions() -> dict[str, str]:
    """Python, hvd_sparse and the installed packages it works with (or "not installed")."""
    out = {"python": platform.python_version(), "hvd_sparse": _version("hvd_sparse")}
    for name, distributions in PACKAGES.items():
        out[name] = next((v for v in map(_version, distributions) if v != "not installed"), "not installed")
    return out


def _version(distribution: str) -> str:
    """The installed version of ``distribution``, or "not installed"."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def horovod_builds() -> dict[str, Any]:
    """Per framework, Horovod's build (from the face's module that may import Horovod), or why
    it cannot be asked."""
    out: dict[str, Any] = {}
    for framework in ("torch", "tensorflow"):
        try:
            internals = importlib.import_module(f"hvd_sparse.{framework}.horovod_internals")
            out[framework] = internals.horovod_build()
        except Exception as error:   # any failure to import is the answer here
            out[framework] = f"unavailable ({type(error).__name__}: {error})"
    return out


def kernels() -> dict[str, str]:
    """Which op modules load: the CPU library (and its level), TensorFlow's ops, Triton."""
    from . import kernels as kernel_modules

    out = {"mode": kernel_modules.mode()}
    try:
        from .kernels.cpu import _library

        _library.library()
        out["cpu"] = f"loaded ({_library.level()})"
    except Exception as error:
        out["cpu"] = f"not loaded ({error})"
    out["tensorflow ops"] = _tensorflow_ops()
    out["triton (CUDA)"] = _triton()
    return out


def _tensorflow_ops() -> str:
    try:
        import tensorflow  # noqa: F401
    except ImportError:
        return "no TensorFlow"
    from . import kernels as kernel_modules

    return "loaded" if kernel_modules.tensorflow_ops() is not None else "not loaded (see the warning above)"


def _triton() -> str:
    try:
        import torch
    except ImportError:
        return "no torch"
    if not torch.cuda.is_available():
        return "no CUDA device"
    try:
        importlib.import_module("hvd_sparse.kernels.triton")
    except Exception as error:
        return f"not loaded ({error})"
    return f"loaded ({torch.cuda.get_device_name()})"


def self_test(backend_name: str) -> dict[str, str]:
    """Every method on two simulated ranks, three steps on ``backend_name`` ("numpy", or
    "torch" with the kernels as set): "ok", or what failed."""
    from .backends import get_backend

    backend = get_backend(backend_name)
    out = {}
    for name, cls in sorted(METHODS.items()):
        try:
            _check_method(cls(0.05, **SELF_TEST_OPTIONS.get(name, {})), backend)
            out[name] = "ok"
        except Exception as error:   # report every method, whatever failed
            out[name] = f"FAILED: {type(error).__name__}: {error}"
    return out


def _check_method(algorithm: Any, backend: Any) -> None:
    """Three steps of ``algorithm`` on 2 ranks: every bucket conserves each rank's gradient and
    gives both ranks one average (raises AssertionError otherwise)."""
    size, rng = 2, np.random.default_rng(0)
    engines = [Engine(algorithm, backend, rank, size) for rank in range(size)]
    group = LocalGroup(size, backend)
    keys = [f"t{i}" for i in range(len(SELF_TEST_SIZES))]
    for _ in range(3):
        for bucket, members in plan_buckets(algorithm, keys, list(SELF_TEST_SIZES)):
            grads = [[rng.standard_normal(SELF_TEST_SIZES[keys.index(m)]).astype(np.float32)
                      for m in members] for _ in range(size)]
            old = [_residual(e, bucket, backend, grads[r]) for r, e in enumerate(engines)]
            outputs = group.run([e.step(bucket, [backend.from_numpy(g) for g in grads[r]])
                                 for r, e in enumerate(engines)])
            _check_bucket(engines, bucket, backend, grads, old, outputs)
        group.run([e.end_step(None) for e in engines])


def _residual(engine: Engine, bucket: str, backend: Any, grads: list) -> np.ndarray:
    """The bucket's residual before the step (zeros before its first)."""
    known = engine.buckets.get(bucket)
    if known is None:
        return np.zeros(sum(g.size for g in grads), np.float32)
    return backend.to_numpy(known.residual).copy()


def _check_bucket(engines: list, bucket: str, backend: Any, grads: list, old: list, outputs: list) -> None:
    """Per rank: the accumulated vector g + e is what was sent where the new residual is zero
    and the new residual elsewhere; the ranks' averages are equal, and the sum of what they sent
    over the ranks."""
    total = None
    for rank, engine in enumerate(engines):
        acc = np.concatenate([g.reshape(-1) for g in grads[rank]]) + old[rank]
        residual = backend.to_numpy(engine.buckets[bucket].residual)
        sent = residual != acc
        assert not np.any(residual[sent]), f"{bucket}: rank {rank} kept part of what it sent"
        total = np.where(sent, acc, 0) if total is None else total + np.where(sent, acc, 0)
    averages = [np.concatenate([backend.to_numpy(t).reshape(-1) for t in out]) for out in outputs]
    assert np.array_equal(averages[0], averages[1]), f"{bucket}: the ranks' averages differ"
    np.testing.assert_allclose(averages[0], total / len(engines), rtol=1e-5, atol=1e-6,
                               err_msg=f"{bucket}: the average is not what the ranks sent")


def report() -> tuple[list[str], bool]:
    """The printed lines, and whether every self-test passed."""
    installed = versions()
    lines = ["hvd_sparse info", "", "versions:"]
    lines += [f"  {k}: {v}" for k, v in installed.items()]
    lines += ["horovod builds:"]
    lines += [f"  {k}: {v}" for k, v in horovod_builds().items()]
    lines += ["kernels:"]
    lines += [f"  {k}: {v}" for k, v in kernels().items()]
    passed = True
    backends = ["numpy"] + (["torch"] if installed["torch"] != "not installed" else [])
    for backend in backends:
        results = self_test(backend)
        passed &= all(v == "ok" for v in results.values())
        lines += [f"self-test ({backend}, 2 simulated ranks, 3 steps):"]
        lines += [f"  {k}: {v}" for k, v in results.items()]
    return lines, passed


def main() -> None:
    """Print the report; exit 1 when a self-test failed."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")   # TensorFlow's start-up banner is not news
    lines, passed = report()
    print("\n".join(lines))
    sys.exit(0 if passed else 1)


if __name__ == "__main__":
    main()
