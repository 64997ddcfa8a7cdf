"""The DDP face (hvd_sparse/torch/ddp.py) on one rank, in this process: state classes for every
method, the hook inside a real DistributedDataParallel (layout learnt at the first step, buckets
rebuilt by DDP after it), exact error feedback, checkpoints, statistics, and the refusals, each
naming its fix. Real 2- and 4-rank torchrun jobs: tests/multiproc/test_ddp.py."""

from __future__ import annotations

import inspect
import re
import subprocess
import sys
import time
from unittest import mock

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import hvd_sparse
from hvd_sparse import ConfigurationError, UnsupportedTensorError, algorithms
from hvd_sparse.monitor import StatsLogger
from tests.multiproc.workers.checks import by_tensor
from tests.unit.single_rank import single_rank_group

ddp = pytest.importorskip("hvd_sparse.torch.ddp")


@pytest.fixture(scope="module", autouse=True)
def group():
    with single_rank_group():
        yield


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 24), torch.nn.Tanh(), torch.nn.Linear(24, 5))


def train(model: torch.nn.Module, state, steps: int, *, bucket_cap_mb: float = 25, seed: int = 1,
          check=None, **ddp_options) -> DistributedDataParallel:
    wrapped = DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb, **ddp_options)
    wrapped.register_comm_hook(state, ddp.hook)
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(seed)
    for step in range(steps):
        x, y = torch.randn(8, 16, generator=generator), torch.randint(0, 5, (8,), generator=generator)
        optimizer.zero_grad()
        old = state.state_dict()["buckets"]
        raw = {}
        hooks = [p.register_hook(lambda g, n=n, r=raw: r.__setitem__(n, g.clone()))
                 for n, p in model.named_parameters()]
        torch.nn.functional.cross_entropy(wrapped(x), y).backward()
        for h in hooks:
            h.remove()
        if check is not None:
            check(step, raw, {n: p.grad.clone() for n, p in model.named_parameters()}, old,
                  state.state_dict()["buckets"])
        optimizer.step()
    return wrapped


def test_every_method_has_a_state_class_and_create_builds_it():
    for cls in algorithms.METHODS:
        face = getattr(ddp, cls.__name__)
        assert face is ddp.FACES[cls.__name__] and issubclass(face, ddp.SparseHookState)
        state = hvd_sparse.create(cls.name, framework="DDP", density=0.05, nonfinite="ignore")
        assert type(state) is face and type(state.algorithm) is cls and state.nonfinite == "ignore"
        options = inspect.signature(face).parameters
        assert {"density", "named_parameters", "process_group", "nonfinite", "timeout"} <= set(options)
        assert "process_group" in face.__doc__ and "named_parameters" in face.__doc__
    assert repr(ddp.TopK(0.05)).startswith("hvd_sparse.torch.ddp.TopK(density=0.05")
    assert "hook" in ddp.__all__ and "ExDyna" in ddp.__all__


@pytest.mark.parametrize("packed", [True, False])
def test_per_tensor_topk_applies_the_selection_and_keeps_the_rest_exactly(packed):
    """Per-tensor TopK packs the model's four tensors into one engine bucket spanning several DDP
    buckets (``planning.pack_tensors``), or, unpacked, takes a bucket per parameter: the same selection."""
    model = make_model()
    state = ddp.TopK(density=0.1, named_parameters=model.named_parameters())
    state.algorithm.packs_tensors = packed
    names = [n for n, _ in model.named_parameters()]
    buckets = {"0.weight-2.bias"} if packed else set(names)

    def check(step, raw, applied, old, new):
        assert set(new) == buckets   # buckets by parameter name
        old, new = by_tensor(old), by_tensor(new)
        for name, grad in raw.items():
            acc = grad.reshape(-1).numpy() + (old[name]["residual"] if name in old else 0)
            k = max(1, int(0.1 * acc.size))
            top = np.sort(np.argsort(-np.abs(acc), kind="stable")[:k])
            expected = np.zeros_like(acc)
            expected[top] = acc[top]
            np.testing.assert_array_equal(applied[name].reshape(-1).numpy(), expected)
            np.testing.assert_array_equal(new[name]["residual"] + expected, acc)

    train(model, state, 6, bucket_cap_mb=0.001, check=check)   # several DDP buckets after step 0
    stats = state.stats()
    assert stats["step"] == 6 and stats["world_size"] == 1 and stats["buckets"] == len(buckets)
    assert stats["comm_wait_seconds"] >= 0 and stats["comm_inflight_seconds"] >= 0
    timeline = state.communication_timeline()
    assert set(timeline) == buckets | {"step"}
    assert all(0 <= issued <= done for issued, done in timeline.values())


