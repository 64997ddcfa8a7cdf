"""hvd_sparse as a user installs it: a wheel built by ``pip wheel .`` with pip's default build
isolation, installed into a fresh virtual environment that holds only torch and the Horovod
wheel ``make install`` built, then used from outside the repository: ``python -m hvd_sparse.info``
and the README's PyTorch example on 2 ranks with horovodrun."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import hvd_sparse
from tests.multiproc.launch import REPO, job_env

pytestmark = pytest.mark.multiproc
torch = pytest.importorskip("torch")


def run(command: list, timeout: float, **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run([str(c) for c in command], capture_output=True, text=True, timeout=timeout,
                            **kwargs)
    assert result.returncode == 0, f"{command} failed:\n{(result.stdout + result.stderr)[-4000:]}"
    return result


def horovod_wheel() -> Path:
    """The Horovod wheel tools/install.sh built and cached for this torch."""
    cache = Path(os.environ.get("HVD_SPARSE_CACHE") or Path.home() / ".cache" / "hvd_sparse")
    version = torch.__version__.split("+")[0]
    wheels = sorted(cache.glob(f"wheels/horovod-*-torch{version}*/horovod-*.whl"))
    assert wheels, f"no Horovod wheel for torch {version} under {cache}/wheels: run `make install`"
    return wheels[-1]


def readme_example() -> str:
    """The README's PyTorch example: the first python block after its heading line."""
    text = (REPO / "README.md").read_text()
    after = text[text.index("PyTorch with stock Horovod"):]
    return re.search(r"```python\n(.*?)```", after, re.S).group(1)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", out, REPO], timeout=900)
    (built,) = out.glob("hvd_sparse-*.whl")
    return built


def test_the_wheel_holds_the_kernels_their_sources_and_one_version(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert any(re.search(r"hvd_sparse/kernels/cpu/_native\.cpython.*\.so$", n) for n in names)
    for source in ("tf_ops.cc", "topk.cpp", "sums.h"):   # the TF ops compile from them on first use
        assert f"hvd_sparse/kernels/cpu/{source}" in names
    assert not any(n.startswith(("tests/", "scripts/", "kernels/")) for n in names)
    metadata = next(n for n in names if n.endswith(".dist-info/METADATA"))
    text = zipfile.ZipFile(wheel).read(metadata).decode()
    assert f"Version: {hvd_sparse.__version__}\n" in text
    requires = re.findall(r"^Requires-Dist: (.*)$", text, re.M)
    assert "numpy" in requires and not any("horovod" in r for r in requires), requires


@pytest.mark.timeout(1500)
def test_a_fresh_environment_trains_the_readme_example_on_two_ranks(wheel, tmp_path):
    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", venv], timeout=120)
    python = venv / "bin" / "python"
    pip = [python, "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    run([*pip, "-c", REPO / "constraints.txt", f"torch=={torch.__version__.split('+')[0]}"], timeout=600)
    run([*pip, horovod_wheel()], timeout=300)
    run([*pip, "-c", REPO / "constraints.txt", wheel], timeout=300)   # and its one requirement, NumPy
    outside = tmp_path / "job"
    outside.mkdir()
    env = {k: v for k, v in job_env().items() if k != "PYTHONPATH"}
    env["PATH"] = os.pathsep.join([str(venv / "bin"), os.environ.get("PATH", "")])
    where = run([python, "-c", "import hvd_sparse; print(hvd_sparse.__file__)"], 60, cwd=outside, env=env)
    assert where.stdout.startswith(str(venv)), where.stdout
    info = run([python, "-m", "hvd_sparse.info"], 300, cwd=outside, env=env)
    assert "hvd_sparse" in info.stdout and hvd_sparse.__version__ in info.stdout, info.stdout
    (outside / "train.py").write_text(readme_example())
    job = run([venv / "bin" / "horovodrun", "--gloo", "-np", "2", "-H", "localhost:2", python, "train.py"],
              600, cwd=outside, env=env)
    loss = re.search(r"loss ([\d.]+)", job.stdout)
    assert loss and float(loss.group(1)) < 1.0, job.stdout[-2000:]
