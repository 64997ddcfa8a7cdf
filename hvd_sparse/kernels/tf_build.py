"""The TensorFlow op library, compiled on first use where the install could not build it.

setup.py builds ``_tf_ops`` only where TensorFlow is importable at build time. Under pip's default
build isolation (``pip install hvd_sparse``, ``pip wheel .``) it is not, so the wheel carries the
kernel sources instead, and the first process that needs the ops compiles them against the
TensorFlow it runs with, into a per-user cache (``$HVD_SPARSE_CACHE/tf_ops``, by default
``~/.cache/hvd_sparse/tf_ops``), saying so on stderr. The file's name holds a hash of the sources,
TensorFlow's version and its flags, so a new TensorFlow or new sources get a library of their own,
and ranks starting together on one machine compile it once (a file lock). Nothing here is
silent: a compile that cannot run or fails raises ``KernelUnavailable`` with the compiler's
words, and the loader then warns once and runs the reference path. ``HVD_SPARSE_TF_OPS_BUILD=0``
turns compiling off (the reference path then runs, with that warning).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from . import KernelUnavailable, build

CPU = Path(__file__).resolve().parent / "cpu"
SOURCES = build.TF_SOURCES
# setup.py's flags, and what setuptools adds for a shared library.
FLAGS = (*build.FLAGS, *build.TF_FLAGS, "-fPIC", "-shared")
CACHE_ENVIRONMENT = "HVD_SPARSE_CACHE"
BUILD_ENVIRONMENT = "HVD_SPARSE_TF_OPS_BUILD"


def cache_dir() -> Path:
    """Where compiled op libraries are kept for this user."""
    root = os.environ.get(CACHE_ENVIRONMENT) or str(Path.home() / ".cache" / "hvd_sparse")
    return Path(root) / "tf_ops"


def build_key(version: str, compile_flags: list[str], link_flags: list[str]) -> str:
    """A hash of everything the library depends on: the sources and headers, TensorFlow's version
    and flags, the compile flags and the Python ABI."""
    digest = hashlib.sha256()
    for path in [*(CPU / name for name in SOURCES), *sorted(CPU.glob("*.h"))]:
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    for part in (version, *compile_flags, *link_flags, *FLAGS, sys.implementation.cache_tag or ""):
        digest.update(part.encode() + b"\0")
    return digest.hexdigest()[:16]


def cached_library(tf: Any) -> Path:
    """The op library for this TensorFlow and these sources, compiled into the cache first when it
    is not there (once per user and key; concurrent processes wait for the first)."""
    compile_flags, link_flags = tf.sysconfig.get_compile_flags(), tf.sysconfig.get_link_flags()
    folder = cache_dir()
    path = folder / f"_tf_ops-{tf.__version__}-{build_key(tf.__version__, compile_flags, link_flags)}.so"
    if path.exists():
        return path
    if os.environ.get(BUILD_ENVIRONMENT, "1").strip() == "0":
        raise KernelUnavailable(f"the TensorFlow op library was not built with the package and "
                                f"{BUILD_ENVIRONMENT}=0 keeps it from being compiled into {folder}")
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not path.exists():
            compile_library(path, tf.__version__, compile_flags, link_flags)
    return path


def compile_library(path: Path, version: str, compile_flags: list[str], link_flags: list[str]) -> None:
    """Compile the sources into ``path`` (written whole or not at all)."""
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        raise KernelUnavailable("the TensorFlow op library must be compiled and there is no C++ "
                                "compiler: install one (Debian: apt-get install g++) or set CXX")
    print(f"hvd_sparse: compiling the TensorFlow op library for TensorFlow {version} into {path} "
          "(once per TensorFlow version; seconds to a minute)", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as scratch:
        out = Path(scratch) / path.name
        command = [compiler, *FLAGS, *compile_flags, *(str(CPU / name) for name in SOURCES),
                   "-o", str(out), *link_flags]
        result = subprocess.run(command, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            words = (result.stderr or result.stdout).strip().splitlines()[-15:]
            raise KernelUnavailable(f"compiling the TensorFlow op library failed ({' '.join(command[:1])}"
                                    f" exited with {result.returncode}):\n" + "\n".join(words))
        os.replace(out, path)
