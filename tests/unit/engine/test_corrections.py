"""The corrections every method shares (algorithms/corrections.py), applied by the engine:
momentum correction with factor masking, dense steps, density warm-up, dense small tensors, local
gradient clipping.

Every check runs every registered method on N simulated ranks (NumPy backend) and compares with
what the corrections' definitions say, computed here from each rank's own vectors."""

from __future__ import annotations

import copy
import itertools
import warnings

import numpy as np
import pytest

from hvd_sparse import ConfigurationError
from hvd_sparse.algorithms import DGC, METHODS, ExDyna, TopK
from hvd_sparse.algorithms.base import DENSE_BUCKET
from hvd_sparse.algorithms.corrections import Corrections, warmup_density
from hvd_sparse.backends import get_backend
from hvd_sparse.comm.local import LocalGroup
from hvd_sparse.engine import Engine
from hvd_sparse.engine.planning import plan_buckets

NP = get_backend("numpy")
SHAPES = [(40, 30), (30,), (20, 25), (25,)]
SIZES = [int(np.prod(s)) for s in SHAPES]
NUMEL = sum(SIZES)
# Options that make each method run on a small model (N <= 4 ranks).
OPTIONS = {"exdyna": {"num_blocks": 32}, "lags": {"merge_threshold": 0}}


def method(name: str, density: float = 0.05, **corrections):
    options = {**OPTIONS.get(name, {}), **corrections}
    return next(cls for cls in METHODS if cls.name == name)(density, **options)


def grads_for(rng, size, step):
    scale = 1.0 + 0.1 * step
    return [[(rng.standard_t(3, s) * scale).astype(np.float32) for s in SHAPES] for _ in range(size)]


def run(algorithm, size, steps, seed=0, check=None, nonfinite="skip"):
    """``steps`` steps of ``algorithm`` on ``size`` ranks, one bucket per ``plan``; calls
    ``check(step, engines, before, grads, outputs)`` after each step, where ``before`` holds each
    rank's (residual, momentum, second moment) per bucket before the step."""
    rng = np.random.default_rng(seed)
    engines = [Engine(copy.deepcopy(algorithm), NP, r, size, nonfinite=nonfinite) for r in range(size)]
    group = LocalGroup(size, NP)
    keys = [f"p{i}" for i in range(len(SHAPES))]
    plan = plan_buckets(algorithm, keys, SIZES)
    for step in range(steps):
        grads = grads_for(rng, size, step)
        outputs = {}
        before = [{bk: tuple(_copy(e, bk, field) for field in ("residual", "momentum", "second_moment"))
                   for bk, _ in plan} for e in engines]
        for bucket, members in plan:
            tensors = [[grads[r][keys.index(m)].copy() for m in members] for r in range(size)]
            outs = group.run([e.step(bucket, tensors[r]) for r, e in enumerate(engines)])
            outputs[bucket] = (members, [[t.copy() for t in tensors[r]] for r in range(size)], outs)
        group.run([e.end_step(None) for e in engines])
        if check is not None:
            check(step, engines, before, outputs)
    return engines


def _copy(engine, key, field):
    bucket = engine.buckets.get(key)
    value = None if bucket is None else getattr(bucket, field)
    return None if value is None else value.copy()


def flat(tensors):
    return np.concatenate([t.reshape(-1) for t in tensors]).astype(np.float32)


# --- momentum correction ------------------------------------------------------------------------------
@pytest.mark.parametrize("name", [cls.name for cls in METHODS])
@pytest.mark.parametrize("nesterov", [False, True])
def test_momentum_correction_is_exact_for_every_method(name, nesterov):
    """Per rank and bucket: u' = mu*u + g (Nesterov mu*(u + g)); the accumulated vector is e + u'
    (Nesterov (e + u') + g); what left is exactly that vector where the residual was cleared, and
    u' is cleared there too (factor masking); the average is the sum of what left over N."""
    mu, size = 0.9, 3
    algorithm = method(name, momentum=mu, nesterov=nesterov)

    def check(step, engines, before, outputs):
        for bucket, (_, tensors, outs) in outputs.items():
            total = np.zeros(sum(t.size for t in tensors[0]), np.float32)
            for r, e in enumerate(engines):
                e_old, u_old, _ = before[r][bucket]
                g = flat(tensors[r])
                e_old = np.zeros_like(g) if e_old is None else e_old
                u_old = np.zeros_like(g) if u_old is None else u_old
                if nesterov:
                    u_new = np.float32(mu) * (u_old + g)
                    acc = (e_old + u_new) + g
                else:
                    u_new = np.float32(mu) * u_old + g
                    acc = e_old + u_new
                residual, u = e.buckets[bucket].residual, e.buckets[bucket].momentum
                sent = residual != acc
                np.testing.assert_array_equal(residual[sent], 0)
                assert sent.any()
                # DGC's authors keep the momentum where a bucket is sent whole (k = n)
                masked = name != "dgc" or e.buckets[bucket].control.k < residual.size
                np.testing.assert_array_equal(u, np.where(sent, 0, u_new) if masked else u_new)
                total += np.where(sent, acc, 0)
            average = flat(outs[0])
            np.testing.assert_allclose(average, total / size, rtol=1e-6, atol=1e-6)
            for other in outs[1:]:
                np.testing.assert_array_equal(flat(other), average)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run(algorithm, size, 4, check=check)


