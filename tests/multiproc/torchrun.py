"""Start real torchrun jobs from the tests: one agent (``--standalone``, a free port) for one host,
or several agents meeting at a c10d rendezvous on localhost, as on several hosts (``--nnodes``)."""

from __future__ import annotations

import contextlib
import re
import socket
import subprocess
import tempfile
import uuid

from tests.multiproc.launch import BIN, REPO, WORKERS, assert_passed, job_env


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def torchrun(worker: str, size: int, args: list[str] | None = None, nnodes: int = 1,
             timeout: float = 240) -> subprocess.CompletedProcess:
    """Run ``workers/<worker>`` (or a script by absolute path) on ``size`` ranks: ``nnodes``
    torchrun agents of size // nnodes processes each. Returns the agents' outputs joined, and the
    worst exit code."""
    script = [str(WORKERS / worker), *(args or [])]
    per_node = size // nnodes
    if nnodes == 1:
        commands = [[str(BIN / "torchrun"), "--standalone", f"--nproc_per_node={size}", *script]]
    else:
        endpoint, run_id = f"127.0.0.1:{free_port()}", uuid.uuid4().hex[:8]
        commands = [[str(BIN / "torchrun"), f"--nnodes={nnodes}", f"--nproc_per_node={per_node}",
                     f"--node_rank={node}", "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}",
                     f"--rdzv-id={run_id}", *script] for node in range(nnodes)]
    # Files, not pipes: an agent blocked on a full pipe while another is waited for would hang.
    with contextlib.ExitStack() as stack:
        files = [(stack.enter_context(tempfile.TemporaryFile("w+")),
                  stack.enter_context(tempfile.TemporaryFile("w+"))) for _ in commands]
        # A rank killed by a signal dumps every thread's Python stack (faulthandler) to stderr.
        env = {**job_env(), "PYTHONFAULTHANDLER": "1"}
        agents = [subprocess.Popen(command, env=env, cwd=REPO, stdout=out, stderr=err, text=True)
                  for command, (out, err) in zip(commands, files, strict=True)]
        try:
            for agent in agents:
                agent.wait(timeout=timeout)
        finally:
            for agent in agents:   # a hang ends here: the agent passes SIGTERM on to its workers
                stop(agent)
        for f in (f for pair in files for f in pair):
            f.seek(0)
        stdout = "".join(out.read() for out, _ in files)
        stderr = "".join(err.read() for _, err in files)
    code = max((agent.returncode for agent in agents), key=abs)
    return subprocess.CompletedProcess(commands[0], code, stdout, stderr)


def assert_ranks_passed(result: subprocess.CompletedProcess, size: int) -> str:
    """``launch.assert_passed``, with the ranks' own error lines first: torchrun's report of a
    failed worker would otherwise fill the message's tail."""
    print_failure(result)
    return assert_passed(result, size)


def print_failure(result: subprocess.CompletedProcess) -> None:
    """A failed job's telling stderr lines (errors, tracebacks, a fatal signal's first lines), which
    pytest shows with the failure: the tail alone is torchrun's report and faulthandler's list of
    extension modules."""
    if result.returncode != 0:
        telling = [line for line in result.stderr.splitlines()
                   if re.search(r"Fatal|terminate|Error|error:|Traceback|File \"|Thread 0x|signal", line)]
        print("\n".join(line[:300] for line in telling[:150]))


def stop(agent: subprocess.Popen) -> None:
    if agent.poll() is None:
        agent.terminate()
        try:
            agent.wait(timeout=20)
        except subprocess.TimeoutExpired:
            agent.kill()
            agent.wait()
