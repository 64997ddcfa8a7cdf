"""Start real Horovod jobs from the tests: horovodrun with Gloo or MPI, or plain mpirun."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
WORKERS = HERE / "workers"
REPO = HERE.parent.parent
BIN = Path(sys.executable).parent


def job_env() -> dict:
    env = dict(os.environ)
    env.update({
        "OMP_NUM_THREADS": "1",           # several ranks share 2 cores
        "TF_CPP_MIN_LOG_LEVEL": "3",
        "TF_USE_LEGACY_KERAS": "1",
        "PYTHONUNBUFFERED": "1",
        # Open MPI refuses root without these; harmless otherwise.
        "OMPI_ALLOW_RUN_AS_ROOT": "1",
        "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
        "PYTHONPATH": os.pathsep.join([str(WORKERS), str(REPO), env.get("PYTHONPATH", "")]),
        "PATH": os.pathsep.join([str(BIN), env.get("PATH", "")]),
        # Ranks outnumber cores: let Open MPI yield instead of busy-polling.
        "OMPI_MCA_mpi_yield_when_idle": "1",
        # One host: shared memory and TCP. The libfabric transport finds no fabric here and, on a
        # loaded machine, once aborted a rank inside MPI_Init ("Resource deadlock avoided").
        "OMPI_MCA_btl": "^ofi,openib",
        # Fail fast instead of waiting for the 60 s stall warning if a rank hangs.
        "HOROVOD_STALL_CHECK_TIME_SECONDS": "20",
        "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "40",
    })
    return env


def launch(worker: str, size: int, controller: str, args: list[str] | None = None,
           timeout: float = 240) -> subprocess.CompletedProcess:
    """Run ``workers/<worker>`` on ``size`` local ranks; controller is 'gloo', 'mpi' or 'mpirun'."""
    script = [sys.executable, str(WORKERS / worker), *(args or [])]
    if controller == "mpirun":
        cmd = ["mpirun", "--oversubscribe", "-np", str(size), "-x", "PYTHONPATH", "-x", "PATH",
               "-x", "OMP_NUM_THREADS", "-x", "TF_USE_LEGACY_KERAS", "-x", "TF_CPP_MIN_LOG_LEVEL",
               *script]
    else:
        cmd = [str(BIN / "horovodrun"), f"--{controller}", "-np", str(size), "-H", f"localhost:{size}",
               *script]
    return subprocess.run(cmd, env=job_env(), cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, check=False)


def assert_passed(result: subprocess.CompletedProcess, size: int) -> str:
    """Every rank printed PASSED and the job exited 0; returns stdout for further checks."""
    output = result.stdout + result.stderr
    tail = "\n".join(line for line in output.splitlines()
                     if "I0000" not in line and "absl::InitializeLog" not in line)[-6000:]
    assert result.returncode == 0, f"job failed (exit {result.returncode}):\n{tail}"
    for rank in range(size):
        assert f"PASSED rank={rank} size={size}" in result.stdout, f"rank {rank} did not pass:\n{tail}"
    return result.stdout
