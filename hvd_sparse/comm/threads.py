"""N ranks as threads of one process, their collectives matched by name as Horovod matches them:
the local driver under the Horovod faces in unit tests. A face then runs unchanged -- its hooks,
its asynchronous handles, its graph ops -- with each rank's calls on a thread of its own, and a
rank that never issues what the others wait for fails with ``RankMismatchError`` after
``timeout`` seconds instead of hanging.

``ThreadGroup.comm(rank)`` has the interface of the Horovod drivers (``start``/``wait``/``poll``
and ``execute`` of comm/horovod_torch.py; ``graph_op`` and ``execute`` of comm/horovod_tf.py).
The results are computed by ``LocalGroup``'s collectives, through the group's backend.
"""

from __future__ import annotations

import threading
from typing import Any

from ..backends import Backend
from ..errors import RankMismatchError
from .local import LocalGroup
from .protocol import Collective, Phase


class ThreadGroup:
    """``size`` ranks, one thread each (the caller starts them), sharing named collectives."""

    def __init__(self, size: int, backend: Backend | str = "numpy", timeout: float = 30.0):
        self.size = size
        self.timeout = timeout
        self._local = LocalGroup(size, backend)
        self._ready = threading.Condition()
        # A collective is its name and how often the rank issued that name before (a name comes
        # back every step): (name, n) -> rank -> its collective, and -> every rank's result.
        self._issued: dict[tuple[str, int], dict[int, Collective]] = {}
        self._results: dict[tuple[str, int], list] = {}
        self._times: list[dict[str, int]] = [{} for _ in range(size)]

    def comm(self, rank: int) -> ThreadComm:
        """Rank ``rank``'s communication layer."""
        return ThreadComm(self, rank)

    def start(self, rank: int, c: Collective) -> tuple[str, int]:
        """Rank ``rank`` issues ``c``; the last rank to issue it computes every result."""
        with self._ready:
            key = (c.name, self._times[rank].get(c.name, 0))
            self._times[rank][c.name] = key[1] + 1
            contributions = self._issued.setdefault(key, {})
            contributions[rank] = c
            if len(contributions) == self.size:
                ordered = [contributions[r] for r in range(self.size)]
                self._local._check_agreement([[x] for x in ordered])
                self._results[key] = self._local._collective(ordered[0], [x.tensor for x in ordered])
                del self._issued[key]
                self._ready.notify_all()
        return key

    def wait(self, rank: int, key: tuple[str, int]) -> Any:
        """Rank ``rank``'s result of collective ``key``, once every rank has issued it."""
        with self._ready:
            if not self._ready.wait_for(lambda: key in self._results, timeout=self.timeout):
                issued = sorted(self._issued.get(key, {}))
                raise RankMismatchError(
                    f"collective {key[0]!r}: only ranks {issued} issued it within {self.timeout} s "
                    "(a real job would hang)")
            results = self._results[key]
            value, results[rank] = results[rank], None
            if all(r is None for r in results):
                del self._results[key]
            return value

    def done(self, key: tuple[str, int]) -> bool:
        """Whether every rank has issued collective ``key`` (``wait`` returns at once)."""
        with self._ready:
            return key in self._results


class ThreadComm:
    """One rank's view of a ``ThreadGroup``: the interface of the Horovod drivers."""

    def __init__(self, group: ThreadGroup, rank: int):
        self.group, self.rank, self.size = group, rank, group.size
        self.process_set = None

    def start(self, c: Collective) -> tuple[str, int]:
        """Issue ``c`` asynchronously; the handle ``wait`` takes."""
        return self.group.start(self.rank, c)

    def wait(self, handle: tuple[str, int]) -> Any:
        """The result of a started collective, waiting for every rank to issue it."""
        return self.group.wait(self.rank, handle)

    def poll(self, handle: tuple[str, int]) -> bool:
        """Whether the collective has completed; never blocks."""
        return self.group.done(handle)

    def execute(self, phase: Phase) -> list:
        """Run a phase blocking: issue every collective, then wait for each."""
        handles = [self.start(c) for c in phase]
        return [self.wait(h) for h in handles]

    def graph_op(self, op: str, tensor: Any, name: str, root: int = 0) -> Any:
        """A TensorFlow graph op running the collective (``tf.py_function`` around ``execute``)."""
        import tensorflow as tf

        def run(x: Any) -> Any:
            return self.execute([Collective(op, name, x, root)])[0]
        return tf.py_function(run, [tensor], Tout=tensor.dtype)


def run_ranks(size: int, body: Any, timeout: float = 120.0) -> list:
    """Run ``body(rank)`` on ``size`` threads; every rank's result, or the first rank's error,
    with ``ranks_raised`` listing who raised (as ``LocalGroup.run``)."""
    results: list = [None] * size
    errors: dict[int, BaseException] = {}

    def target(rank: int) -> None:
        try:
            results[rank] = body(rank)
        except BaseException as error:   # reported below, per rank
            errors[rank] = error

    threads = [threading.Thread(target=target, args=(r,), daemon=True) for r in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout)
    if any(thread.is_alive() for thread in threads):
        raise RankMismatchError(f"ranks still running after {timeout} s (a real job would hang)")
    if errors:
        first = errors[min(errors)]
        first.__dict__["ranks_raised"] = sorted(errors)
        raise first
    return results