def test_momentum_off_leaves_no_buffer():
    engines = run(method("exdyna"), 2, 2)
    assert all(bk.momentum is None for e in engines for bk in e.buckets.values())


def test_nonfinite_skip_keeps_residual_and_momentum_bit_for_bit():
    algorithm = method("exdyna", momentum=0.9)
    rng = np.random.default_rng(3)
    engines = [Engine(copy.deepcopy(algorithm), NP, r, 2) for r in range(2)]
    group = LocalGroup(2, NP)
    for step in range(3):
        grads = grads_for(rng, 2, step)
        if step == 2:
            grads[1][0][3, 4] = np.nan
            bucket = engines[1].buckets["model"]
            kept = bucket.residual.copy(), bucket.momentum.copy()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            group.run([e.step("model", grads[r]) for r, e in enumerate(engines)])
    np.testing.assert_array_equal(engines[1].buckets["model"].residual, kept[0])
    np.testing.assert_array_equal(engines[1].buckets["model"].momentum, kept[1])


def test_nonfinite_raise_keeps_everything_accumulated_as_if_nothing_was_sent():
    """Every rank raises; a finite rank keeps e + u' in its residual and u' unmasked as its
    velocity (the step's gradient stays in both, once); the NaN rank keeps e and u."""
    algorithm = method("topk", momentum=0.9, scope="model")
    rng = np.random.default_rng(4)
    engines = [Engine(copy.deepcopy(algorithm), NP, r, 2, nonfinite="raise") for r in range(2)]
    group = LocalGroup(2, NP)
    group.run([e.step("model", grads_for(rng, 2, 0)[r]) for r, e in enumerate(engines)])
    kept = [(e.buckets["model"].residual.copy(), e.buckets["model"].momentum.copy()) for e in engines]
    grads = grads_for(rng, 2, 1)
    grads[0][2][0, 0] = np.inf
    raw = flat(grads[1])
    with pytest.raises(FloatingPointError):
        group.run([e.step("model", grads[r]) for r, e in enumerate(engines)])
    np.testing.assert_array_equal(engines[0].buckets["model"].residual, kept[0][0])
    np.testing.assert_array_equal(engines[0].buckets["model"].momentum, kept[0][1])
    u_new = np.float32(0.9) * kept[1][1] + raw
    np.testing.assert_array_equal(engines[1].buckets["model"].momentum, u_new)
    np.testing.assert_array_equal(engines[1].buckets["model"].residual, kept[1][0] + u_new)
    assert all(e.buckets["model"].step == 1 for e in engines)


def test_take_back_unmasks_the_velocity_of_a_bucket_that_finished():
    algorithm = method("topk", momentum=0.9)   # per tensor: four buckets
    rng = np.random.default_rng(5)
    engines = [Engine(copy.deepcopy(algorithm), NP, r, 2, nonfinite="raise") for r in range(2)]
    group = LocalGroup(2, NP)
    grads = grads_for(rng, 2, 0)
    group.run([e.step("p0", [grads[r][0]]) for r, e in enumerate(engines)])
    u_new = np.float32(0.9) * 0 + grads[0][0].reshape(-1)
    assert not np.array_equal(engines[0].buckets["p0"].momentum, u_new)   # masked
    for e in engines:
        e.take_back(["p0"])
    np.testing.assert_array_equal(engines[0].buckets["p0"].momentum, u_new)
    np.testing.assert_array_equal(engines[0].buckets["p0"].residual, u_new)
    assert engines[0].buckets["p0"].step == 0


