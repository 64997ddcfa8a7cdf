"""A bucket packing per-tensor steps (``Engine.step``'s ``members``, ``Algorithm.packs_tensors``):
the same decisions, averages, residuals and velocities as a bucket per tensor, step after step,
on N simulated ranks (NumPy backend); checkpoints move between the two packings."""

from __future__ import annotations

import numpy as np
import pytest

from hvd_sparse import ConfigurationError
from hvd_sparse.algorithms import DGC, GaussianK, RandomK, Threshold, TopK
from hvd_sparse.backends import get_backend
from hvd_sparse.comm.local import LocalGroup
from hvd_sparse.engine import Engine
from hvd_sparse.engine.planning import pack_tensors, plan_buckets, step_members

NP = get_backend("numpy")
# A 1-entry tensor (DGC sends it whole: k = n, its velocity is never masked), small ones DGC does
# not sample, and large ones it samples.
SHAPES = [(60, 50), (1,), (7,), (40, 30, 3), (150,), (900,)]
KEYS = tuple(f"g{i}" for i in range(len(SHAPES)))
METHODS = {
    "topk": lambda: TopK(0.02),
    "topk-union": lambda: TopK(0.02, pattern="union"),
    "topk-momentum": lambda: TopK(0.01, momentum=0.9, warmup_steps=3),
    "dgc": lambda: DGC(0.01),
    "dgc-nesterov-uniform": lambda: DGC(0.01, nesterov=True, strided_sample=False, seed=3),
    "dgc-dense": lambda: DGC(1.0),
    "dgc-clip": lambda: DGC(0.01, clip_norm=3.0),   # clips the large tensors, not the small ones
    "randomk": lambda: RandomK(0.02, seed=5),
    "randomk-shared-momentum": lambda: RandomK(0.05, shared_seed=True, momentum=0.9),
    "threshold": lambda: Threshold(0.02, scope="tensor", warmup_steps=3),
    "threshold-given-union": lambda: Threshold(threshold=0.5, pattern="union", scope="tensor"),
    "threshold-none-passes": lambda: Threshold(threshold=1e6, scope="tensor"),   # every fallback
    "gaussiank": lambda: GaussianK(0.02),
    "gaussiank-rescale-momentum": lambda: GaussianK(0.05, variant="rescale", momentum=0.9),
    # Every tensor under dense_below: the bundle pack() makes of them, averaged densely.
    "topk-dense-below": lambda: TopK(0.02, momentum=0.9, nesterov=True, dense_below=4000),
}


def gradients(rng, size):
    return [[(rng.standard_t(3, s) * rng.uniform(0.1, 2.0)).astype(np.float32) for s in SHAPES]
            for _ in range(size)]


def per_tensor_step(group, engines, grads, b=NP):
    """Every tensor in a bucket of its own; each rank's flat average (on backend ``b``)."""
    outs = [[] for _ in engines]
    for i, key in enumerate(KEYS):
        done = group.run([e.step(key, [b.from_numpy(grads[r][i].copy())]) for r, e in enumerate(engines)])
        for r, out in enumerate(done):
            outs[r].append(np.ravel(b.to_numpy(out[0])))
    return [np.concatenate(o) for o in outs]


def packed_step(group, engines, grads, b=NP):
    done = group.run([e.step("all", [b.from_numpy(g.copy()) for g in grads[r]], members=KEYS)
                      for r, e in enumerate(engines)])
    return [np.concatenate([np.ravel(b.to_numpy(t)) for t in out]) for out in done]


def state_of(engine, key=None):
    """(residual, velocity) of a rank, end to end over the tensors."""
    if key is not None:
        bucket = engine.buckets[key]
        return bucket.residual, bucket.momentum
    buckets = [engine.buckets[k] for k in KEYS]
    momenta = [b.momentum for b in buckets]
    return (np.concatenate([b.residual for b in buckets]),
            None if any(m is None for m in momenta) else np.concatenate(momenta))


def assert_same(alone, packed):
    for (residual, momentum), (packed_residual, packed_momentum) in zip(alone, packed, strict=True):
        np.testing.assert_array_equal(packed_residual, residual)
        if momentum is None:
            assert packed_momentum is None
        else:
            np.testing.assert_array_equal(packed_momentum, momentum)


@pytest.mark.parametrize("method", list(METHODS))
@pytest.mark.parametrize("size", [1, 2, 3])
def test_packed_bucket_decides_as_a_bucket_per_tensor(method, size):
    group, rng = LocalGroup(size), np.random.default_rng(size)
    alone = [Engine(METHODS[method](), NP, r, size) for r in range(size)]
    packed = [Engine(METHODS[method](), NP, r, size) for r in range(size)]
    for _ in range(8):
        grads = gradients(rng, size)
        expected, got = per_tensor_step(group, alone, grads), packed_step(group, packed, grads)
        for e, g in zip(expected, got, strict=True):
            np.testing.assert_array_equal(g, e)
        assert_same([state_of(e) for e in alone], [state_of(e, "all") for e in packed])
        want, have = alone[0].stats(), packed[0].stats()
        for field in ("k", "selected", "bytes_sent"):
            assert have[field] == want[field], field
    if method.startswith(("dgc", "gaussiank", "threshold")) and method != "dgc-dense":
        assert packed[0].stats()["threshold"] == pytest.approx(alone[0].stats()["threshold"])


