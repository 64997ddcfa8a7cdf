"""How the kernels are compiled, written once for setup.py (which reads this file by path: under
build isolation the package itself cannot be imported) and for the TensorFlow op library compiled
on first use (hvd_sparse/kernels/tf_build.py). No imports: this file must run on its own.
"""

# -O3 and strict IEEE arithmetic (no contraction into FMAs, no errno): the kernels must match the
# reference path bit for bit. No -march=native: the libraries must run on any machine of the arch.
FLAGS = ("-O3", "-std=c++17", "-ffp-contract=off", "-fno-math-errno")
# The TensorFlow op library: tf_ops.cc and the kernel sources it wraps; TF's headers warn.
TF_SOURCES = ("tf_ops.cc", "topk.cpp", "norms.cpp", "accumulate.cpp", "sampled.cpp")
TF_FLAGS = ("-Wno-deprecated-declarations",)
