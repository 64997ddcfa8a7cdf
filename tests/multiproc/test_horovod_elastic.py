"""Elastic Horovod (horovodrun --gloo --min-np/--max-np with a host discovery script) through
2 -> 3 ranks, a worker killed with SIGKILL (3 -> 2, rolled back to the last commit) and 2 -> 1
ranks (workers/elastic_common.py has the schedule). Every step on every rank checks identical
weights, stats() at the new N, identical step counters and, for the exclusive methods, no build-up
(union = sum of counts); with the momentum correction (PyTorch's "topk-momentum"), every process
checks its residual and velocity went on exactly from its last commit; the final losses are
compared with an uninterrupted 2-rank run of the same steps, and the residual norms of the ranks
that left are reported."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.multiproc.launch import BIN, REPO, WORKERS, job_env

pytestmark = pytest.mark.multiproc


def elastic_run(worker: str, directory: Path, static: bool, timeout: float, *options: str) -> str:
    """One elastic job, from 2 ranks."""
    (directory / "hosts").write_text("localhost:2\n")
    discover = directory / "discover.sh"
    discover.write_text(f"#!/bin/sh\ncat {directory / 'hosts'}\n")
    discover.chmod(0o755)
    env = job_env()
    cmd = [str(BIN / "horovodrun"), "--gloo", "--network-interface", "lo", "-np", "2", "--min-np", "1",
           "--max-np", "3", "--host-discovery-script", str(discover),
           sys.executable, str(WORKERS / worker), "--dir", str(directory), *(["--static"] if static else []),
           *options]
    result = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout,
                            check=False)
    output = result.stdout + result.stderr
    tail = "\n".join(line for line in output.splitlines() if "I0000" not in line)[-5000:]
    assert result.returncode == 0, f"elastic job failed (exit {result.returncode}):\n{tail}"
    (directory / "stdout").write_text(result.stdout)
    return result.stdout


def finals(stdout: str) -> dict[str, dict]:
    out = {}
    for line in stdout.splitlines():
        match = re.search(r"FINAL (\S+) loss=(\S+) step=(\d+) world_size=(\d+) resets=(\d+) "
                          r"departed=\[([\d, ]*)\] departed_norm=(\S+)", line)
        if match:
            out[match[1]] = {"loss": float(match[2]), "step": int(match[3]), "size": int(match[4]),
                             "resets": int(match[5]), "departed": match[6], "norm": float(match[7])}
    return out


def check_elastic_job(worker: str, methods: tuple[str, ...], tmp_path: Path, timeout: float,
                      loss_ratio: float = 1.25, loss_ratios: dict[str, float] | None = None) -> None:
    (tmp_path / "elastic").mkdir()
    (tmp_path / "static").mkdir()
    elastic = elastic_run(worker, tmp_path / "elastic", False, timeout)
    static = finals(elastic_run(worker, tmp_path / "static", True, timeout))
    got = finals(elastic)
    assert "KILLING myself" in elastic and "PASSED rank=0 size=1 sizes=[2, 3, 2, 1]" in elastic, elastic
    for method in methods:
        for size in (2, 3, 1):
            assert re.search(rf"CHECKED {method} size={size} ", elastic), f"{method}: no check at N={size}"
        # After the kill: rolled back to the commit at step 15; the victim (rank 2, or rank 0 where
        # Horovod put host 127.0.0.1 first) left with its residual.
        killed = re.search(rf"CHECKED {method} size=2 step=15 resets=2 departed=\[\d\] "
                           r"departed_norm=(\S+)", elastic)
        assert killed and float(killed[1]) > 0, f"{method}: the killed rank is not accounted\n{elastic}"
        final, reference = got[method], static[method]
        assert final["step"] == reference["step"] == 32 and final["size"] == 1 and final["resets"] == 3
        assert final["departed"] in ("0", "1") and final["norm"] > 0   # the rank removed at 2 -> 1
        assert reference["loss"] < 0.5 * 1.386   # both runs learned (chance: ln 4)
        bound = (loss_ratios or {}).get(method, loss_ratio)
        assert final["loss"] < bound * reference["loss"], (method, final, reference)


@pytest.mark.timeout(900)
def test_torch_elastic_every_whole_model_and_per_tensor_method(tmp_path):
    methods = ("exdyna", "exdyna-histogram", "deft", "lags", "topk-momentum", "topk")
    # With the momentum correction the residual holds accumulated velocity, several times the
    # others' unsent mass: the ranks that leave take more with them (departed_residual_norm 8.9
    # against 1.2-2.1 for the others in one run, whose final loss was 1.42x the static run's; the
    # exactness of what the survivors keep is checked at every step instead).
    check_elastic_job("torch_elastic.py", methods, tmp_path, timeout=420, loss_ratios={"topk-momentum": 1.75})
    # The momentum correction's velocity went on from each survivor's last commit at every reset
    # (checked exactly by the worker at every step): the newcomer at 3 ranks started from
    # nothing, every other process of the job after a reset from its commit.
    elastic = (tmp_path / "elastic" / "stdout").read_text()
    continued = re.findall(r"CONTINUED topk-momentum size=(\d) step=(\d+) rank=\d from=(.+)", elastic)
    assert ("3", "8", "nothing") in continued, continued
    for size, step in (("3", "8"), ("2", "15"), ("1", "24")):
        assert (size, step, "its last commit") in continued, (size, step, continued)


@pytest.mark.timeout(900)
def test_tensorflow_elastic_whole_model_and_per_tensor_method(tmp_path):
    """ExDyna (one blocking py_function per step) and TopK (per-tensor phases joined by Horovod
    graph ops): a newcomer traces and optimizes its step while the survivors run theirs."""
    # Which process gets which rank (and so which data and which residual) after a reset is up to
    # Horovod's host order, so the trajectory differs from run to run: TopK's small Keras model once
    # ended 26% above the static run's loss (torch's runs: 5-11%), so the bound here is looser.
    check_elastic_job("tf_elastic.py", ("exdyna", "topk"), tmp_path, timeout=420, loss_ratio=1.5)


@pytest.mark.timeout(300)
def test_tensorflow_elastic_run_raises_what_the_step_raises(tmp_path):
    """hvd_sparse.tensorflow.elastic.run lets an error from inside a step through (ranks that
    disagree, nonfinite="raise"), where Horovod's wrapper returns None as if training had ended."""
    stdout = elastic_run("tf_elastic.py", tmp_path, False, 240, "--fail")
    assert stdout.count("OUTCOME raised UnknownError") == 2, stdout
