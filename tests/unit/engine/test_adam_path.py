"""The Adam path (algorithms/corrections.py ``AdamPath``, engine/adam.py), for every method.

Every check runs every registered method on N simulated ranks (NumPy backend) and compares with
the path's definition computed here from each rank's own vectors: Adam of the average during the
dense steps; afterwards the rank's own first and second moments, and error feedback on the
clamped Adam update, exact."""

from __future__ import annotations

import copy
import warnings

import numpy as np
import pytest

from hvd_sparse import ConfigurationError
from hvd_sparse.algorithms import METHODS, AdamPath, ExDyna, TopK
from hvd_sparse.algorithms.corrections import ADAM_DENSE_STEPS
from hvd_sparse.backends import get_backend
from hvd_sparse.comm.local import LocalGroup
from hvd_sparse.engine import Engine
from tests.unit.engine.test_corrections import SHAPES, SIZES, flat, grads_for, method, run

NP = get_backend("numpy")
PATH = AdamPath(0.9, 0.99, 1e-8)
F = np.float32


def precondition(u, v, c1, c2, eps):
    return (u * F(c1)) / (np.sqrt(v * F(c2)) + F(eps))


def sparse_step(u, v, t):
    """The clamped Adam update of the moments after update t."""
    update = precondition(u, v, PATH.first_scale(t), PATH.second_scale(t), PATH.eps)
    return np.clip(update, -F(PATH.update_bound), F(PATH.update_bound))


def adam_method(name, dense=2, density=0.05, **options):
    return method(name, density, adam=PATH, dense_steps=dense, **options)


@pytest.mark.parametrize("name", [cls.name for cls in METHODS])
def test_dense_steps_hand_out_adam_of_the_average_on_every_rank(name):
    """m <- b1 m + (1-b1) a, v <- b2 v + (1-b2) a^2 of the average a, the same on every rank, and
    the result is m_hat / (sqrt(v_hat) + eps)."""
    size, dense = 3, 3
    moments = {}

    def check(step, engines, before, outputs):
        if step >= dense:
            return
        for bucket, (_, tensors, outs) in outputs.items():
            average = sum(flat(tensors[r]) for r in range(size)) / F(size)
            m, v = moments.get(bucket, (np.zeros_like(average), np.zeros_like(average)))
            m = m * F(PATH.beta1) + average * F(1 - PATH.beta1)
            v = v * F(PATH.beta2) + (average * average) * F(1 - PATH.beta2)
            moments[bucket] = (m, v)
            expected = precondition(m, v, PATH.first_scale(step + 1), PATH.second_scale(step + 1), PATH.eps)
            np.testing.assert_allclose(flat(outs[0]), expected, rtol=2e-5, atol=1e-6)
            for r, e in enumerate(engines):
                np.testing.assert_array_equal(flat(outs[r]), flat(outs[0]))
                np.testing.assert_array_equal(e.buckets[bucket].momentum, engines[0].buckets[bucket].momentum)
                np.testing.assert_array_equal(e.buckets[bucket].second_moment,
                                              engines[0].buckets[bucket].second_moment)

    run(adam_method(name, dense), size, dense + 1, check=check)


@pytest.mark.parametrize("name", [cls.name for cls in METHODS])
def test_sparse_steps_feed_back_the_clamped_update_exactly(name):
    """After the dense steps, per rank and bucket: u' = b1 u + (1-b1) g and v' = b2 v + (1-b2) g^2
    from the rank's own g; the accumulated vector is e + clamp(u' c1 / (sqrt(v' c2) + eps)); what
    left is exactly that where the residual was cleared, u' is never masked, and the average is
    the sum of what left over N, the same on every rank."""
    size, dense = 3, 2

    def check(step, engines, before, outputs):
        for bucket, (_, tensors, outs) in outputs.items():
            if step < dense or engines[0].buckets[bucket].dense:
                continue
            total = np.zeros(sum(t.size for t in tensors[0]), F)
            for r, e in enumerate(engines):
                e_old, u_old, v_old = before[r][bucket]
                g = flat(tensors[r])
                u_new = u_old * F(PATH.beta1) + g * F(1 - PATH.beta1)
                v_new = v_old * F(PATH.beta2) + (g * g) * F(1 - PATH.beta2)
                acc = e_old + sparse_step(u_new, v_new, step + 1)
                bucket_state = e.buckets[bucket]
                np.testing.assert_array_equal(bucket_state.momentum, u_new)
                np.testing.assert_array_equal(bucket_state.second_moment, v_new)
                residual = bucket_state.residual
                sent = residual != acc
                assert sent.any() or not acc.all()   # a clipped update may cancel to an exact 0
                np.testing.assert_array_equal(residual[sent], 0)
                np.testing.assert_allclose(residual[~sent], acc[~sent], rtol=1e-6, atol=1e-7)
                total += np.where(sent, acc, 0)
            np.testing.assert_allclose(flat(outs[0]), total / size, rtol=1e-5, atol=1e-6)
            for other in outs[1:]:
                np.testing.assert_array_equal(flat(other), flat(outs[0]))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run(adam_method(name, dense), size, dense + 3, check=check)