@pytest.mark.parametrize("method", ["gaussiank", "gaussiank-rescale-momentum", "topk-momentum", "dgc",
                                    "randomk", "threshold", "threshold-none-passes"])
@pytest.mark.parametrize("framework", ["torch", "tensorflow"])
def test_packed_bucket_decides_as_a_bucket_per_tensor_in_each_framework(framework, method):
    """The same on the frameworks' backends, kernels on where they load: a packed bucket's
    selection reads each tensor out of its vector (a view in torch, a copy in TensorFlow)."""
    pytest.importorskip(framework)
    b, size, rng = get_backend(framework), 2, np.random.default_rng(3)
    group = LocalGroup(size, b)
    alone = [Engine(METHODS[method](), b, r, size) for r in range(size)]
    packed = [Engine(METHODS[method](), b, r, size) for r in range(size)]
    for _ in range(5):
        grads = gradients(rng, size)
        expected, got = per_tensor_step(group, alone, grads, b), packed_step(group, packed, grads, b)
        for e, g in zip(expected, got, strict=True):
            np.testing.assert_array_equal(g, e)
        for one, all_ in zip(alone, packed, strict=True):
            np.testing.assert_array_equal(b.to_numpy(all_.buckets["all"].residual), np.concatenate(
                [b.to_numpy(one.buckets[k].residual) for k in KEYS]))


@pytest.mark.parametrize("variant", ["original", "rescale"])
def test_an_empty_tensor_selection_in_a_packed_bucket_sends_its_fallback(variant):
    """A tensor whose selection is empty (all zeros: Gaussian-k's λ finds nothing) sends its own
    fallback index (step mod its size) inside a packed bucket, as alone, where the engine sends
    it."""
    size, rng = 2, np.random.default_rng(11)
    group = LocalGroup(size)
    alone = [Engine(GaussianK(0.05, variant=variant), NP, r, size) for r in range(size)]
    packed = [Engine(GaussianK(0.05, variant=variant), NP, r, size) for r in range(size)]
    for _ in range(5):
        grads = gradients(rng, size)
        for rank_grads in grads:
            rank_grads[2][:] = 0.0   # the (7,) tensor
        expected, got = per_tensor_step(group, alone, grads), packed_step(group, packed, grads)
        for e, g in zip(expected, got, strict=True):
            np.testing.assert_array_equal(g, e)
        assert_same([state_of(e) for e in alone], [state_of(e, "all") for e in packed])
        assert packed[0].stats()["selected"] == alone[0].stats()["selected"]
    assert alone[0].buckets["g2"].stats.selected == 1   # the fallback, not an empty collective


def resume_and_compare(make, before, after, group, rng, steps: int = 3):
    """Run two copies of ``make()`` for ``steps`` with ``before``; resume a third from the first's
    checkpoint and run it with ``after`` beside the second (with ``before``) for ``steps`` more,
    asserting equal averages. -> (the never-moved engines, the resumed ones)."""
    first, reference = make(), make()
    for _ in range(steps):
        grads = gradients(rng, len(first))
        before(group, first, grads)
        before(group, reference, grads)
    resumed = make()
    for engine, old in zip(resumed, first, strict=True):
        engine.load_state_dict(old.state_dict())
    for _ in range(steps):
        grads = gradients(rng, len(first))
        for e, g in zip(before(group, reference, grads), after(group, resumed, grads), strict=True):
            np.testing.assert_array_equal(g, e)
    return reference, resumed


@pytest.mark.parametrize("direction", ["into packed", "out of packed"])
def test_checkpoints_move_between_packings(direction):
    """A checkpoint of buckets per tensor resumes in a packed bucket, and back: residuals,
    velocities and steps carried over, the run then the same as if never moved."""
    size, rng = 2, np.random.default_rng(5)
    group = LocalGroup(size)
    make = lambda: [Engine(DGC(0.01), NP, r, size) for r in range(size)]   # noqa: E731
    before, after = per_tensor_step, packed_step
    if direction == "out of packed":
        before, after = after, before
    reference, resumed = resume_and_compare(make, before, after, group, rng)
    packed, alone = (resumed, reference) if direction == "into packed" else (reference, resumed)
    assert_same([state_of(e) for e in alone], [state_of(e, "all") for e in packed])
    assert {b.step for e in resumed for b in e.buckets.values()} == {6}
    assert not any(e._restored for e in resumed)   # every part taken


