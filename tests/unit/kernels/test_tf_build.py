"""The TensorFlow op library compiled on first use (hvd_sparse/kernels/tf_build.py), as a wheel
built under pip's build isolation needs it: compiled once into the per-user cache, then reused;
refused with the reason when compiling is off or fails."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

from hvd_sparse.kernels import KernelUnavailable, tf_build

REPO = Path(__file__).resolve().parents[3]


def fake_tf(version: str = "9.9.9") -> SimpleNamespace:
    sysconfig = SimpleNamespace(get_compile_flags=lambda: ["-DX"], get_link_flags=lambda: ["-lx"])
    return SimpleNamespace(__version__=version, sysconfig=sysconfig)


def test_the_key_follows_tensorflow_and_its_flags():
    key = tf_build.build_key("2.21.0", ["-I/a"], ["-L/b"])
    assert key == tf_build.build_key("2.21.0", ["-I/a"], ["-L/b"])
    assert key != tf_build.build_key("2.22.0", ["-I/a"], ["-L/b"])
    assert key != tf_build.build_key("2.21.0", ["-I/c"], ["-L/b"])


def test_compiling_off_is_refused_with_the_reason(tmp_path, monkeypatch):
    monkeypatch.setenv(tf_build.CACHE_ENVIRONMENT, str(tmp_path))
    monkeypatch.setenv(tf_build.BUILD_ENVIRONMENT, "0")
    with pytest.raises(KernelUnavailable, match="HVD_SPARSE_TF_OPS_BUILD=0"):
        tf_build.cached_library(fake_tf())


def test_a_failed_compile_names_the_compiler_words_and_leaves_no_library(tmp_path, monkeypatch):
    compiler = tmp_path / "cxx"
    compiler.write_text("#!/bin/sh\necho 'tf_ops.cc:1: error: no tensorflow headers' >&2\nexit 1\n")
    compiler.chmod(0o755)
    monkeypatch.setenv("CXX", str(compiler))
    monkeypatch.setenv(tf_build.CACHE_ENVIRONMENT, str(tmp_path / "cache"))
    monkeypatch.delenv(tf_build.BUILD_ENVIRONMENT, raising=False)
    with pytest.raises(KernelUnavailable, match="no tensorflow headers"):
        tf_build.cached_library(fake_tf())
    assert not list((tmp_path / "cache" / "tf_ops").glob("*.so"))


RUN = textwrap.dedent("""
    import numpy as np, tensorflow as tf
    from hvd_sparse.kernels import tf_build
    lib = tf.load_op_library(str(tf_build.cached_library(tf)))
    x = tf.constant([0.5, -3.0, 2.0, 0.1, -2.5], tf.float32)
    print("indices", lib.hvd_sparse_topk_abs(x, tf.constant(3, tf.int64), Tidx=tf.int64).numpy().tolist())
""")


@pytest.mark.timeout(600)
def test_the_library_is_compiled_once_into_the_cache_and_runs(tmp_path):
    pytest.importorskip("tensorflow")
    env = {**os.environ, tf_build.CACHE_ENVIRONMENT: str(tmp_path), "TF_CPP_MIN_LOG_LEVEL": "3",
           "PYTHONPATH": str(REPO)}
    env.pop(tf_build.BUILD_ENVIRONMENT, None)
    runs = [subprocess.run([sys.executable, "-c", RUN], env=env, capture_output=True, text=True,
                           timeout=500, cwd=tmp_path) for _ in range(2)]
    for run in runs:
        assert run.returncode == 0, run.stderr[-3000:]
        assert "indices [1, 2, 4]" in run.stdout
    assert "compiling the TensorFlow op library" in runs[0].stderr
    assert "compiling" not in runs[1].stderr          # the second process reuses it
    assert len(list((tmp_path / "tf_ops").glob("_tf_ops-*.so"))) == 1
