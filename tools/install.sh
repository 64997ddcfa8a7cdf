#!/usr/bin/env bash
# Build the tested stack (constraints.txt) into .venv/ in the repository, idempotently.
#
#   tools/install.sh            install what is missing (a second run takes seconds)
#   tools/install.sh --force    rebuild the venv from scratch (the Horovod wheel cache is kept)
#
# Horovod 0.28.1 predates torch >= 2.1 and TF 2.21: its sdist is unpacked into a temporary folder
# and patched there (C++17, and a GPU-only XLA file guarded by HAVE_GPU) before it is compiled.
# An installed Horovod is never modified. The built wheel is cached under $HVD_SPARSE_CACHE
# (default ~/.cache/hvd_sparse) keyed by every version it is ABI-bound to.
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv="$repo/.venv"
cache="${HVD_SPARSE_CACHE:-$HOME/.cache/hvd_sparse}"
python="${PYTHON:-python3}"
stamp="$venv/.hvd_sparse_stack"

log() { printf '[install] %s\n' "$*"; }
# pip, minus the machine's notes about local index folders that do not exist; keeps pip's status.
pip_quiet() { "$@" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }; }
die() { printf '[install] ERROR: %s\n' "$*" >&2; exit 1; }

pin() {  # version of a package in constraints.txt
    local v
    v=$(sed -n "s/^$1==\([^ ]*\).*/\1/p" "$repo/constraints.txt")
    [ -n "$v" ] || die "constraints.txt has no pin for $1"
    printf '%s' "$v"
}

# What the installed stack depends on: a change to any of these reinstalls.
stack_key() {
    cat "$repo/tools/install.sh" "$repo/constraints.txt" "$repo/setup.py" | sha256sum | cut -c1-16
}

