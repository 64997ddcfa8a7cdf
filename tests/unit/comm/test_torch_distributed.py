"""The torch.distributed driver (hvd_sparse/comm/torch_distributed.py): phases run in order with
every collective's result in place, variable-length allgathers, protocols joined phase by phase,
and the worker thread that keeps every collective in one order. On one rank here; the driver on
2 and 4 ranks is checked against the local driver in tests/multiproc/test_ddp.py."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from hvd_sparse.comm import ALLGATHER, ALLREDUCE, BROADCAST, NEIGHBOURS, Collective, run_together
from hvd_sparse.comm.torch_distributed import SerialWorker, TorchDistributedComm
from tests.unit.single_rank import single_rank_group


@pytest.fixture(scope="module")
def comm():
    import torch.distributed as dist

    with single_rank_group():
        yield TorchDistributedComm(dist.group.WORLD)


def test_one_rank_phase_returns_every_result_in_phase_order(comm):
    sent = torch.tensor([1.0, 2.0])
    phase = [Collective(ALLGATHER, "a", torch.arange(3, dtype=torch.int32)),
             Collective(ALLREDUCE, "b", sent),
             Collective(BROADCAST, "c", torch.tensor([7.0]), root=0),
             Collective(ALLGATHER, "d", torch.zeros((0, 2))),
             Collective(NEIGHBOURS, "e", torch.tensor([5, 6]))]
    gathered, summed, root, empty, (left, right) = comm.execute(phase)
    assert gathered.tolist() == [0, 1, 2] and gathered.dtype == torch.int32
    assert summed.tolist() == [1.0, 2.0] and summed is not sent   # the sent tensor stays untouched
    assert root.tolist() == [7.0]
    assert empty.shape == (0, 2)
    assert left.tolist() == right.tolist() == [5, 6]
    assert comm.wait_seconds >= 0


def test_a_zero_dimensional_allgather_is_refused(comm):
    with pytest.raises(ValueError, match="1-element vector"):
        comm.execute([Collective(ALLGATHER, "x", torch.tensor(1.0))])


def protocol(rounds: int, tag: str, fail_at: int | None = None):
    got = []
    for r in range(rounds):
        if r == fail_at:
            raise FloatingPointError(f"{tag} failed")
        (value,) = yield [Collective(ALLREDUCE, f"{tag}.{r}", np.array([r]))]
        got.append(int(value[0]))
    return got


def test_run_together_joins_the_next_phase_of_every_protocol_in_order():
    joined = []

    def execute(phase):
        joined.append([c.name for c in phase])
        return [c.tensor * 10 for c in phase]

    results, errors = run_together({"a": protocol(3, "a"), "b": protocol(1, "b"),
                                    "c": protocol(2, "c", fail_at=1)}, execute)
    assert joined == [["a.0", "b.0", "c.0"], ["a.1"], ["a.2"]]
    assert results == {"a": [0, 10, 20], "b": [0]}
    assert list(errors) == ["c"] and isinstance(errors["c"], FloatingPointError)


def test_the_worker_runs_jobs_in_order_on_one_thread_and_call_returns_or_raises():
    worker = SerialWorker("test")
    seen, threads = [], set()
    for i in range(20):
        worker.submit(lambda i=i: (seen.append(i), threads.add(threading.get_ident())))
    assert worker.call(lambda: len(seen)) == 20
    assert seen == list(range(20)) and len(threads) == 1 and threading.get_ident() not in threads
    with pytest.raises(KeyError, match="missing"):
        worker.call(lambda: {}["missing"])
    worker.submit(lambda: 1 / 0)   # a job's own failure is printed; the worker goes on
    assert worker.call(lambda: worker.call(lambda: "nested")) == "nested"


def test_the_worker_lets_go_of_a_job_once_run_and_ends_at_close():
    """An idle worker keeps nothing of its owner alive (a DDP state and DDP's buffers: a process
    building one model after another grew by the model's size each time)."""
    import gc
    import weakref

    class Owner:
        def work(self) -> None:
            pass

    owner, worker = Owner(), SerialWorker("test")
    alive = weakref.ref(owner)
    worker.submit(owner.work)
    worker.call(lambda: None)
    del owner
    gc.collect()
    assert alive() is None
    thread = worker._thread
    worker.close()
    thread.join(timeout=10)
    assert not thread.is_alive()
    with pytest.raises(RuntimeError, match="closed"):
        worker.submit(lambda: None)