@pytest.mark.parametrize("ddp_options", [{"find_unused_parameters": True}, {"gradient_as_bucket_view": True},
                                         {"static_graph": True}])
def test_whole_model_methods_run_once_per_step_on_the_model_in_parameter_order(ddp_options):
    model = make_model()
    state = ddp.ExDyna(density=0.1)   # no names: p0, p1, ... in parameter order
    sizes = [p.numel() for p in model.parameters()]

    def check(step, raw, applied, old, new):
        assert list(new) == ["model"]
        flat = np.concatenate([raw[n].reshape(-1).numpy() for n, _ in model.named_parameters()])
        acc = flat + (old["model"]["residual"] if old else 0)
        sent = np.concatenate([applied[n].reshape(-1).numpy() for n, _ in model.named_parameters()])
        np.testing.assert_array_equal(np.where(sent != 0, sent, new["model"]["residual"]), acc)
        assert sum(sizes) == acc.size

    train(model, state, 5, bucket_cap_mb=0.001, check=check, **ddp_options)
    assert state.stats()["step"] == 5 and state.stats()["own_partition"] == [0, sum(sizes)]
    assert list(state.state_dict()["buckets"]) == ["model"]
    assert len(state._steps.key_of) == 4 and sorted(state._steps.key_of.values()) == ["p0", "p1", "p2", "p3"]


def test_gradients_accumulated_under_no_sync_are_sparsified_once_per_synchronized_step():
    model = make_model()
    state = ddp.TopK(density=0.1, scope="model", named_parameters=model.named_parameters())
    wrapped = DistributedDataParallel(model)
    wrapped.register_comm_hook(state, ddp.hook)
    x = torch.randn(4, 16)
    with wrapped.no_sync():
        wrapped(x).sum().backward()
    wrapped(x).sum().backward()
    assert state.stats()["step"] == 1
    residual = state.state_dict()["buckets"]["model"]["residual"]
    applied = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).numpy()
    single = DistributedDataParallel(make_model())   # the same gradient from one pass, twice
    single(x).sum().backward()
    twice = 2 * torch.cat([p.grad.reshape(-1) for p in single.module.parameters()]).numpy()
    np.testing.assert_allclose(residual + applied, twice, rtol=1e-6, atol=1e-7)


def test_a_checkpoint_resumes_with_identical_decisions():
    def run(steps, resume_from=None):
        model = make_model()
        state = ddp.DEFT(density=0.1, named_parameters=model.named_parameters())
        if resume_from is not None:
            model.load_state_dict(resume_from[0])
            state.load_state_dict(resume_from[1])
        train(model, state, steps, seed=7 if resume_from is None else 8)
        return model, state

    model, state = run(3)
    saved = ({k: v.clone() for k, v in model.state_dict().items()}, state.state_dict())
    continued, continued_state = run(3, saved)
    again, again_state = run(3, saved)
    for a, b in zip(continued.parameters(), again.parameters(), strict=True):
        assert torch.equal(a, b)
    np.testing.assert_array_equal(continued_state.state_dict()["buckets"]["model"]["residual"],
                                  again_state.state_dict()["buckets"]["model"]["residual"])
    assert continued_state.stats()["step"] == 6


def test_statistics_log_through_the_stats_logger(tmp_path):
    model = make_model()
    state = ddp.Threshold(threshold=0.01, named_parameters=model.named_parameters())
    train(model, state, 2)
    lines = []
    logger = StatsLogger(state, every=1, keys=("density_actual", "bytes_sent"),
                         jsonl=tmp_path / "s.jsonl", printer=lines.append)
    assert logger(0) == state.average_stats(("density_actual", "bytes_sent"))
    assert lines and (tmp_path / "s.jsonl").read_text().count("\n") == 1


