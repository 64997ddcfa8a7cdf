"""hvd_sparse: gradient sparsification for Horovod (PyTorch and TensorFlow).

The kernels live in the package (``hvd_sparse/kernels``); every
``hvd_sparse/kernels/cpu/*.cpp`` is compiled into one shared library inside it (plain C ABI, loaded with
ctypes: no Python or torch headers, so it is not tied to the torch ABI). A compiler error fails
the install. Flags: -O3, strict IEEE floating point (the kernels must match the reference path bit
for bit), and no -march=native: the library must run on any x86-64 / aarch64 machine. On x86-64
the same sources are built a second time for the x86-64-v3 level (AVX2, every x86-64 CPU since
about 2015), which the loader picks at run time where the CPU has it: wider vectors and more loads
in flight, the same IEEE operations in the same order, so the same results. Where TensorFlow is
importable at build time (``pip install --no-build-isolation``, ``make install``),
hvd_sparse/kernels/cpu/tf_ops.cc and the kernel sources it wraps are built against it as a
TensorFlow op library (``_tf_ops``), which the TensorFlow backend loads with tf.load_op_library.
Under pip's default build isolation TensorFlow is not importable here; the sources ship with the
package and hvd_sparse/kernels/tf_build.py compiles the library on first use, into a per-user
cache, saying so.
"""

import os
import platform
import runpy
from glob import glob

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

KERNELS = "hvd_sparse/kernels/cpu"
BUILD = runpy.run_path("hvd_sparse/kernels/build.py")   # flags and sources, shared with tf_build.py
FLAGS = list(BUILD["FLAGS"])


def native(name: str, flags: list[str]) -> Extension:
    return Extension(f"hvd_sparse.kernels.cpu.{name}", sources=sorted(glob(f"{KERNELS}/*.cpp")),
                     depends=sorted(glob(f"{KERNELS}/*.h")), language="c++",
                     extra_compile_args=FLAGS + flags)


def tensorflow_ops() -> list[Extension]:
    """The TensorFlow op library (tf_ops.cc over the same kernel sources), built
    against the installed TensorFlow with its own compile and link flags; none without it."""
    try:
        import tensorflow as tf
    except ImportError:
        return []
    return [Extension("hvd_sparse.kernels.cpu._tf_ops",
                      sources=[f"{KERNELS}/{name}" for name in BUILD["TF_SOURCES"]],
                      depends=sorted(glob(f"{KERNELS}/*.h")), language="c++",
                      extra_compile_args=[*FLAGS, *BUILD["TF_FLAGS"], *tf.sysconfig.get_compile_flags()],
                      extra_link_args=tf.sysconfig.get_link_flags())]


libraries = [native("_native", [])]
if platform.machine().lower() in ("x86_64", "amd64"):
    libraries.append(native("_native_v3", ["-march=x86-64-v3", "-mtune=generic"]))
libraries += tensorflow_ops()


class BuildEachApart(build_ext):
    """Each library compiles in a temporary folder of its own: they build the same sources."""

    def build_extension(self, ext):
        shared = self.build_temp
        self.build_temp = os.path.join(shared, ext.name)
        try:
            super().build_extension(ext)
        finally:
            self.build_temp = shared


# Metadata, dependencies and the version are in pyproject.toml; only the native libraries are here.
setup(ext_modules=libraries, cmdclass={"build_ext": BuildEachApart})
