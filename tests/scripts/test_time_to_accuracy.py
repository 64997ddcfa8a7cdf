"""scripts/time_to_accuracy.py: steps to the target from a curve, the composition with step
times (warm-up at dense's step time), the targets' verdicts, the report, the fp16 transport and
the early stop of a curve at the target."""

from __future__ import annotations

import dataclasses
import json
from unittest import mock

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("sklearn")

import time_to_accuracy as tta  # noqa: E402


def test_steps_to_target_is_the_first_evaluation_at_or_below_it():
    curve = [[50, 9.0], [100, 6.0], [150, 5.0], [200, 5.5]]
    assert tta.steps_to_target(curve, 6.0) == 100
    assert tta.steps_to_target(curve, 5.2) == 150
    assert tta.steps_to_target(curve, 4.9) is None


def test_warm_up_steps_are_charged_at_dense_step_time():
    curve = [[100, 8.0], [300, 5.0]]
    row = tta.compose_one(curve, 5.0, step=0.1, dense_step=1.0, warmup=200)
    assert row["steps"] == 300
    assert row["seconds"] == pytest.approx(200 * 1.0 + 100 * 0.1)
    unreached = tta.compose_one(curve, 4.0, step=0.1, dense_step=1.0, warmup=0)
    assert unreached["steps"] is None and "seconds" not in unreached and unreached["best"] == 5.0


def synthetic_report() -> dict:
    """Dense reaches its target at 1000 steps of 1 s; ExDyna at 1500 steps of 0.1 s; TopK never."""
    dense = [[s, 10.0 - s / 200] for s in range(100, 1100, 100)]   # ends at 5.0
    curves = {"dense/2": {"curve": dense}, "fp16/2": {"curve": dense},
              "exdyna-tracking/2": {"curve": [[500, 7.0], [1500, 5.0]]},
              "topk/2": {"curve": [[500, 7.0], [5000, 6.0]]}}
    steps = {"1gbit": {"2": {"dense": 1.0, "fp16": 0.6, "exdyna-tracking": 0.1, "topk": 0.2}}}
    return {"curves": curves, "step_times": steps}


def test_composition_gives_speedups_over_dense_and_unreached_rows():
    report = synthetic_report()
    table = tta.compose(tta.WORD, report)
    entry = table["1gbit"]["2"]
    assert entry["target"] == pytest.approx(5.0 * (1 + tta.TOLERANCE))
    rows = entry["rows"]
    # dense is within 2% of its final perplexity (5.1) at step 1000 (5.0), not before (5.5 at 900)
    assert rows["dense"]["steps"] == 1000 and rows["dense"]["speedup"] == pytest.approx(1.0)
    assert rows["fp16"]["speedup"] == pytest.approx(1.0 / 0.6)
    assert rows["exdyna-tracking"]["speedup"] == pytest.approx(1000.0 / 150.0)
    assert rows["topk"]["steps"] is None and "speedup" not in rows["topk"]
    targets = tta.judge(tta.WORD, table)
    exdyna = next(t for t in targets if "exdyna-tracking" in t["target"])
    assert exdyna["met"] and "6.67x" in exdyna["measured"]
    assert not next(t for t in targets if "micro" in t["target"])["met"]   # no curve: 0x
    text = tta.markdown(tta.WORD, report, table, targets, None)
    assert "| exdyna-tracking | 1500 | 5.00 | 100 | 150 (6.67x) |" in text
    assert "| topk | not in 5000 | 6.00 | 200 | - |" in text


def test_step_times_come_from_bench_e2e_jobs_of_the_task_model(tmp_path):
    job = {"model": tta.WORD.e2e_model, "net": "1gbit", "size": 2,
           "summary": {"dense": {"step_seconds": {"median": 0.5}},
                       "exdyna-tracking": {"step_seconds": {"median": 0.1}}}}
    other = dict(job, model="mlp25m")
    path = tmp_path / "e2e.json"
    path.write_text(json.dumps({"jobs": [other, job]}))
    assert tta.load_step_times(tta.WORD, [path]) == {"1gbit": {"2": {"dense": 0.5, "exdyna-tracking": 0.1}}}


