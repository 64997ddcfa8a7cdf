"""The Horovod PyTorch face (hvd_sparse/torch/compressor.py) driven in this process: two ranks as
threads, each calling ``compress`` from its parameters' gradient hooks and ``decompress`` before
its optimizer steps, as ``hvd.DistributedOptimizer`` does, with collectives matched by name
(comm/threads.py). The face's decisions are compared bit for bit with the engine run on the same
gradients by the lockstep local driver; failures (a non-finite step, ranks that disagree) end on
every rank. Real horovodrun jobs: tests/multiproc/test_horovod_*.py."""

from __future__ import annotations

import pytest
import torch

import hvd_sparse
from hvd_sparse.backends import get_backend
from hvd_sparse.comm.local import LocalGroup
from hvd_sparse.comm.threads import ThreadGroup, run_ranks
from hvd_sparse.engine import Engine
from hvd_sparse.engine.planning import face_plan, step_members
from hvd_sparse.errors import RankMismatchError

hvd = pytest.importorskip("horovod.torch")
hs = pytest.importorskip("hvd_sparse.torch")

SIZE, STEPS, LR = 2, 4, 0.1


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(12, 20), torch.nn.Tanh(), torch.nn.Linear(20, 3))


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, 12, generator=generator), torch.randint(0, 3, (8,), generator=generator)


class LocalDistributedOptimizer:
    """What ``hvd.DistributedOptimizer`` does with a compressor: ``compress`` in each parameter's
    gradient hook (the placeholder's allreduce is left out: its result is only waited for), then
    ``decompress`` of every gradient before the wrapped optimizer steps."""

    op = hvd.Average

    def __init__(self, optimizer: torch.optim.Optimizer, model: torch.nn.Module, compression):
        self._compression, self._optimizer = compression, optimizer
        self.param_groups = optimizer.param_groups
        self._pending: list = []
        for param in model.parameters():
            param.register_post_accumulate_grad_hook(self._hook)

    def _hook(self, param: torch.nn.Parameter) -> None:
        self._pending.append((param, *self._compression.compress(param.grad)))

    def step(self) -> None:
        pending, self._pending = self._pending, []
        try:
            for param, placeholder, ctx in pending:
                param.grad = self._compression.decompress(placeholder, ctx)
            self._optimizer.step()
        finally:
            for param, _, _ in pending:
                param.grad = None


def on_threads(group: ThreadGroup, rank: int, compressor) -> None:
    """Run ``compressor``'s collectives on ``group`` as rank ``rank``."""
    compressor._make_comm = lambda: group.comm(rank)
    compressor._current_world = lambda: (rank, SIZE)


def train_face(make_compressor, steps: int = STEPS, nan_at: tuple[int, int] | None = None) -> list:
    """Every rank's parameters after ``steps`` steps through the face, and each step's outcome."""
    group = ThreadGroup(SIZE, "torch", timeout=20)
    models = [make_model() for _ in range(SIZE)]   # here: the threads would share the seeded RNG

    def rank_body(rank: int) -> tuple[list[torch.Tensor], list[str]]:
        model = models[rank]
        compressor = make_compressor(rank, model)
        on_threads(group, rank, compressor)
        optimizer = LocalDistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR), model, compressor)
        outcomes = []
        for step in range(steps):
            x, y = batch(rank, step)
            if nan_at == (rank, step):
                x = x * float("nan")
            torch.nn.functional.cross_entropy(model(x), y).backward()
            try:
                optimizer.step()
                outcomes.append("ok")
            except FloatingPointError:
                outcomes.append("raised")
        return [p.detach().clone() for p in model.parameters()], outcomes

    return run_ranks(SIZE, rank_body, timeout=60)


def train_reference(make_algorithm, steps: int = STEPS) -> list[torch.Tensor]:
    """The same training with the engine run on the lockstep local driver, bucket by bucket over
    the plan a face makes, then the method's end of step."""
    algorithm = make_algorithm()
    backend = get_backend("torch")
    engines = [Engine(algorithm, backend, r, SIZE, write_into_inputs=True) for r in range(SIZE)]
    group = LocalGroup(SIZE, backend)
    models = [make_model() for _ in range(SIZE)]
    optimizers = [torch.optim.SGD(model.parameters(), lr=LR) for model in models]
    names = [n for n, _ in models[0].named_parameters()]
    params = [p for _, p in models[0].named_parameters()]
    plan = face_plan(algorithm, names, [p.numel() for p in params], ["float32"] * len(params))
    for step in range(steps):
        grads = []
        for rank, model in enumerate(models):
            model.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(model(batch(rank, step)[0]), batch(rank, step)[1]).backward()
            grads.append(dict(model.named_parameters()))
        for bucket, members in plan:
            protocols = [engines[r].step(bucket, [grads[r][m].grad for m in members],
                                         members=step_members(algorithm, members)) for r in range(SIZE)]
            group.run(protocols)
        group.run([engine.end_step(None) for engine in engines])
        for optimizer in optimizers:
            optimizer.step()
    return [p.detach() for p in models[0].parameters()]


@pytest.mark.parametrize("method", [
    lambda: hvd_sparse.algorithms.TopK(0.1),                 # packed buckets, started in backward
    lambda: hvd_sparse.algorithms.ExDyna(0.1, num_blocks=8),  # the whole model, at decompress
    lambda: hvd_sparse.algorithms.DGC(0.1, momentum=0.9),     # a correction through the face
], ids=["topk", "exdyna", "dgc"])
def test_the_face_makes_the_engines_decisions_on_every_rank(method):
    def make(rank, model):
        return hs.SparseCompressor(method(), named_parameters=model.named_parameters())

    results = train_face(make)
    reference = train_reference(method)
    for params, outcomes in results:
        assert outcomes == ["ok"] * STEPS
        for got, want in zip(params, reference, strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_without_named_parameters_gradients_are_keyed_by_hook_order():
    results = train_face(lambda rank, model: hs.TopK(0.1))
    for got, want in zip(results[0][0], results[1][0], strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    reference = train_reference(lambda: hvd_sparse.algorithms.TopK(0.1))
    for got, want in zip(results[0][0], reference, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_non_finite_step_raises_on_every_rank_and_is_applied_nowhere():
    def make(rank, model):
        return hs.TopK(0.1, named_parameters=model.named_parameters(), nonfinite="raise")

    results = train_face(make, steps=3, nan_at=(1, 1))
    assert [outcomes for _, outcomes in results] == [["ok", "raised", "ok"]] * SIZE
    for got, want in zip(results[0][0], results[1][0], strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_ranks_that_disagree_fail_together_before_any_exchange():
    def make(rank, model):
        return hs.TopK(0.1 if rank == 0 else 0.2, named_parameters=model.named_parameters())

    with pytest.raises(RankMismatchError, match=r"density=0\.1 on rank 0, 0\.2 on rank 1") as raised:
        train_face(make, steps=1)
    assert raised.value.ranks_raised == [0, 1]


def test_a_rank_whose_collective_never_comes_fails_instead_of_hanging():
    group = ThreadGroup(SIZE, "torch", timeout=0.5)
    compressor = hs.TopK(0.1)
    on_threads(group, 0, compressor)
    with pytest.raises(RankMismatchError, match="a real job would hang"):
        compressor.compress(torch.ones(3))   # the configuration check waits for rank 1
