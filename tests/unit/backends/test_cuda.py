"""The methods on CUDA tensors (torch backend, N simulated ranks): every bulk tensor stays on the
GPU, decisions match the NumPy reference run, error feedback stays exact, and checkpoints of
GPU state round-trip. Skipped where no GPU is present."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

from hvd_sparse.algorithms import (  # noqa: E402
    DEFT,
    DGC,
    LAGS,
    ExDyna,
    GaussianK,
    MiCRO,
    RandomK,
    Threshold,
    TopK,
)
from hvd_sparse.backends import get_backend  # noqa: E402
from hvd_sparse.comm.local import LocalGroup  # noqa: E402
from hvd_sparse.engine import Engine  # noqa: E402

SIZE, STEPS = 3, 5
SHAPES = [(64, 48), (48,), (4000,)]
DETERMINISTIC = [  # same decisions on every backend: compared with NumPy exactly
    lambda: TopK(0.05), lambda: TopK(0.05, pattern="union", scope="model"),
    lambda: RandomK(0.05, seed=3), lambda: RandomK(0.05, shared_seed=True),
    lambda: Threshold(0.05), lambda: Threshold(0.05, threshold=0.5, pattern="union", scope="tensor"),
    lambda: Threshold(0.05, threshold=1e6),  # nothing passes: the fallback index, on the GPU
    lambda: ExDyna(0.05), lambda: ExDyna(0.05, threshold_scaling="tracking"),
    lambda: ExDyna(0.05, rebalance="neighbour"), lambda: MiCRO(0.05),
    lambda: ExDyna(0.5, threshold_scaling="tracking", threshold_band="symmetric"),  # heavy rebalancing
    lambda: DEFT(0.05), lambda: DEFT(0.05, agreed_k=True), lambda: LAGS(0.05, merge_threshold=0),
]
ITERATIVE = [lambda: GaussianK(0.05), lambda: GaussianK(0.05, variant="rescale"),
             lambda: DGC(0.05, clip_norm=5.0), lambda: DGC(0.05, nesterov=True, warmup_epochs=1)]


def batches():
    rng = np.random.default_rng(0)
    return [[[(rng.standard_t(3, s) * 0.2).astype(np.float32) for s in SHAPES] for _ in range(SIZE)]
            for _ in range(STEPS)]


def run(make, backend_name, data, in_place=False):
    """Every step's outputs and final residuals (NumPy), plus the engines."""
    b = get_backend(backend_name)
    algorithm = make()
    engines = [Engine(algorithm, b, r, SIZE, write_into_inputs=in_place) for r in range(SIZE)]
    group = LocalGroup(SIZE, b)
    keys = ["model"] if algorithm.scope == "model" else [f"t{i}" for i in range(len(SHAPES))]
    outputs = []
    for grads in data:
        device = [[b.from_numpy(g, like=torch.zeros(1, device="cuda")) if backend_name == "torch"
                   else g for g in rank_grads] for rank_grads in grads]
        for key_index, key in enumerate(keys):
            members = device if key == "model" else [[g[key_index]] for g in device]
            step = group.run([e.step(key, members[r]) for r, e in enumerate(engines)])
            if backend_name == "torch":
                assert all(t.is_cuda for out in step for t in out), "output left the GPU"
                assert all(e.buckets[key].residual.is_cuda for e in engines), "residual left the GPU"
            outputs.append([[b.to_numpy(t) for t in out] for out in step])
    residuals = {key: [b.to_numpy(e.buckets[key].residual) for e in engines] for key in keys}
    return outputs, residuals, engines


@pytest.mark.parametrize("in_place", [False, True], ids=["allocate", "in-place"])
@pytest.mark.parametrize("make", DETERMINISTIC, ids=lambda make: repr(make()))
def test_deterministic_methods_match_numpy_on_the_gpu(make, in_place):
    data = batches()
    expected, expected_residuals, _ = run(make, "numpy", data)
    got, got_residuals, _ = run(make, "torch", data, in_place)
    for a, b in zip(expected, got, strict=True):
        for ra, rb in zip(a, b, strict=True):
            for ta, tb in zip(ra, rb, strict=True):
                np.testing.assert_allclose(tb, ta, rtol=1e-5, atol=1e-6)
    for key, residuals in expected_residuals.items():
        for ra, rb in zip(residuals, got_residuals[key], strict=True):
            np.testing.assert_array_equal(rb, ra)