def test_nonfinite_raise_fails_backward_applies_nothing_and_training_goes_on():
    model = make_model()
    state = ddp.TopK(density=0.5, nonfinite="raise", named_parameters=model.named_parameters())
    wrapped = DistributedDataParallel(model)
    wrapped.register_comm_hook(state, ddp.hook)
    wrapped(torch.ones(2, 16)).sum().backward()   # step 1
    before = state.state_dict()["buckets"]
    wrapped.zero_grad()
    bad = torch.ones(2, 16)
    bad[0, 0] = float("nan")
    with pytest.raises(RuntimeError, match=r"FloatingPointError(.|\n)*skip optimizer\.step\(\)"):
        wrapped(bad).sum().backward()
    after = state.state_dict()["buckets"]
    assert all(after[k]["step"] == before[k]["step"] for k in before)   # the step is taken back
    wrapped.zero_grad()
    wrapped(torch.ones(2, 16)).sum().backward()   # DDP and the state go on
    assert state.stats()["step"] == 2


def test_the_hook_refuses_a_state_of_another_kind():
    wrapped = DistributedDataParallel(make_model())
    wrapped.register_comm_hook(None, ddp.hook)
    with pytest.raises(ConfigurationError, match=re.escape("register_comm_hook(hvd_sparse.torch.ddp.TopK")):
        wrapped(torch.ones(2, 16)).sum().backward()


def test_one_state_serves_one_model():
    state = ddp.TopK(density=0.5)
    train(make_model(), state, 1)
    with pytest.raises(ConfigurationError, match="one state per DDP model"):
        train(make_model(), state, 1)


def test_sparse_gradients_are_refused_naming_the_fix():
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4, sparse=True), torch.nn.Flatten(),
                                torch.nn.Linear(8, 2))
    wrapped = DistributedDataParallel(model)
    wrapped.register_comm_hook(ddp.TopK(density=0.5), ddp.hook)
    with pytest.raises(UnsupportedTensorError, match="sparse=False"):
        wrapped(torch.tensor([[1, 2]])).sum().backward()


def test_options_are_checked_when_the_state_is_built():
    with pytest.raises(ConfigurationError, match="timedelta"):
        ddp.TopK(density=0.1, timeout=30)
    with pytest.raises(ConfigurationError, match="nonfinite"):
        ddp.TopK(density=0.1, nonfinite="zero")
    with mock.patch.object(dist, "is_initialized", return_value=False), \
            pytest.raises(ConfigurationError, match="init_process_group"):
        ddp.TopK(density=0.1)


def test_the_ddp_face_imports_without_horovod_and_the_horovod_face_says_so():
    code = ("import sys\n"
            "sys.modules['horovod'] = None   # as if Horovod were not installed\n"
            "import hvd_sparse.torch.ddp as ddp\n"
            "import hvd_sparse.torch as hs\n"
            "assert 'TopK' in ddp.FACES and hs.FACES == {}\n"
            "try:\n"
            "    hs.TopK\n"
            "except ImportError as error:\n"
            "    print(error)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "needs horovod.torch" in result.stdout and "hvd_sparse.torch.ddp.TopK" in result.stdout


def test_a_state_dropped_or_closed_ends_its_thread_and_frees_its_engine():
    import gc
    import weakref

    for close in (False, True):
        model = make_model()
        state = ddp.TopK(density=0.2, named_parameters=model.named_parameters())
        wrapped = train(model, state, 2)
        thread, alive = state._worker._thread, weakref.ref(state)
        if close:
            state.close()
            with pytest.raises(RuntimeError, match="closed"):
                train(model, state, 1)
        del state, wrapped
        deadline = time.monotonic() + 10
        while thread.is_alive() and time.monotonic() < deadline:
            gc.collect()   # the finalizer closes the worker, once a pass has freed the state
            thread.join(timeout=0.2)
        gc.collect()
        assert alive() is None and not thread.is_alive()
