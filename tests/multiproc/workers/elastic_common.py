"""What the elastic workers share (framework-free): the schedule of world changes, the hosts file
the discovery script prints, and the checks made after every step.

The job starts on ``localhost:2``. Rank 0 rewrites the hosts file at fixed steps; Horovod's driver
polls the discovery script, and the workers see the change at their next ``commit()``:

* step GROW: ``localhost:2`` + ``127.0.0.1:1`` -> 3 ranks (a newcomer joins; ``sync``);
* step KILL (at 3 ranks): the worker on host 127.0.0.1 kills itself (SIGKILL) between its backward
  pass and its optimizer step: the survivors fail inside a collective, roll back to the last commit
  and go on with 2 ranks (Horovod blacklists 127.0.0.1; a distinct host name keeps localhost's
  workers alive);
* step SHRINK (at 2 ranks): ``localhost:1`` -> 1 rank (hosts removed only: Horovod resets without
  ``sync``);
* the job ends at step END.

Between a hosts-file change and the reset, workers only commit (and sleep), so every run trains the
same number of steps. ``--static`` runs the same steps without any change (the reference run).
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import signal
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np

GROW, KILL, SHRINK, END = 8, 16, 24, 32
COMMIT_EVERY = 3
VICTIM_HOST = "127.0.0.1"
N_IN, N_HIDDEN, N_OUT = 16, 24, 4
_STACK_FILES = []   # open for the process's life: faulthandler writes into them on SIGUSR1


def job_arguments(methods: Iterable[str], *flags: tuple[str, str]) -> argparse.Namespace:
    """The worker's command line: --dir (the job's folder), --methods (default: every one the
    worker knows), --static (the same steps without a world change), and ``flags`` (name, help)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    parser.add_argument("--methods", default=",".join(methods))
    parser.add_argument("--static", action="store_true")
    for flag, text in flags:
        parser.add_argument(flag, action="store_true", help=text)
    args = parser.parse_args()
    stacks = open(f"{args.dir}/stacks.{os.getpid()}", "w")  # noqa: SIM115  (see _STACK_FILES)
    _STACK_FILES.append(stacks)
    faulthandler.register(signal.SIGUSR1, file=stacks)   # stacks on demand, should a job ever hang
    return args


def hosts_file(directory: str) -> Path:
    return Path(directory) / "hosts"


def write_hosts(directory: str, text: str) -> None:
    path = hosts_file(directory)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)   # the discovery script never reads half a file


def killed(directory: str) -> bool:
    return (Path(directory) / "killed").exists()


def expected_size(step: int, static: bool, directory: str) -> int:
    if static or step < GROW:
        return 2
    if step < SHRINK:
        return 2 if killed(directory) else 3
    return 1


def world_change_due(step: int, size: int, directory: str, rank: int, static: bool) -> bool:
    """Rank 0 asks Horovod for the next world when the schedule says so; every rank then waits
    (commit + sleep) until the reset comes. True while waiting."""
    want = expected_size(step, static, directory)
    if size == want:
        return False
    if rank == 0:
        text = {3: "localhost:2\n127.0.0.1:1\n", 2: "localhost:2\n", 1: "localhost:1\n"}[want]
        if hosts_file(directory).read_text() != text and want != 2:
            write_hosts(directory, text)
    return True


def is_victim(step: int, size: int, static: bool) -> bool:
    return (not static and step == KILL and size == 3
            and os.environ.get("HOROVOD_HOSTNAME") == VICTIM_HOST)


def die(directory: str) -> None:
    """SIGKILL this process, leaving a mark so the survivors expect 2 ranks from now on."""
    (Path(directory) / "killed").write_text(str(os.getpid()))
    print(f"KILLING myself (host {VICTIM_HOST}) at step {KILL}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def data(seed: int, step: int, rank: int, batch: int = 32) -> tuple[np.ndarray, np.ndarray]:
    """A fixed teacher (seed 0) labels random inputs; each rank draws its own batch."""
    teacher = np.random.default_rng(0).standard_normal((N_IN, N_OUT))
    rng = np.random.default_rng([seed, step, rank])
    x = rng.standard_normal((batch, N_IN)).astype(np.float32)
    return x, np.argmax(x @ teacher, axis=1).astype(np.int64)


def eval_data() -> tuple[np.ndarray, np.ndarray]:
    return data(99, 0, 0, batch=512)


def check_step(name: str, rows: np.ndarray, size: int, exclusive: bool) -> None:
    """``rows``: every rank's [weights digest..., world_size, step, union, sum of counts (+ common),
    number of counts], by rank. Raises AssertionError naming what broke."""
    assert rows.shape[0] == size, f"{name}: {rows.shape[0]} rows at size {size}"
    weights, facts = rows[:, :-5], rows[:, -5:]
    assert np.all(weights == weights[0]), f"{name}: weights differ across ranks {weights}"
    assert np.all(facts[:, 0] == size), f"{name}: stats world_size {facts[:, 0]} != {size}"
    assert np.all(facts[:, 1] == facts[0, 1]), f"{name}: step counters differ {facts[:, 1]}"
    if exclusive:
        assert np.all(facts[:, 2] == facts[:, 3]), \
            f"{name}: union {facts[:, 2]} != sum of counts {facts[:, 3]}"
        assert np.all(facts[:, 4] == size), f"{name}: {facts[:, 4]} counts for {size} ranks"


class Sizes(list):
    """The world sizes a job went through, in order."""

    def is_new(self, size: int) -> bool:
        return not self or self[-1] != size

    def note(self, size: int) -> None:
        if self.is_new(size):
            self.append(size)


def check_method(method: str, weights: np.ndarray, stats: dict, allgather: Callable, step: int,
                 size: int, rank: int, exclusive: bool, announce: bool, checked: bool = True) -> None:
    """After a step: every rank's weight digest and stats facts (``allgather(row, name)`` -> the
    rows by rank) pass ``check_step`` (unless not ``checked``); rank 0 prints CHECKED at the first
    step of a world size (``announce``)."""
    flat = weights.astype(np.float64)
    row = np.array([flat.sum(), (flat * flat).sum(), *stat_facts(stats)])
    rows = allgather(row, f"check.{method}")
    if checked:
        check_step(method, rows, size, exclusive)
    if rank == 0 and announce:
        print(f"CHECKED {method} size={size} step={step} {elastic_facts(stats)}", flush=True)


def report_final(method: str, loss: float, step: int, stats: dict) -> None:
    """The line test_horovod_elastic.py compares with the static run's."""
    print(f"FINAL {method} loss={loss:.5f} step={step} world_size={stats.get('world_size')} "
          f"{elastic_facts(stats)}", flush=True)


def elastic_facts(stats: dict) -> str:
    return (f"resets={stats.get('elastic_resets')} departed={stats.get('departed_ranks')} "
            f"departed_norm={stats.get('departed_residual_norm')}")


def stat_facts(stats: dict) -> list[float]:
    """The last five entries of a check row, from a compressor's stats()."""
    counts = stats.get("counts") or []
    return [stats.get("world_size", -1), stats["step"], stats["union"],
            sum(counts) + stats.get("common", 0), len(counts)]


def wait_a_little() -> None:
    time.sleep(0.3)