# --- dense steps and warm-up ---------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["exdyna", "micro", "deft", "lags", "topk", "dgc", "gaussiank"])
def test_dense_steps_average_exactly_then_sparsify(name):
    size, dense = 2, 3

    def check(step, engines, before, outputs):
        for bucket, (_, tensors, outs) in outputs.items():
            mean = sum(flat(tensors[r]) for r in range(size)) / np.float32(size)
            stats = engines[0].stats()
            if step < dense:
                if name != "dgc":   # DGC's momentum 0.9 is on: the mean of the velocities
                    np.testing.assert_allclose(flat(outs[0]), mean, rtol=1e-6, atol=1e-6)
                    assert not np.any(engines[0].buckets[bucket].residual)
                assert stats["density_actual"] == 1.0
                assert engines[0].buckets[bucket].control is None   # the method has not run
            else:
                assert stats["k"] < stats["numel"] / 2

    run(method(name, dense_steps=dense), size, dense + 2, check=check)


def test_warmup_density_follows_dgcs_schedule():
    rho, warmup, dense = 0.01, 4, 2
    c = Corrections(dense_steps=dense, warmup_steps=warmup)
    got = [c.density_at(rho, s) for s in range(dense + warmup + 2)]
    expected = [1.0, 1.0] + [max(rho ** ((t + 1) / (warmup + 1)), rho) for t in range(warmup)]
    expected += [rho, rho]
    assert got == pytest.approx(expected)
    assert warmup_density(0.001, 4, 0) == pytest.approx(0.001 ** 0.2)


@pytest.mark.parametrize("name", ["topk", "exdyna", "deft", "lags", "gaussiank", "randomk", "dgc"])
def test_every_method_follows_the_warmup_target(name):
    warmup, rho = 3, 0.02
    seen = []

    def check(step, engines, before, outputs):
        stats = engines[0].stats()
        seen.append((stats["k"], stats["selected"]))

    run(method(name, rho, warmup_steps=warmup), 2, warmup + 2, check=check)
    ks = [k for k, _ in seen]
    assert ks[0] > ks[1] > ks[2] > ks[3], ks
    assert ks[3] == ks[4]


# --- dense small tensors ------------------------------------------------------------------------------
def test_plan_takes_small_tensors_out():
    keys = [f"p{i}" for i in range(4)]
    assert plan_buckets(ExDyna(0.01, dense_below=100), keys, SIZES) == [("model", ["p0", "p2"]),
                                                               (DENSE_BUCKET, ["p1", "p3"])]
    assert plan_buckets(TopK(0.01, dense_below=100), keys, SIZES) == [(k, [k]) for k in keys]
    assert plan_buckets(ExDyna(0.01), keys, SIZES) == [("model", keys)]


@pytest.mark.parametrize("name", ["exdyna", "micro", "deft", "lags", "topk", "dgc"])
def test_small_tensors_are_averaged_densely_and_counted(name):
    size = 2

    def check(step, engines, before, outputs):
        dense_entries = 0
        for bucket, (members, tensors, outs) in outputs.items():
            if all(SIZES[int(m[1:])] < 100 for m in members):
                dense_entries += sum(t.size for t in tensors[0])
                mean = sum(flat(tensors[r]) for r in range(size)) / np.float32(size)
                if name != "dgc":
                    np.testing.assert_allclose(flat(outs[0]), mean, rtol=1e-6, atol=1e-6)
                assert engines[0].buckets[bucket].dense
        assert dense_entries == SIZES[1] + SIZES[3]
        stats = engines[0].stats()
        assert stats["union"] >= dense_entries
        assert stats["numel"] == NUMEL

    run(method(name, dense_below=100), size, 3, check=check)


# --- checkpoints ------------------------------------------------------------------------------
def test_momentum_is_checkpointed_per_rank_and_reset_at_another_world_size():
    algorithm = method("exdyna", momentum=0.9, warmup_steps=2)
    engines = run(algorithm, 2, 3)
    states = [e.state_dict() for e in engines]
    resumed = [Engine(copy.deepcopy(algorithm), NP, r, 2) for r in range(2)]
    for e, state in zip(resumed, states, strict=True):
        e.load_state_dict(state)
    rng = np.random.default_rng(9)
    grads = grads_for(rng, 2, 3)
    group = LocalGroup(2, NP)
    a = group.run([e.step("model", [g.copy() for g in grads[r]]) for r, e in enumerate(engines)])
    b = group.run([e.step("model", [g.copy() for g in grads[r]]) for r, e in enumerate(resumed)])
    for x, y in zip(a, b, strict=True):
        for s, t in zip(x, y, strict=True):
            np.testing.assert_array_equal(s, t)
    bigger = Engine(copy.deepcopy(algorithm), NP, 0, 3)
    with pytest.warns(UserWarning, match="residuals are reset"):
        bigger.load_state_dict(states[0])
    bigger._bucket("model", [np.zeros(s, np.float32) for s in SHAPES])
    momentum = bigger.buckets["model"].momentum       # per rank: restarts, like the residual
    assert momentum is None or not np.any(momentum)
    assert not np.any(bigger.buckets["model"].residual)
    assert bigger.buckets["model"].step == 3