def test_pack_bundles_the_dense_below_tensors_with_the_run_they_sit_in():
    """Each dtype's ``dense_below`` tensors met since its last run closed form one dense bucket
    that closes with the run, right after it."""
    keys = ["w1", "b1", "w2", "b2", "w3", "b3", "hb"]
    sizes = dict(zip(keys, [50, 5, 60, 5, 30, 4, 5], strict=True))
    dtypes = {k: "float16" if k == "hb" else "float32" for k in keys}
    algorithm = TopK(0.1, dense_below=10)
    planned = plan_buckets(algorithm, keys, [sizes[k] for k in keys])
    plan = pack_tensors(algorithm, planned, sizes, dtypes, limit=100)
    assert plan == [("w1", ["w1"]), ("b1", ["b1"]), ("w2-w3", ["w2", "w3"]), ("b2-b3", ["b2", "b3"]),
                    ("hb", ["hb"])]
    assert [step_members(algorithm, m) for _, m in plan] == [(), (), ("w2", "w3"), ("b2", "b3"), ()]
    assert pack_tensors(algorithm, planned, sizes, dtypes) == [
        ("w1-w3", ["w1", "w2", "w3"]), ("b1-b3", ["b1", "b2", "b3"]), ("hb", ["hb"])]


def test_a_dense_below_bundle_resumes_from_a_bucket_per_tensor():
    """A checkpoint of a bucket per dense_below tensor (before bundling) resumes in the bundle:
    the velocities carried over, the averages those of the run never moved."""
    size, rng = 2, np.random.default_rng(7)
    group = LocalGroup(size)
    make = lambda: [Engine(METHODS["topk-dense-below"](), NP, r, size) for r in range(size)]  # noqa: E731
    reference, resumed = resume_and_compare(make, per_tensor_step, packed_step, group, rng)
    assert_same([state_of(e) for e in reference], [state_of(e, "all") for e in resumed])
    assert resumed[0].buckets["all"].dense and not any(e._restored for e in resumed)


def test_a_method_that_cannot_pack_is_refused():
    unpacked = TopK(0.1)
    unpacked.packs_tensors = False   # the user's switch back to a bucket per tensor
    engine = Engine(unpacked, NP, 0, 1)
    with pytest.raises(ConfigurationError, match="only in buckets of its own"):
        LocalGroup(1).run([engine.step("all", [np.ones(4, np.float32)] * 2, members=("a", "b"))])
    engine = Engine(TopK(0.1, scope="model"), NP, 0, 1)   # one k over the bucket: no tensors
    with pytest.raises(ConfigurationError, match="only in scope 'tensor'"):
        LocalGroup(1).run([engine.step("all", [np.ones(4, np.float32)] * 2, members=("a", "b"))])
    engine = Engine(TopK(0.1), NP, 0, 1)
    with pytest.raises(ConfigurationError, match="a key per tensor"):
        LocalGroup(1).run([engine.step("all", [np.ones(4, np.float32)] * 2, members=("a",))])


def test_pack_runs_packable_tensors_of_a_dtype_up_to_the_limit():
    """``planning.pack_tensors``: runs of one dtype, split at the limit, a larger tensor alone, going on
    past the empty tensors and other dtypes, which keep their buckets, and the ``dense_below``
    ones, which close with the run they sit in; the tensors of methods that cannot pack keep
    theirs; without a limit, one bucket per dtype."""
    keys = ["a", "b", "empty", "c", "d", "small", "e", "half", "f", "g"]
    sizes = dict(zip(keys, [30, 40, 0, 50, 200, 5, 60, 70, 20, 30], strict=True))
    dtypes = {k: "float16" if k == "half" else "float32" for k in keys}
    algorithm = TopK(0.1, dense_below=10)
    planned = plan_buckets(algorithm, keys, [sizes[k] for k in keys])
    plan = pack_tensors(algorithm, planned, sizes, dtypes, limit=100)
    assert plan == [("empty", ["empty"]), ("a-b", ["a", "b"]), ("c", ["c"]), ("d", ["d"]),
                    ("small", ["small"]), ("e-f", ["e", "f"]), ("half", ["half"]), ("g", ["g"])]
    assert pack_tensors(algorithm, planned, sizes, dtypes) == [
        ("empty", ["empty"]), ("a-g", ["a", "b", "c", "d", "e", "f", "g"]), ("small", ["small"]),
        ("half", ["half"])]
    assert [step_members(algorithm, m) for _, m in plan] == [(), ("a", "b"), (), (), (), ("e", "f"), (), ()]
    for unpackable in (TopK(0.1, scope="model"), Threshold(0.1), TopK(0.1, dense_below=100, scope="model")):
        unpacked = plan_buckets(unpackable, keys, [sizes[k] for k in keys])
        assert pack_tensors(unpackable, unpacked, sizes, dtypes, limit=100) == unpacked
        assert all(step_members(unpackable, m) == () for _, m in unpacked)