@pytest.mark.parametrize("make", ITERATIVE, ids=lambda make: repr(make()))
def test_iterative_methods_keep_exact_error_feedback_on_the_gpu(make):
    data = batches()
    b = get_backend("torch")
    algorithm = make()
    engines = [Engine(algorithm, b, r, SIZE) for r in range(SIZE)]
    group = LocalGroup(SIZE, b)
    for grads in data:
        for i in range(len(SHAPES)):
            key = f"t{i}"
            tensors = [[torch.from_numpy(g[i]).cuda()] for g in grads]
            flat = [t[0].reshape(-1) for t in tensors]
            before = [e.buckets[key].residual.clone() if key in e.buckets else None for e in engines]
            out = group.run([e.step(key, tensors[r]) for r, e in enumerate(engines)])
            assert all(t.is_cuda for o in out for t in o)
            for r, engine in enumerate(engines):
                residual = engine.buckets[key].residual
                assert residual.is_cuda
                if isinstance(algorithm, GaussianK):
                    acc = flat[r] + (before[r] if before[r] is not None else 0)
                    sent = residual == 0
                    torch.testing.assert_close(torch.where(sent, acc, residual), acc, rtol=0, atol=0)
                    assert 0 < int(sent.sum()) <= acc.numel()
                else:  # DGC: v = v_old + u (+ g with Nesterov); u and v cleared where sent
                    u = engine.buckets[key].momentum
                    assert u.is_cuda
                    old = before[r] if before[r] is not None else torch.zeros_like(residual)
                    velocity = old + u + (flat[r] if algorithm.nesterov else 0)
                    kept = residual != 0
                    assert int((~kept).sum()) >= 1 and bool((u[~kept] == 0).all())
                    torch.testing.assert_close(residual[kept], velocity[kept], rtol=0, atol=0)
    if isinstance(algorithm, DGC):  # a checkpoint of GPU state resumes identically
        states = [e.state_dict() for e in engines]
        resumed = [Engine(make(), b, r, SIZE) for r in range(SIZE)]
        for engine, state in zip(resumed, states, strict=True):
            engine.load_state_dict(state)
        tensors = [[torch.from_numpy(g[0]).cuda()] for g in data[0]]
        a = group.run([e.step("t0", tensors[r]) for r, e in enumerate(engines)])
        c = group.run([e.step("t0", tensors[r]) for r, e in enumerate(resumed)])
        for x, y in zip(a, c, strict=True):
            torch.testing.assert_close(x[0], y[0], rtol=0, atol=0)
        assert resumed[0].buckets["t0"].momentum.is_cuda


PACKING = [lambda: TopK(0.05), lambda: TopK(0.05, momentum=0.9, pattern="union"),
           lambda: DGC(0.05, clip_norm=5.0), lambda: DGC(0.05, nesterov=True),
           lambda: RandomK(0.05, seed=3), lambda: RandomK(0.05, shared_seed=True),
           lambda: GaussianK(0.05), lambda: GaussianK(0.05, variant="rescale", momentum=0.9),
           lambda: Threshold(0.05, scope="tensor"), lambda: Threshold(threshold=1e6, scope="tensor")]


@pytest.mark.parametrize("make", PACKING, ids=lambda make: repr(make()))
def test_packed_steps_decide_as_a_bucket_per_tensor_on_the_gpu(make, device="cuda"):
    """PyTorch's faces pack every per-tensor method but LAGS (``planning.pack_tensors``): on CUDA tensors
    the packed bucket's averages and residuals are a bucket per tensor's, bit for bit."""
    b, keys = get_backend("torch"), tuple(f"t{i}" for i in range(len(SHAPES)))
    packed = [Engine(make(), b, r, SIZE) for r in range(SIZE)]
    alone = [Engine(make(), b, r, SIZE) for r in range(SIZE)]
    group = LocalGroup(SIZE, b)
    for grads in batches():
        on_device = [[torch.from_numpy(g).to(device) for g in rank] for rank in grads]
        one = group.run([e.step("t0-t2", list(on_device[r]), members=keys) for r, e in enumerate(packed)])
        each = [group.run([e.step(key, [on_device[r][i]]) for r, e in enumerate(alone)])
                for i, key in enumerate(keys)]
        for r in range(SIZE):
            for i in range(len(keys)):
                assert one[r][i].device.type == device
                torch.testing.assert_close(one[r][i], each[i][r][0], rtol=0, atol=0)
            joined = torch.cat([alone[r].buckets[k].residual for k in keys])
            torch.testing.assert_close(packed[r].buckets["t0-t2"].residual, joined, rtol=0, atol=0)


def test_gpu_scatter_is_bitwise_reproducible():
    """Ranks scatter the same gathered pairs independently: on a GPU they must round alike."""
    b = get_backend("torch")
    rng = np.random.default_rng(5)
    idx = torch.from_numpy(np.concatenate([rng.choice(2000, 300, replace=False) for _ in range(8)])).cuda()
    values = torch.from_numpy(rng.standard_normal(idx.numel()).astype(np.float32)).cuda()
    first = b.scatter(2000, idx, values)
    for _ in range(20):
        assert torch.equal(b.scatter(2000, idx, values), first)
    expected = np.zeros(2000, np.float32)
    np.add.at(expected, idx.cpu().numpy(), values.cpu().numpy())
    np.testing.assert_array_equal(first.cpu().numpy(), expected)