def test_dgc_checkpoints_from_before_keep_their_momentum():
    """A DGC checkpoint whose control state held the velocity (before the engine kept it)."""
    algorithm = DGC(0.1, scope="model")
    engines = run(algorithm, 2, 2)
    state = engines[0].state_dict()
    saved = state["buckets"]["model"]
    saved["control"] = {**saved["control"], "momentum": saved.pop("momentum"), "accumulated_step": 1}
    fresh = Engine(copy.deepcopy(algorithm), NP, 0, 2)
    fresh.load_state_dict(state)
    fresh._bucket("model", [np.zeros(s, np.float32) for s in SHAPES])
    np.testing.assert_array_equal(fresh.buckets["model"].momentum, engines[0].buckets["model"].momentum)


# --- local gradient clipping ------------------------------------------------------------------
def clipped(g: np.ndarray, clip_norm: float, size: int, segments: list[tuple[int, int]]) -> np.ndarray:
    """DGC's rule, per segment: scale to an L2 norm of at most clip_norm / sqrt(N)."""
    out = g.copy()
    for lo, hi in segments:
        norm = float(np.linalg.norm(g[lo:hi].astype(np.float64)))
        coefficient = clip_norm / np.sqrt(size) / (norm + 1e-6)
        if coefficient < 1:
            out[lo:hi] = g[lo:hi] * np.float32(coefficient)
    return out


@pytest.mark.parametrize("name", [cls.name for cls in METHODS])
def test_local_clipping_is_exact_for_every_method(name):
    """Per rank and bucket, the accumulated vector is e + clip(g): what left is exactly that
    vector where the residual was cleared, and sent + the new residual conserve the clipped
    gradient; the average is the sum of what left over N. The norms here (about 30 to 60 per
    rank) are all clipped at 2 / sqrt(3)."""
    clip_norm, size = 2.0, 3
    algorithm = method(name, clip_norm=clip_norm, momentum=0.0)   # DGC's default is 0.9
    seen = []

    def check(step, engines, before, outputs):
        for bucket, (_, tensors, outs) in outputs.items():
            total = np.zeros(sum(t.size for t in tensors[0]), np.float32)
            packed = engines[0].buckets[bucket].members
            bounds = np.cumsum([0, *[t.size for t in tensors[0]]])
            segments = list(itertools.pairwise(bounds)) if packed else [(0, bounds[-1])]
            for r, e in enumerate(engines):
                e_old = before[r][bucket][0]
                g = clipped(flat(tensors[r]), clip_norm, size, segments)
                acc = g if e_old is None else e_old + g
                residual = e.buckets[bucket].residual
                sent = residual != acc
                np.testing.assert_array_equal(residual[sent], 0)
                np.testing.assert_array_equal(residual[~sent], acc[~sent])
                total += np.where(sent, acc, 0)
                seen.append(float(np.linalg.norm(g)))
            np.testing.assert_allclose(flat(outs[0]), total / size, rtol=1e-5, atol=1e-6)

    run(algorithm, size, 3, check=check)
    limit = clip_norm / np.sqrt(size)   # every segment's norm was above it: each clipped to it
    assert limit * (1 - 1e-5) <= min(seen) and max(seen) <= limit * np.sqrt(len(SHAPES)) * (1 + 1e-5)


