"""The Adam path's shared second moment (``second_moment_refresh``; engine/adam.py), for every
method: on the first sparse step and every K-th after, v is refreshed from the dense average of
the raw gradient, identically on every rank, and only read in between; m stays each rank's own;
error feedback on the clamped update stays exact. NumPy backend, N simulated ranks."""

from __future__ import annotations

import copy
import warnings

import numpy as np
import pytest

from hvd_sparse import ConfigurationError
from hvd_sparse.algorithms import METHODS, TopK
from hvd_sparse.comm.local import LocalGroup
from tests.unit.engine.test_adam_path import PATH, F, _engines, adam_method, precondition
from tests.unit.engine.test_corrections import flat, grads_for, run

EVERY = 2


def shared_method(name, dense=2, **options):
    return adam_method(name, dense, second_moment_refresh=EVERY, **options)


def v_updates(step, dense):
    """The steps the shared v stands for at sparse step ``step``."""
    return dense + ((step - dense) // EVERY + 1) * EVERY


@pytest.mark.parametrize("name", [cls.name for cls in METHODS])
def test_the_shared_v_is_the_averages_and_error_feedback_stays_exact(name):
    """At a refresh v' = b2^K v + (1 - b2^K) a^2 of the average a of the raw gradients, the same
    array on every rank; between refreshes v is untouched. u' = b1 u + (1-b1) g from the rank's own
    g; the accumulated vector is e + clamp(u' c1 / (sqrt(v' c2) + eps)), c2 that of the steps v
    stands for; what left is that vector where the residual was cleared, and the average is the
    sum of what left over N."""
    size, dense = 3, 2
    keep = F(PATH.beta2 ** EVERY)

    def check(step, engines, before, outputs):
        for bucket, (_, tensors, outs) in outputs.items():
            if step < dense or engines[0].buckets[bucket].dense:
                continue
            average = sum(flat(tensors[r]) for r in range(size)) / F(size)
            _, _, v_old = before[0][bucket]
            refreshed = (step - dense) % EVERY == 0
            v_new = v_old * keep + (average * average) * (F(1) - keep) if refreshed else v_old
            total = np.zeros(average.size, F)
            for r, e in enumerate(engines):
                e_old, u_old, _ = before[r][bucket]
                g = flat(tensors[r])
                u_new = u_old * F(PATH.beta1) + g * F(1 - PATH.beta1)
                state = e.buckets[bucket]
                np.testing.assert_allclose(state.second_moment, v_new, rtol=1e-5, atol=0)
                np.testing.assert_array_equal(state.second_moment, engines[0].buckets[bucket].second_moment)
                if not refreshed:
                    np.testing.assert_array_equal(state.second_moment, v_old)
                np.testing.assert_array_equal(state.momentum, u_new)
                update = precondition(u_new, state.second_moment, PATH.first_scale(step + 1),
                                      PATH.second_scale(v_updates(step, dense)), PATH.eps)
                acc = e_old + np.clip(update, -F(PATH.update_bound), F(PATH.update_bound))
                sent = state.residual != acc
                np.testing.assert_array_equal(state.residual[sent], 0)
                np.testing.assert_array_equal(state.residual[~sent], acc[~sent])
                total += np.where(sent, acc, 0)
            np.testing.assert_allclose(flat(outs[0]), total / size, rtol=1e-5, atol=1e-6)
            for other in outs[1:]:
                np.testing.assert_array_equal(flat(other), flat(outs[0]))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run(shared_method(name, dense), size, dense + 5, check=check)


def _run(algorithm, size, steps, seed=5, nonfinite="skip", engines=None, start=0):
    engines = engines or _engines(algorithm, size, nonfinite)
    rng, group, outputs = np.random.default_rng(seed), LocalGroup(size, engines[0].backend), []
    for step in range(start):
        grads_for(rng, size, step)
    for step in range(start, steps):
        grads = grads_for(rng, size, step)
        outs = group.run([e.step("model", grads[r]) for r, e in enumerate(engines)])
        outputs.append(flat(outs[0]))
    return engines, outputs


def test_the_refresh_costs_one_dense_allreduce_in_the_byte_counts():
    """stats() counts the refresh: K = 2 over 4 sparse steps is 2 allreduces of the bucket; so do
    the step's bucket statistics (what the simulator sums), on a refresh step only."""
    numel = 40 * 30 + 30 + 20 * 25 + 25
    for steps, refreshed in ((3, True), (4, False)):
        plain, _ = _run(adam_method("topk", 2, scope="model"), 2, steps)
        shared, _ = _run(shared_method("topk", scope="model"), 2, steps)
        extra = shared[0].buckets["model"].stats.bytes_sent - plain[0].buckets["model"].stats.bytes_sent
        assert extra == (numel * 4 if refreshed else 0)
    plain, _ = _run(adam_method("topk", 2, scope="model"), 2, 6)
    shared, _ = _run(shared_method("topk", scope="model"), 2, 6)
    for field in ("bytes_sent_total", "bytes_received_total"):
        assert shared[0].stats()[field] - plain[0].stats()[field] == 2 * numel * 4
    assert shared[0].stats()["dense_bytes_total"] == plain[0].stats()["dense_bytes_total"]


@pytest.mark.parametrize("cut", [2, 3, 4])   # at the first refresh, between two, at the next
def test_resume_is_bitwise(cut):
    algorithm = shared_method("exdyna", num_blocks=32)
    _, straight = _run(algorithm, 2, 7)
    first, before = _run(algorithm, 2, cut)
    second = _engines(algorithm, 2)
    for e, state in zip(second, [e.state_dict() for e in first], strict=True):
        e.load_state_dict(copy.deepcopy(state))
    _, after = _run(algorithm, 2, 7, engines=second, start=cut)
    for a, b in zip(straight, before + after, strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_non_finite_rank_sends_zeros_to_the_refresh_under_skip():
    algorithm = shared_method("topk", scope="model")
    engines, _ = _run(algorithm, 2, 2)
    v = engines[0].buckets["model"].second_moment.copy()
    grads = grads_for(np.random.default_rng(9), 2, 2)
    grads[1][0][0, 0] = np.inf
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        LocalGroup(2, engines[0].backend).run([e.step("model", grads[r]) for r, e in enumerate(engines)])
    half = flat(grads[0]) / F(2)
    keep = F(PATH.beta2 ** EVERY)
    for e in engines:
        np.testing.assert_allclose(e.buckets["model"].second_moment, v * keep + (half * half) * (F(1) - keep),
                                   rtol=1e-5)
        assert np.isfinite(e.buckets["model"].second_moment).all()


def test_under_raise_the_refresh_keeps_v_and_take_back_restores_it():
    """A non-finite gradient poisons the refresh: v stays on every rank and every rank raises. A
    refreshed bucket that another bucket's failure takes back gets its v back."""
    algorithm = shared_method("topk", scope="model")
    engines, _ = _run(algorithm, 2, 2, nonfinite="raise")
    v = engines[0].buckets["model"].second_moment.copy()
    grads = grads_for(np.random.default_rng(9), 2, 2)
    bad = copy.deepcopy(grads)
    bad[0][1][3] = np.nan
    group = LocalGroup(2, engines[0].backend)
    with pytest.raises(FloatingPointError):
        group.run([e.step("model", bad[r]) for r, e in enumerate(engines)])
    for e in engines:
        np.testing.assert_array_equal(e.buckets["model"].second_moment, v)
    group.run([e.step("model", grads[r]) for r, e in enumerate(engines)])
    assert not np.array_equal(engines[0].buckets["model"].second_moment, v)
    for e in engines:
        e.take_back(["model"])
        np.testing.assert_array_equal(e.buckets["model"].second_moment, v)
        assert e.buckets["model"].step == 2


def test_the_option_is_checked():
    with pytest.raises(ConfigurationError, match="not on the Adam path: pass optimizer="):
        TopK(0.01, second_moment_refresh=10)
    with pytest.raises(ConfigurationError, match="second_moment_refresh must be a non-negative integer"):
        TopK(0.01, adam=PATH, second_moment_refresh=-1)
    assert TopK(0.01, adam=PATH, second_moment_refresh=10).corrections.second_moment_refresh == 10
