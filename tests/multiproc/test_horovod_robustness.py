"""Real Horovod jobs (PyTorch) that must end the same way on every rank and never hang: tiny
models for every method at 2-4 ranks, ranks whose configuration differs, a raised non-finite
step that training goes on after, and a rank that dies mid-training (workers/torch_robust.py)."""

from __future__ import annotations

import re
import subprocess
import time

import pytest

import hvd_sparse
from tests.multiproc.launch import assert_passed, launch

pytestmark = pytest.mark.multiproc
VARIANTS = len(hvd_sparse.available()) + 5   # the registry's methods, the worker's extra variants


@pytest.mark.timeout(420)
@pytest.mark.parametrize(("size", "parts"), [(2, "sweep,mismatch,nonfinite"), (3, "sweep"), (4, "sweep")])
def test_every_rank_ends_the_same_way(size, parts):
    stdout = assert_passed(launch("torch_robust.py", size, "gloo", [parts], timeout=400), size)
    sizes = {1, size - 1, size, 31, 32 * size} - {0}
    assert stdout.count("CHECKED sweep/") == size * VARIANTS * len(sizes)   # every case, every rank
    for rank in range(size):
        assert f"CHECKED sweep/micro/n=1 ConfigurationError rank={rank}" in stdout
        assert f"CHECKED sweep/topk/n=1 ok rank={rank}" in stdout
    for method in ("topk", "lags", "exdyna"):
        assert stdout.count(f"CHECKED empty/{method} ") == size, method
    if "mismatch" in parts:
        for case in ("density", "method-topk", "method-micro", "method-deft", "hyperparameter",
                     "wider-layer", "order", "extra-layer-ExDyna", "extra-layer-DEFT",
                     "extra-layer-LAGS", "extra-layer-TopK"):
            assert stdout.count(f"CHECKED mismatch/{case} ") == size, case
        for case in ("exdyna", "topk-tensor"):
            assert stdout.count(f"CHECKED nonfinite/{case} ") == size, case


@pytest.mark.timeout(300)
def test_mismatch_and_nonfinite_under_mpi():
    stdout = assert_passed(launch("torch_robust.py", 2, "mpi", ["mismatch,nonfinite"], timeout=280), 2)
    assert stdout.count("CHECKED mismatch/") == 2 * 11
    assert stdout.count("CHECKED nonfinite/") == 2 * 2


@pytest.mark.timeout(300)
def test_tensorflow_mismatch_and_nonfinite():
    stdout = assert_passed(launch("tf_robust.py", 2, "gloo", timeout=280), 2)
    for case in ("density", "method", "density-tensor", "extra-layer-ExDyna"):
        assert stdout.count(f"CHECKED mismatch/{case} ") == 2, case
    for case in ("exdyna", "topk-tensor"):
        assert stdout.count(f"CHECKED nonfinite/{case} ") == 2, case


# Each method under each controller, each way of dying under each controller (4 jobs, not 8).
DEATHS = [("gloo", "exdyna", "kill"), ("gloo", "topk", "exit"), ("mpi", "exdyna", "exit"),
          ("mpi", "topk", "kill")]


@pytest.mark.timeout(200)
@pytest.mark.parametrize(("controller", "method", "how"), DEATHS)
def test_a_dead_rank_ends_the_job_on_every_survivor(controller, method, how):
    """Rank 1 of 3 dies at step 20 (SIGKILL or sys.exit); the job must end, with an error on the
    survivors (printed by them, or the launcher's end of the job), well within Horovod's timeouts."""
    started = time.monotonic()
    try:
        result = launch("torch_robust.py", 3, controller, ["die", method, how], timeout=170)
    except subprocess.TimeoutExpired as expired:
        pytest.fail(f"the job hung after rank 1 died:\n{(expired.stdout or b'')[-3000:]!r}")
    ended, seconds = time.time(), time.monotonic() - started
    output = result.stdout + result.stderr
    died = re.search(r"DYING rank=1 how=\w+ at=([\d.]+)", result.stdout)
    assert died, output[-4000:]
    after_death = ended - float(died.group(1))
    assert after_death < 90, f"the job took {after_death:.0f} s to end after rank 1 died"
    assert result.returncode != 0, output[-4000:]
    assert "SURVIVOR_FINISHED" not in result.stdout, output[-4000:]
    survivors = [r for r in (0, 2) if f"SURVIVOR_ERROR rank={r}" in result.stdout]
    if controller == "gloo":
        # horovodrun's Gloo launcher sends SIGTERM to every worker once one exits non-zero, so a
        # survivor may be ended by the launcher before its own error reaches Python (exit 143, or
        # "Terminated" on its stderr: the launcher does not always list every exit). On a loaded
        # machine both survivors can be, a SIGKILL's ~100 ms after Gloo's reset of the connection.
        # The failure it acts on is rank 1's, or a survivor's that reported the error first (rank 1
        # leaving by sys.exit can still be shutting down then).
        ended_by_launcher = [r for r in (0, 2) if r not in survivors
                             and (f"Process {r} exit with status code 143" in output
                                  or f"[{r}]<stderr>:Terminated" in output)]
        assert sorted(survivors + ended_by_launcher) == [0, 2], output[-4000:]
        if ended_by_launcher:
            failed = re.search(r"Terminating remaining workers after failure of Process (\d+)", output)
            assert failed and int(failed[1]) in (1, *survivors), output[-4000:]
    else:   # Open MPI may terminate the survivors itself before they can print
        assert survivors == [0, 2] or "mpirun" in output or "MPI" in output, output[-4000:]
    print(f"{controller}/{method}/{how}: job of {seconds:.1f} s ended {after_death:.1f} s after rank 1 "
          f"died, survivors reporting {survivors}")
