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

import os
import signal
import time
from pathlib import Path

import numpy as np

GROW, KILL, SHRINK, END = 8, 16, 24, 32
COMMIT_EVERY = 3
VICTIM_HOST = "127.0.0.1"
N_IN, N_HIDDEN, N_OUT = 16, 24, 4


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


def stat_facts(stats: dict) -> list[float]:
    """The last five entries of a check row, from a compressor's stats()."""
    counts = stats.get("counts") or []
    return [stats.get("world_size", -1), stats["step"], stats["union"],
            sum(counts) + stats.get("common", 0), len(counts)]


def wait_a_little() -> None:
    time.sleep(0.3)
