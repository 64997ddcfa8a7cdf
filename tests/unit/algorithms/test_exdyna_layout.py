"""MiCRO/ExDyna control state: ExDyna's typed block layout, checkpoints as plain data, checkpoints
of the version whose layout was a dict (tests/fixtures/exdyna_state_v1.py) resumed with the same
decisions, unreadable states refused with the fix, and rebalancing at one point of the step."""

from __future__ import annotations

import inspect
import json
import pickle

import pytest

from hvd_sparse import ConfigurationError
from hvd_sparse.algorithms import DEFT, ExDyna, MiCRO, TopK
from hvd_sparse.algorithms.base import Algorithm
from hvd_sparse.algorithms.blocks import BlockLayout
from hvd_sparse.algorithms.micro import ExclusiveControl
from hvd_sparse.engine import Engine
from tests.fixtures.exdyna_state_v1 import (
    FIXTURE,
    METHODS,
    NUMEL,
    RESIZED,
    RESIZED_FOR,
    RESUMED_FOR,
    SAVED_AT,
    SIZE,
    engines,
    run,
)


@pytest.fixture(scope="module")
def written_before() -> dict:
    return json.loads(FIXTURE.read_text())


def with_control(state: dict, control: dict) -> dict:
    """``state`` (an engine's state_dict or agreed_state) with the model bucket's control replaced."""
    bucket = {**state["buckets"]["model"], "control": control}
    return {**state, "buckets": {"model": bucket}}


def control_of(engine: Engine) -> ExclusiveControl:
    return engine.buckets["model"].control


# --- the typed layout ----------------------------------------------------------------------------------
def test_each_rebalance_mode_fills_its_fields_of_the_layout():
    for method in METHODS:
        group = engines(method, SIZE)
        run(group, 0, 3)
        layout = control_of(group[1]).layout
        if method.startswith("micro"):
            assert layout is None
            continue
        assert isinstance(layout, BlockLayout)
        assert (layout.num_blocks, layout.block, layout.tail) == (93, 32, NUMEL - 93 * 32)
        neighbour, histogram = method == "exdyna-neighbour", method == "exdyna-histogram"
        assert (layout.blocks is None) == neighbour and sum(layout.blocks or [93]) == 93
        assert (layout.own is not None) == (layout.own_count is not None) == neighbour
        assert (layout.block_loads is not None) == histogram


def test_control_state_is_plain_data_that_round_trips():
    for method in METHODS:
        group = engines(method, SIZE)
        run(group, 0, 5)
        state = group[0].state_dict()["buckets"]["model"]["control"]
        assert b"hvd_sparse" not in pickle.dumps(state)   # loads without importing hvd_sparse
        assert json.loads(json.dumps(state)) == state     # ints, floats, lists, dicts, None
        if "layout" in state:
            assert BlockLayout.from_state(state["layout"]).to_state() == state["layout"]


# --- checkpoints of the dict-layout version ------------------------------------------------------------
@pytest.mark.parametrize("method", list(METHODS))
def test_checkpoints_of_the_dict_layout_version_resume_with_its_decisions(method, written_before):
    before = written_before[method]
    current = engines(method, SIZE)
    run(current, 0, SAVED_AT)
    saved = [engine.state_dict() for engine in current]
    # The same control state as that version wrote, but for the format number and MiCRO's
    # always-empty layout.
    for state, old in zip(saved, before["controls"], strict=True):
        new = state["buckets"]["model"]["control"]
        assert new.pop("format") == 1
        assert new == {key: value for key, value in old.items() if value != {}}
    assert METHODS[method].agreed_control(before["controls"][0]) == before["agreed"]
    if method.startswith("exdyna"):   # the scenario does move boundaries
        assert any(ranks[0]["rebalance_moves"] for ranks in before["resumed"])

    resumed = engines(method, SIZE)
    for engine, state, old in zip(resumed, saved, before["controls"], strict=True):
        engine.load_state_dict(with_control(state, old))
    assert run(resumed, SAVED_AT, RESUMED_FOR) == before["resumed"]

    resized, adopted = engines(method, RESIZED), engines(method, RESIZED)
    agreed = with_control(current[0].agreed_state(), before["agreed"])
    with pytest.warns(UserWarning, match="rebuilt"):
        for rank in range(RESIZED):
            resized[rank].load_state_dict(with_control(saved[rank % SIZE], before["controls"][rank % SIZE]))
            adopted[rank].adopt(agreed)
        assert run(resized, SAVED_AT, RESIZED_FOR) == before["resized"]
    assert run(adopted, SAVED_AT, RESIZED_FOR) == before["adopted"]


@pytest.mark.parametrize(("method", "change", "message"), [
    ("exdyna", lambda state: {**state, "format": 99}, "format 99"),
    ("exdyna", lambda state: {k: v for k, v in state.items() if k != "layout"}, "no layout"),
    ("exdyna", lambda state: {**state, "layout": {**state["layout"], "edges": [0]}}, "unknown 'edges'"),
    ("exdyna-neighbour", lambda state: {**state, "layout": {"own": [0, 31]}}, "layout with no num_blocks"),
    ("micro-tracking", lambda state: [state], "a list, not a dict"),
    ("micro-tracking", lambda state: {k: v for k, v in state.items() if k != "threshold"}, "no threshold"),
])
def test_unreadable_control_states_are_refused_with_the_fix(method, change, message):
    engine = engines(method, 1)[0]
    run([engine], 0, 2)
    state = engine.state_dict()
    broken = with_control(state, change(state["buckets"]["model"]["control"]))
    with pytest.raises(ConfigurationError, match=message) as refused:
        engine.load_state_dict(broken)
    assert "load a checkpoint saved by hvd_sparse's" in str(refused.value)


# --- where the step changes the partitions -------------------------------------------------------------
@pytest.mark.parametrize("method", ["exdyna", "exdyna-histogram"])
def test_partitions_move_only_in_rebalance_partitions(method, monkeypatch):
    algorithm, moved = METHODS[method], []

    def partitions(control: ExclusiveControl) -> tuple:
        return control.bounds.tolist(), list(control.layout.blocks)

    rebalance = algorithm.rebalance_partitions

    def watched_rebalance(control, ctx):
        before = partitions(control)
        yield from rebalance(control, ctx)
        moved.append(partitions(control) != before)

    def keeping_partitions(name):
        original = getattr(algorithm, name)

        def watched(*args):
            control = next(arg for arg in args if isinstance(arg, ExclusiveControl))
            before = partitions(control)
            result = original(*args)
            assert partitions(control) == before, f"{name} moved the partitions"
            return result
        return watched

    monkeypatch.setattr(algorithm, "rebalance_partitions", watched_rebalance)
    for name in ("select_local", "accumulate_select", "record_counts", "observe"):
        monkeypatch.setattr(algorithm, name, keeping_partitions(name))
    run(engines(method, SIZE), 0, 10)
    assert len(moved) == 9 * SIZE and any(moved)   # every step but the first, on every rank


def test_select_collectives_is_one_property_from_the_base_class():
    assert isinstance(inspect.getattr_static(Algorithm, "select_collectives"), property)
    assert [algorithm.select_collectives for algorithm in (
        ExDyna(0.01), ExDyna(0.01, rebalance="neighbour"), ExDyna(0.01, rebalance="histogram"),
        MiCRO(0.01), DEFT(0.01), TopK(0.01))] == [False, True, False, False, True, False]
