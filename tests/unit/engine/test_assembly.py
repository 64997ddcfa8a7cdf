"""The step bookkeeping both PyTorch faces share (hvd_sparse/engine/assembly.py): a bucket is
ready once its last member arrived and is started once, the plan stays while the gradients do,
a started bucket cannot change its members, and ready times are each bucket's last arrival."""

from __future__ import annotations

import pytest

from hvd_sparse import ConfigurationError
from hvd_sparse.engine.assembly import Arrivals, Plan


def pairs(keys: list[str], sizes: list[int], dtypes: list[str]) -> list[tuple[str, list[str]]]:
    """A planner that puts consecutive keys two by two into buckets."""
    return [(f"b{i // 2}", keys[i:i + 2]) for i in range(0, len(keys), 2)]


def test_a_bucket_is_ready_once_complete_and_started_once():
    plan = Plan()
    plan.replan(pairs, ["a", "b", "c"], [1, 1, 1], ["float32"] * 3, set())
    assert plan.members == {"b0": ["a", "b"], "b1": ["c"]} and plan.bucket_of["b"] == ("b0", 1)
    step = Arrivals(began=10.0)
    step.file("b", "gb", 10.5)
    assert step.ready(plan) == [] and not step.complete(plan, "b0")
    step.file("c", "gc", 11.0)
    step.file("a", "ga", 12.0)
    assert step.ready(plan) == ["b0", "b1"]          # plan order
    assert step.take(plan, "b0") == ["ga", "gb"]      # bucket order, not arrival order
    assert step.ready(plan) == ["b1"] and step.missing(plan) == ["b1"]
    assert step.ready_times(plan) == {"b0": 2.0, "b1": 1.0}
    assert plan.covers(step.tensors) and not plan.covers(["a", "b"])


def test_a_started_bucket_keeps_its_members():
    plan = Plan()
    plan.replan(pairs, ["a", "b"], [1, 1], ["float32"] * 2, set())
    plan.replan(pairs, ["a", "b", "c"], [1, 1, 1], ["float32"] * 3, {"b0"})   # b0 unchanged: fine
    with pytest.raises(ConfigurationError, match="the set of gradients changed between steps"):
        plan.replan(pairs, ["x", "a", "b"], [1, 1, 1], ["float32"] * 3, {"b0"})
