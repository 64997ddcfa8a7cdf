"""The verdicts of scripts/soak.py on synthetic records: each target can be met and missed."""

from __future__ import annotations

import numpy as np
import pytest
import soak

STEPS, TARGET = 3000, 0.01


def record(density=1.0, rss_growth_mb=0.0, residual_growth=1.0, digest="a", seed=0) -> dict:
    rng = np.random.default_rng(seed)
    steps = np.arange(0, STEPS, soak.SAMPLE_EVERY)
    residual = np.where(steps >= 2 * STEPS // 3, residual_growth, 1.0) * (5 + rng.uniform(0, 0.1, steps.size))
    rss = 500 + rss_growth_mb * steps / 1000 + rng.uniform(0, 0.05, steps.size)
    return {"density": list(TARGET * density * (1 + rng.uniform(-0.01, 0.01, STEPS))),
            "samples": [list(x) for x in zip(steps, residual, rss, strict=True)],
            "loss": [[STEPS - 1, 0.1]], "seconds": 1.0, "weights_digest": digest, "accuracy": 0.95}


def verdicts(ranks) -> list[bool]:
    return list(soak.judge("m", ranks, TARGET, 500)["targets"].values())


def test_a_healthy_run_meets_every_target():
    assert verdicts([record(), record(seed=1)]) == [True, True, True, True]


@pytest.mark.parametrize(("broken", "missed"), [
    ({"digest": "b"}, 0), ({"residual_growth": 3.0}, 1), ({"density": 1.08}, 2), ({"rss_growth_mb": 2.0}, 3)])
def test_each_target_can_be_missed(broken, missed):
    result = verdicts([record(**broken), record(seed=1)])   # density: read on rank 0
    assert result == [i != missed for i in range(4)]