def test_dense_below_buckets_stay_adam_of_the_average():
    """A bucket of small tensors runs Adam of the average at every step, the sparse ones too."""
    algorithm = adam_method("exdyna", dense=1, dense_below=100, num_blocks=32)
    engines = run(algorithm, 2, 4)
    small = engines[0].buckets["dense_below"]
    assert small.dense and small.step == 4
    np.testing.assert_array_equal(small.momentum, engines[1].buckets["dense_below"].momentum)


def test_the_path_needs_dense_steps_and_no_second_momentum():
    assert ExDyna(0.01, adam=PATH).corrections.dense_steps == ADAM_DENSE_STEPS
    assert ExDyna(0.01).corrections.dense_steps == 0
    with pytest.raises(ConfigurationError, match="dense_steps must be at least 1"):
        ExDyna(0.01, adam=PATH, dense_steps=0)
    with pytest.raises(ConfigurationError, match="momentum=0"):
        ExDyna(0.01, adam=PATH, momentum=0.9)
    assert method("dgc", adam=PATH).corrections.momentum == 0.0   # DGC's 0.9 is for SGD
    assert method("dgc").corrections.momentum == 0.9
    with pytest.raises(ConfigurationError, match="momentum=0"):
        method("dgc", adam=PATH, momentum=0.9)
    with pytest.raises(ConfigurationError, match="AdamPath"):
        ExDyna(0.01, adam={"beta1": 0.9})


@pytest.mark.parametrize("betas, eps, match", [
    ((1.0, 0.999), 1e-8, "beta1 must be a number in"), ((0.9, -0.1), 1e-8, "beta2"),
    ((0.9, float("nan")), 1e-8, "beta2"), ((0.9, 0.999), 0.0, "eps must be a positive"),
    (("0.9", 0.999), 1e-8, "beta1")])
def test_bad_betas_and_eps_are_refused(betas, eps, match):
    with pytest.raises(ConfigurationError, match=match):
        AdamPath(*betas, eps)


def test_a_warm_up_longer_than_the_run_is_refused():
    TopK(0.01, adam=PATH, warmup_steps=50, total_steps=200)
    with pytest.raises(ConfigurationError, match="leave no sparse step in a run of total_steps=150"):
        TopK(0.01, adam=PATH, warmup_steps=50, total_steps=150)
    with pytest.raises(ConfigurationError, match="total_steps must be a positive integer"):
        TopK(0.01, total_steps=0)


def _engines(algorithm, size, nonfinite="skip"):
    return [Engine(copy.deepcopy(algorithm), NP, r, size, nonfinite=nonfinite) for r in range(size)]


def _steps(engines, group, rng, steps, outputs=None):
    size = len(engines)
    for step in range(steps):
        grads = grads_for(rng, size, step)
        outs = group.run([e.step("model", grads[r]) for r, e in enumerate(engines)])
        if outputs is not None:
            outputs.append(flat(outs[0]))


@pytest.mark.parametrize("cut", [1, 2, 4])   # inside the dense steps, at their end, after them
def test_resume_is_bitwise(cut):
    """A run saved at step ``cut`` and loaded into fresh engines continues bit for bit."""
    algorithm = adam_method("exdyna", dense=2, num_blocks=32)
    group = LocalGroup(2, NP)
    straight = []
    _steps(_engines(algorithm, 2), group, np.random.default_rng(7), 6, straight)
    rng = np.random.default_rng(7)
    first = _engines(algorithm, 2)
    resumed = []
    _steps(first, group, rng, cut, resumed)
    states = [e.state_dict() for e in first]
    second = _engines(algorithm, 2)
    for e, state in zip(second, states, strict=True):
        e.load_state_dict(copy.deepcopy(state))
    for step in range(cut, 6):
        grads = grads_for(rng, 2, step)
        outs = group.run([e.step("model", grads[r]) for r, e in enumerate(second)])
        resumed.append(flat(outs[0]))
    for a, b in zip(straight, resumed, strict=True):
        np.testing.assert_array_equal(a, b)