# The native kernel library (hvd_sparse/kernels/cpu/*.cpp, built in place by the editable install): a change
# to a source or to the package's metadata (pyproject.toml), or a missing library, reinstalls the
# package alone (seconds).
kernels_stamp="$venv/.hvd_sparse_kernels"
kernels_key() {
    cat "$repo/setup.py" "$repo/pyproject.toml" "$repo/hvd_sparse/kernels/build.py" "$repo"/hvd_sparse/kernels/cpu/*.cpp $(ls "$repo"/hvd_sparse/kernels/cpu/*.h "$repo"/hvd_sparse/kernels/cpu/*.cc 2>/dev/null) \
        | sha256sum | cut -c1-16
}
kernels_built() {
    [ -f "$kernels_stamp" ] && [ "$(cat "$kernels_stamp")" = "$(kernels_key)" ] \
        && ls "$repo"/hvd_sparse/kernels/cpu/_native*.so >/dev/null 2>&1
}
install_package() {  # editable: compiles the kernels in place; a compiler error fails the install
    if ! pip_quiet "$venv/bin/python" -m pip --disable-pip-version-check -q install --no-deps \
            --no-build-isolation -e "$repo"; then
        die "installing hvd_sparse failed: the kernels did not compile (compiler output above)"
    fi
    kernels_key >"$kernels_stamp"
}

if [ "${1:-}" = "--force" ]; then
    log "removing $venv"
    rm -rf "$venv"
fi
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$(stack_key)" ] && [ -x "$venv/bin/horovodrun" ]; then
    if ! kernels_built; then
        log "building the kernels (hvd_sparse/kernels/cpu changed)"
        install_package
    fi
    log "stack already installed in .venv (tools/install.sh --force rebuilds it)"
    exit 0
fi

# --- system packages: Open MPI (the MPI Horovod and mpi4py link) and a compiler toolchain --------
need_apt=()
for pkg in openmpi-bin libopenmpi-dev cmake g++ make; do
    dpkg -s "$pkg" >/dev/null 2>&1 || need_apt+=("$pkg")
done
if [ ${#need_apt[@]} -gt 0 ]; then
    sudo=""
    [ "$(id -u)" -eq 0 ] || sudo="sudo"
    log "apt-get install ${need_apt[*]}"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${need_apt[@]}" >/dev/null
fi

# --- the virtual environment ----------------------------------------------------------------------
if [ ! -x "$venv/bin/python" ]; then
    log "creating $venv"
    "$python" -m venv "$venv"
fi
pip=(pip_quiet "$venv/bin/python" -m pip --disable-pip-version-check -q)
constraints=(-c "$repo/constraints.txt")

torch_v=$(pin torch); tf_v=$(pin tensorflow-cpu); tfk_v=$(pin tf-keras)
mpi4py_v=$(pin mpi4py); hvd_v=$(pin horovod)

# torch alone first, pinned exactly: pip takes the CPU wheel on disk. Any looser request would let
# pip resolve a multi-GB CUDA build.
log "torch==$torch_v, tensorflow-cpu==$tf_v"
"${pip[@]}" install "${constraints[@]}" "torch==$torch_v"
"${pip[@]}" install "${constraints[@]}" "tensorflow-cpu==$tf_v"
# tf-keras depends on `tensorflow`, which would overwrite tensorflow-cpu: install it without deps.
"${pip[@]}" install --no-deps "tf-keras==$tfk_v"
log "mpi4py==$mpi4py_v, build and test tools"
"${pip[@]}" install "${constraints[@]}" "mpi4py==$mpi4py_v" \
    cloudpickle psutil pyyaml packaging cffi wheel setuptools \
    numpy pytest pytest-timeout hypothesis ruff mypy scikit-learn matplotlib
# transformers for examples/gpt2.py: pure Python, and torch is already pinned above.
"${pip[@]}" install "${constraints[@]}" "transformers==$(pin transformers)"
# Triton at the version torch's CUDA build requires: the GPU kernels run on it, and on this CPU
# torch the tests run them in its interpreter. It goes into .venv/triton, off the venv's path:
# its native library crashes a process that loaded TensorFlow first, and torch imports Triton
# whenever it finds it (tests/unit/kernels/test_triton.py puts it on the path of a child process).
triton_v=$(pin triton)
log "triton==$triton_v (into $venv/triton)"
"${pip[@]}" uninstall -y triton >/dev/null 2>&1 || true
"${pip[@]}" install --no-deps --upgrade --target "$venv/triton" "triton==$triton_v"

# --- Horovod, built from the sdist with two one-line fixes, cached by ABI key ----------------------
py_tag=$("$venv/bin/python" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
wheel_dir="$cache/wheels/horovod-$hvd_v-torch$torch_v-tf$tf_v-$py_tag-$(uname -m)"

patch_line() {  # file, exact old text, new text: fail loudly when the pattern is missing
    local file=$1 old=$2 new=$3
    grep -qF -- "$old" "$file" || die "patch pattern not found in $file: '$old' (is this Horovod $hvd_v?)"
    OLD="$old" NEW="$new" "$venv/bin/python" - "$file" <<'PY'
import os, sys
path = sys.argv[1]
text = open(path).read()
old, new = os.environ["OLD"], os.environ["NEW"]
assert text.count(old) == 1, f"{path}: expected one '{old}', found {text.count(old)}"
open(path, "w").write(text.replace(old, new))
PY
}

build_horovod() {
    local tmp
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' RETURN
    log "downloading the horovod==$hvd_v sdist"
    "${pip[@]}" download --no-deps --no-binary :all: "horovod==$hvd_v" -d "$tmp"
    tar xzf "$tmp/horovod-$hvd_v.tar.gz" -C "$tmp"
    local src="$tmp/horovod-$hvd_v"
    # torch >= 2.1 headers need C++17; gloo must use the same standard or linking fails with a
    # duplicate gloo::rendezvous::Store::kDefaultTimeout (upstream #3941/#3996, fixed in #3998).
    patch_line "$src/CMakeLists.txt" "set(CMAKE_CXX_STANDARD 14)" "set(CMAKE_CXX_STANDARD 17)"
    patch_line "$src/horovod/torch/CMakeLists.txt" "set(CMAKE_CXX_STANDARD 14)" "set(CMAKE_CXX_STANDARD 17)"
    # The file's code is GPU-only but its XLA includes are not guarded; they do not compile on a
    # CPU build of TF 2.21.
    patch_line "$src/horovod/tensorflow/xla_mpi_ops.cc" \
        "#if TENSORFLOW_VERSION >= 2006000000"$'\n' \
        "#if TENSORFLOW_VERSION >= 2006000000 && HAVE_GPU"$'\n'
    log "compiling horovod (3-4 minutes on 2 cores)"
    mkdir -p "$wheel_dir"
    (
        cd "$src"
        export HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_GLOO=1 \
               HOROVOD_WITH_MPI=1 HOROVOD_WITHOUT_MXNET=1 MAKEFLAGS="${MAKEFLAGS:--j2}"
        export PATH="$venv/bin:$PATH"
        "$venv/bin/python" -m pip --disable-pip-version-check wheel --no-build-isolation --no-deps \
            -w "$tmp/dist" . >"$tmp/build.log" 2>&1 || { tail -n 60 "$tmp/build.log" >&2; die "horovod build failed"; }
    )
    cp "$tmp"/dist/horovod-*.whl "$wheel_dir/"
}

if ! "$venv/bin/python" -c "import horovod, sys; sys.exit(horovod.__version__ != '$hvd_v')" 2>/dev/null; then
    ls "$wheel_dir"/horovod-*.whl >/dev/null 2>&1 || build_horovod
    log "installing $(basename "$wheel_dir"/horovod-*.whl) from the cache"
    "${pip[@]}" install --no-deps --force-reinstall "$wheel_dir"/horovod-*.whl
fi

# --- this package, editable, with its native kernels --------------------------------------------
install_package

# --- check: every framework and controller is built in --------------------------------------------
check=$("$venv/bin/horovodrun" --check-build 2>/dev/null)
for want in TensorFlow PyTorch MPI Gloo; do
    grep -qE "\[X\] $want" <<<"$check" || { echo "$check" >&2; die "horovod lacks $want"; }
done
stack_key >"$stamp"
log "done: $(TF_CPP_MIN_LOG_LEVEL=3 "$venv/bin/python" -c 'import torch, tensorflow as tf, horovod, mpi4py; print(f"torch {torch.__version__}, tensorflow {tf.__version__}, horovod {horovod.__version__}, mpi4py {mpi4py.__version__}")' 2>/dev/null)"