def test_clipping_leaves_the_inputs_and_spares_dense_steps_and_small_tensors():
    """The inputs are not scaled in place; the dense steps and the bucket of small tensors
    average the gradients as they are."""
    size = 2
    algorithm = method("exdyna", clip_norm=1e-3, dense_steps=1, dense_below=100)
    rng = np.random.default_rng(0)
    engines = [Engine(copy.deepcopy(algorithm), NP, r, size) for r in range(size)]
    group = LocalGroup(size, NP)
    keys = [f"p{i}" for i in range(len(SHAPES))]
    plan = dict(plan_buckets(algorithm, keys, SIZES))
    for step in range(2):
        grads = grads_for(rng, size, step)
        for bucket, members in plan.items():
            tensors = [[grads[r][keys.index(m)].copy() for m in members] for r in range(size)]
            outs = group.run([e.step(bucket, tensors[r]) for r, e in enumerate(engines)])
            for r in range(size):
                for t, m in zip(tensors[r], members, strict=True):
                    np.testing.assert_array_equal(t, grads[r][keys.index(m)])   # untouched
            if step == 0 or bucket == DENSE_BUCKET:   # a plain average of the unclipped gradients
                mean = sum(flat(tensors[r]) for r in range(size)) / size
                np.testing.assert_allclose(flat(outs[0]), mean, rtol=1e-6)
            else:   # the sparse step: nothing larger than the clipped gradient left
                assert np.abs(flat(outs[0])).max() <= 1e-3
        group.run([e.end_step(None) for e in engines])


def test_clipping_writes_the_whole_average_into_the_inputs():
    """With ``write_into_inputs`` (the PyTorch faces) the fused op clears only the clipped copies:
    the reconstruction then writes every entry of the inputs, zeros included."""
    size = 2
    algorithm = method("exdyna", density=0.1, clip_norm=0.5)
    engines = [Engine(copy.deepcopy(algorithm), NP, r, size, write_into_inputs=True) for r in range(size)]
    rng = np.random.default_rng(1)
    grads = [[rng.standard_normal(1000).astype(np.float32)] for _ in range(size)]
    outs = LocalGroup(size, NP).run([e.step("w", [grads[r][0]]) for r, e in enumerate(engines)])
    for r in range(size):
        assert outs[r][0] is grads[r][0]                  # written into the input
        assert np.count_nonzero(grads[r][0]) <= 2 * 100   # holds the sparse average, not g
        assert np.abs(grads[r][0]).max() <= 0.5


# --- bad input ------------------------------------------------------------------------------
@pytest.mark.parametrize("options, message", [
    ({"momentum": 1.0}, "momentum must be a number in"),
    ({"momentum": -0.1}, "momentum must be a number in"),
    ({"momentum": "0.9"}, "momentum must be a number in"),
    ({"nesterov": True}, "nesterov=True needs momentum"),
    ({"momentum": 0.9, "nesterov": 1}, "nesterov must be True or False"),
    ({"dense_steps": -1}, "dense_steps must be a non-negative integer"),
    ({"warmup_steps": 2.5}, "warmup_steps must be a non-negative integer"),
    ({"dense_below": -3}, "dense_below must be a non-negative integer"),
    ({"dense_below": True}, "dense_below must be a non-negative integer"),
    ({"clip_norm": 0}, "clip_norm must be in"),
    ({"clip_norm": float("inf")}, "clip_norm must be in"),
    ({"clip_norm": "1"}, "clip_norm must be in"),
])
@pytest.mark.parametrize("name", ["exdyna", "deft", "lags", "topk"])
def test_bad_corrections_fail_at_construction(name, options, message):
    with pytest.raises(ConfigurationError, match=message):
        method(name, **options)


def test_dgc_takes_one_warmup_form():
    with pytest.raises(ConfigurationError, match=r"warmup_epochs .* or warmup_steps"):
        DGC(0.01, warmup_epochs=2, warmup_steps=100)


def test_unknown_keyword_still_fails():
    with pytest.raises(TypeError, match="unexpected keyword"):
        TopK(0.01, momentun=0.9)


def test_corrections_are_part_of_the_configuration():
    assert ExDyna(0.01, momentum=0.9).describe()["momentum"] == 0.9
    assert "momentum" not in ExDyna(0.01).describe()
    assert DGC(0.01).describe()["momentum"] == 0.9
    assert "dense_below=64" in repr(TopK(0.01, dense_below=64))


def test_an_elastic_reset_keeps_each_processs_own_momentum():
    algorithm = method("exdyna", momentum=0.9)
    old = run(algorithm, 3, 3)
    agreed = old[0].agreed_state()
    assert all("momentum" not in saved for saved in agreed["buckets"].values())
    survivor = old[2]
    new = Engine(copy.deepcopy(algorithm), NP, 0, 2)
    new.adopt(agreed, {"model": survivor.buckets["model"].residual.copy()},
              {"model": survivor.buckets["model"].momentum.copy()})
    new._bucket("model", [np.zeros(s, np.float32) for s in SHAPES])
    np.testing.assert_array_equal(new.buckets["model"].momentum, survivor.buckets["model"].momentum)
    np.testing.assert_array_equal(new.buckets["model"].residual, survivor.buckets["model"].residual)