def test_another_world_size_keeps_the_moments():
    """Residuals restart at another world size; the saved rank's m and v carry over."""
    algorithm = adam_method("topk", dense=2, scope="model")
    engines = _engines(algorithm, 2)
    _steps(engines, LocalGroup(2, NP), np.random.default_rng(1), 3)
    state = engines[0].state_dict()
    wider = _engines(algorithm, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for e in wider:
            e.load_state_dict(copy.deepcopy(state))
    grads = grads_for(np.random.default_rng(2), 3, 0)
    LocalGroup(3, NP).run([e.step("model", grads[r]) for r, e in enumerate(wider)])
    bucket, saved = wider[2].buckets["model"], state["buckets"]["model"]
    assert bucket.step == 4
    g = flat(grads[2])
    np.testing.assert_array_equal(bucket.second_moment,
                                  saved["second_moment"] * F(PATH.beta2) + (g * g) * F(1 - PATH.beta2))
    np.testing.assert_array_equal(bucket.momentum,
                                  saved["momentum"] * F(PATH.beta1) + g * F(1 - PATH.beta1))


def test_elastic_adoption_takes_the_dense_steps_moments_from_the_agreed_rank():
    """During the dense steps m and v are the same on every rank: a process adopting the agreed
    state takes both from it (not its own m), so the ranks keep computing the same update."""
    algorithm = adam_method("topk", dense=3, scope="model")
    engines = _engines(algorithm, 2)
    _steps(engines, LocalGroup(2, NP), np.random.default_rng(3), 2)
    agreed = engines[0].agreed_state()
    newcomer = _engines(algorithm, 2)[1]
    newcomer.adopt(agreed, residuals={}, momenta={"model": np.full(sum(SIZES), 5.0, np.float32)})
    grads = grads_for(np.random.default_rng(4), 2, 2)
    pair = [engines[0], newcomer]
    outs = LocalGroup(2, NP).run([e.step("model", grads[r], check_layout=False) for r, e in enumerate(pair)])
    np.testing.assert_array_equal(flat(outs[0]), flat(outs[1]))
    # after the dense steps m is each rank's own: adopted from the process itself
    for step in range(3, 5):
        grads = grads_for(np.random.default_rng(step), 2, step)
        LocalGroup(2, NP).run([e.step("model", grads[r], check_layout=False) for r, e in enumerate(pair)])
    later = engines[0].agreed_state()
    assert later["buckets"]["model"]["agreed_momentum"] is None
    assert later["buckets"]["model"]["second_moment"] is not None   # a sound start for any process


def test_nonfinite_skip_leaves_the_moments_and_residual():
    algorithm = adam_method("exdyna", dense=1, num_blocks=32)
    engines = _engines(algorithm, 2)
    group, rng = LocalGroup(2, NP), np.random.default_rng(6)
    _steps(engines, group, rng, 2)
    bucket = engines[1].buckets["model"]
    kept = bucket.residual.copy(), bucket.momentum.copy(), bucket.second_moment.copy()
    grads = grads_for(rng, 2, 2)
    grads[1][0][0, 0] = np.nan
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        group.run([e.step("model", grads[r]) for r, e in enumerate(engines)])
    for field, value in zip(("residual", "momentum", "second_moment"), kept, strict=True):
        np.testing.assert_array_equal(getattr(engines[1].buckets["model"], field), value)


def test_take_back_of_a_dense_step_restores_the_moments():
    """nonfinite="raise": a bucket that finished a dense step which another bucket aborted gets
    its m and v back, so the step is applied nowhere."""
    algorithm = adam_method("topk", dense=3)   # per tensor: four buckets
    engines = _engines(algorithm, 2, nonfinite="raise")
    group = LocalGroup(2, NP)
    grads = grads_for(np.random.default_rng(8), 2, 0)
    group.run([e.step("p0", [grads[r][0]]) for r, e in enumerate(engines)])
    before = engines[0].buckets["p0"]
    m, v = before.momentum.copy(), before.second_moment.copy()
    group.run([e.step("p0", [grads[r][0]]) for r, e in enumerate(engines)])
    for e in engines:
        e.take_back(["p0"])
    np.testing.assert_array_equal(engines[0].buckets["p0"].momentum, m)
    np.testing.assert_array_equal(engines[0].buckets["p0"].second_moment, v)
    assert engines[0].buckets["p0"].step == 1


def test_checkpoints_carry_both_moments():
    for steps in (2, 3):   # at the end of the dense steps, and after the first sparse one
        engines = run(adam_method("micro", dense=2), 2, steps)
        saved = engines[0].state_dict()["buckets"]["model"]
        assert saved["second_moment"].shape == (sum(SIZES),) and "preconditioner" not in saved
        assert saved["momentum"] is not None and len(SHAPES) == len(saved["shapes"])


def test_a_file_of_the_frozen_second_moment_resumes_with_its_v():
    """Files saved when the path froze v after the dense steps hold its preconditioner
    p = 1 / (sqrt(v c2) + eps) instead of v: loading one recovers v."""
    algorithm = adam_method("micro", dense=2)
    engines = run(algorithm, 2, 3)
    fresh, kept = _engines(algorithm, 2), []
    for old, new in zip(engines, fresh, strict=True):
        state = copy.deepcopy(old.state_dict())
        v = state["buckets"]["model"].pop("second_moment")
        kept.append(v)
        inverse = F(1) / (np.sqrt(v * F(PATH.second_scale(2))) + F(PATH.eps))
        state["buckets"]["model"]["preconditioner"] = inverse
        new.load_state_dict(state)
    grads = grads_for(np.random.default_rng(1), 2, 3)
    LocalGroup(2, NP).run([e.step("model", grads[r]) for r, e in enumerate(fresh)])
    for r, e in enumerate(fresh):
        g = flat(grads[r])
        expected = kept[r] * F(PATH.beta2) + (g * g) * F(1 - PATH.beta2)
        np.testing.assert_allclose(e.buckets["model"].second_moment, expected, rtol=1e-3, atol=1e-12)