def test_fp16_transport_rounds_the_allreduce_to_half_precision():
    import hvd_sparse.sim as sim

    torch.set_num_threads(1)
    plain = sim.simulate("dense", 2, 3, task="digits-mlp", lr=0.1)
    with mock.patch.object(sim, "LocalGroup", tta.fp16_group_class()):
        half = sim.simulate("dense", 2, 3, task="digits-mlp", lr=0.1)
    assert plain[0]["loss"] == half[0]["loss"]          # same start
    assert plain[-1]["loss"] != half[-1]["loss"]        # the average was rounded ...
    assert half[-1]["loss"] == pytest.approx(plain[-1]["loss"], rel=1e-2)   # ... only slightly


def test_a_curve_stops_at_the_target():
    torch.set_num_threads(1)
    setup = dataclasses.replace(tta.WORD, task="lstm", recipe=dict(tta.WORD.recipe, evaluate_every=2,
                                                                   lr=1.0))
    run = tta.train_curve(setup, "exdyna-tracking", 2, 50, target=1e9)
    assert [step for step, _ in run["curve"]] == [2]
    full = tta.train_curve(setup, "dense", 2, 4, target=None)
    assert [step for step, _ in full["curve"]] == [2, 4]


def test_the_transformer_study_trains_with_adamw_and_charges_the_dense_steps():
    method, options, density, optimizer = tta.GPT.training("exdyna-tracking+adam")
    assert (method, options, density) == ("exdyna", {"threshold_scaling": "tracking"}, 0.01)
    assert optimizer == {"lr": 1e-3, "batch_size": 8, "optimizer": "adamw", "weight_decay": 0.01,
                         "adam_path": True}
    assert tta.GPT.training("topk")[3]["adam_path"] is False
    assert tta.GPT.training("fp16")[0] == "dense"
    assert tta.GPT.warmup_steps("micro+adam") == 100 and tta.GPT.warmup_steps("topk") == 0
    assert tta.WORD.warmup_steps("exdyna-tracking+corr") > 0


def test_the_transformer_study_judges_each_seed_method_on_the_adam_path():
    rows = {"dense": {"steps": 1000, "best": 40.0, "steps_run": 1000, "speedup": 1.0},
            "exdyna-tracking+adam": {"steps": 1500, "best": 40.5, "steps_run": 1500, "speedup": 1.2},
            "micro+adam": {"steps": 2500, "best": 40.7, "steps_run": 2500, "speedup": 0.8},
            "deft+adam": {"steps": None, "best": 44.0, "steps_run": 3000}}
    targets = tta.judge(tta.GPT, {"1gbit": {"2": {"target": 40.8, "rows": rows}}})
    verdicts = {t["target"].split(": ")[1].split()[0]: (t["met"], t["measured"]) for t in targets}
    assert verdicts["exdyna-tracking+adam"] == (True, "step 1500, 1.20x dense's speed")
    assert verdicts["micro+adam"][0] is False                     # reached, but later than dense
    assert verdicts["deft+adam"] == (False, "not reached in 3000 steps (best 44.00)")
    assert verdicts["lags+adam"] == (False, "no curve")


def test_the_command_line_takes_the_study_defaults_and_refuses_other_configurations():
    args = tta.parse_args(["--task", "gpt"])
    assert args.configs == list(tta.GPT.configs) and args.sizes == [2] and args.nets == ["1gbit"]
    assert args.out_dir == tta.GPT.out_dir
    with pytest.raises(SystemExit):
        tta.parse_args(["--task", "gpt", "--configs", "micro+corr"])
    with pytest.raises(SystemExit):
        tta.parse_args(["--task", "gpt", "--validate", "dense@1gbit"])


def test_the_shared_second_moments_step_is_composed_from_two_measured_ones():
    """``+adam-shared-v``: timed as itself (its median is a step between refreshes) and as
    ``+adam-refresh`` (a refresh every step); one step in ``SHARED_V_EVERY`` is a refresh. A
    configuration without both measured has no step."""
    import bench_e2e

    assert tta.e2e_configs("micro+adam-shared-v") == ["micro+adam-shared-v", "micro+adam-refresh"]
    assert tta.e2e_configs("micro+adam") == ["micro+adam"]
    for config in tta.e2e_configs("micro+adam-shared-v"):
        assert bench_e2e.known(config)
    steps = {"micro+adam": 0.040, "micro+adam-shared-v": 0.038, "micro+adam-refresh": 0.078}
    assert tta.step_seconds("micro+adam", steps) == 0.040
    assert tta.step_seconds("micro+adam-shared-v", steps) == pytest.approx(0.038 + 0.040 / tta.SHARED_V_EVERY)
    del steps["micro+adam-refresh"]
    assert tta.step_seconds("micro+adam-shared-v", steps) is None
