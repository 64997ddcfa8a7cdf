"""The verdicts of scripts/convergence.py and scripts/fidelity.py (met / not met) on synthetic runs,
and one tiny real run through each script's own summarising code."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("sklearn")

import convergence  # noqa: E402
import fidelity  # noqa: E402

from hvd_sparse.sim import simulate  # noqa: E402


def fake_run(task: str, method: str, density: float, final: float, imbalance: float = 0.0,
             ratio: float = 1.0, seed: int = 0) -> dict:
    return {"task": task, "method": method, "density": density, "seed": seed, "steps": 10,
            "metric": "accuracy" if task == "digits" else "perplexity", "final": final,
            "curve": [[10, final]], "imbalance_mean": imbalance, "imbalance_p90": imbalance,
            "density_ratio_mean": ratio, "buildup_mean": ratio}


def verdicts(runs: list[dict]) -> dict:
    report = {"runs": {str(i): r for i, r in enumerate(runs)}}
    return {(t["target"].split()[0], t["method"]): t["met"] for t in convergence.judge(report)}


def test_accuracy_and_perplexity_targets():
    runs = [fake_run("digits", "dense", 1.0, 0.980), fake_run("digits", "exdyna", 0.01, 0.9705),
            fake_run("digits", "exdyna-tracking", 0.01, 0.9695),
            fake_run("lstm", "dense", 1.0, 3.00), fake_run("lstm", "exdyna", 0.01, 3.14),
            fake_run("lstm", "exdyna-tracking", 0.01, 3.16)]
    met = verdicts(runs)
    assert met[("digits", "exdyna")] and not met[("digits", "exdyna-tracking")]   # -0.95 vs -1.05 pt
    assert met[("LSTM", "exdyna")] and not met[("LSTM", "exdyna-tracking")]       # +4.7% vs +5.3%
    better = verdicts([fake_run("digits", "dense", 1.0, 0.95), fake_run("digits", "exdyna", 0.01, 0.99)])
    assert better[("digits", "exdyna")]                                           # better than dense


def test_padding_and_density_targets():
    runs = [fake_run("lstm", "exdyna", 0.01, 3.0, imbalance=0.09),
            fake_run("lstm", "exdyna-tracking", 0.01, 3.0, imbalance=0.11, ratio=1.049),
            fake_run("lstm", "exdyna-tracking", 0.001, 3.0, imbalance=0.05, ratio=0.94)]
    targets = convergence.judge({"runs": {str(i): r for i, r in enumerate(runs)}})
    # labels name the budget: "exdyna (lstm, ρ=0.01, 10 steps)"
    by = {(t["target"][:8], t["method"].rsplit(",", 1)[0] + ")"): t["met"] for t in targets}
    assert all(t["method"].endswith(" steps)") for t in targets)
    assert by[("ExDyna p", "exdyna (lstm, ρ=0.01)")]
    assert not by[("ExDyna p", "exdyna-tracking (lstm, ρ=0.01)")]
    assert by[("achieved", "exdyna-tracking (lstm, ρ=0.01)")]
    assert not by[("achieved", "exdyna-tracking (lstm, ρ=0.001)")]


def test_condensed_run_and_buildup_verdict():
    torch.set_num_threads(1)
    records = simulate("exdyna", 3, 6, density=0.02, task="digits-mlp", evaluate_every=3)
    run = convergence.condense(records, "digits", "exdyna", 0.02, 0, 1.0)
    assert run["final"] == records[-1]["accuracy"] and [s for s, _ in run["curve"]] == [3, 6]
    assert len(run["density_ratio"]) == len(run["imbalance"]) == 6
    row = {"method": "micro", "world_size": 2, "steps": 4, "k": 10, "union_over_k": 1.0,
           "union_over_k_max": 1.0, "union_over_counts": 1.0, "union_is_sum_of_counts": True,
           "seconds_per_step": 0.1}
    report = {"config": {"quick": True, "buildup": {"task": "digits", "density": 0.001, "steps": 4}},
              "buildup": {"micro/2": row}}
    assert "**met**" in fidelity.markdown(report, [])
    assert [t["met"] for t in fidelity.judge(report)] == [True]
    report["buildup"]["micro/2"] = dict(row, union_is_sum_of_counts=False)
    assert "**NOT MET**" in fidelity.markdown(report, [])
    assert [t["met"] for t in fidelity.judge(report)] == [False]


def test_report_groups_targets_and_explains_misses(tmp_path):
    import json

    import report

    (tmp_path / "convergence.json").write_text(json.dumps({"targets": [
        {"target": "ExDyna padding waste ≤ 10% of the union", "method": "a", "met": True, "measured": "5%"},
        {"target": "ExDyna padding waste ≤ 10% of the union", "method": "b", "met": False,
         "measured": "30%"}]}))
    (tmp_path / "e2e.json").write_text(json.dumps({"targets": [
        {"target": "exdyna step <= 0.35 x dense", "met": True, "verdict": "met (within noise)",
         "figure": "0.3x"}]}))
    rows = report.collected_targets(tmp_path)
    assert ("ExDyna padding waste ≤ 10% of the union (convergence runs)", "not met (1 of 2 runs)",
            "a: 5%; b: 30%") in rows
    assert ("exdyna step <= 0.35 x dense", "met (within noise)", "0.3x") in rows
    notes = "\n".join(report.cause_notes(rows))
    assert "Padding waste" in notes and "End to end" in notes and "Perplexity" not in notes
    assert report.relink("![p](x.png) ![q](http://h/y.png) [r](../../docs/r.md) [s](#s)", "bench/a") == \
        "![p](bench/a/x.png) ![q](http://h/y.png) [r](docs/r.md) [s](#s)"
    assert report.command_text("python a.py --out x (note on `b`)") == "`python a.py --out x` (note on `b`)"
    assert report.command_text("python a.py (root); then b") == "`python a.py (root); then b`"
    assert report.nest_headings("# A\n\n## B\n```\n# kept\n```\n### C") == \
        "### A\n\n#### B\n```\n# kept\n```\n##### C"
    assert report.nest_headings("### A\n#### B\nno #") == "### A\n#### B\nno #"


def test_a_missed_momentum_floor_target_is_explained():
    """The note on the momentum path's floor shows under the table only when ExDyna's or MiCRO's
    row of bench_select's --momentum run is not met (its keys are the rows' title prefixes)."""
    import bench_select
    import report

    def rows(met):
        title = f"micro per-rank step ≤ {bench_select.MOMENTUM_FLOOR_RATIO_MAX['micro']}× " \
                f"{bench_select.MOMENTUM_FLOOR} at N = 4, 25M elements, kernels on, momentum=0.9"
        return [(title, "met" if met else "not met", "1.46×")]

    assert "momentum path against its floor" in "\n".join(report.cause_notes(rows(False)))
    assert report.cause_notes(rows(True)) == []


def test_selection_targets_are_judged_by_the_benchmark_itself():
    import bench_select

    def figures(seconds, select=0.0):
        return {"seconds": seconds, "select_seconds": select, "over_floor": seconds / 0.01}

    def row(n, size, exdyna, select, topk=None, exdyna_off=0.03):
        methods = {"exdyna": {**figures(exdyna, select), "kernels": {
            "on": figures(exdyna, select), "off": figures(exdyna_off, select)}}}
        if topk:
            methods["topk"] = {**figures(topk), "kernels": {"on": figures(topk), "off": figures(10 * topk)}}
        return {"n": n, "world_size": size, "floor_seconds": 0.01, "methods": methods}

    result = {"sizes": [row(25_000_000, 4, 0.012, 0.005, topk=0.05), row(10**8, 4, 0.014, 0.005)],
              "world_sizes": [row(10**8, 1, 0.2, 0.16), row(10**8, 8, 0.05, 0.045)],
              "memory_copies_per_rank": 2.5, "memory_copies_by_kernels": {"on": 2.5, "off": 2.4}}
    def key(target):
        words = target.split()
        return "memory" if "memory" in words else "selection" if "selection" in words else \
            f"{words[0]} {next(w for w in words if w.endswith('M'))}"

    verdicts = {key(t["target"]): t["met"] for t in bench_select.judge(result)}
    assert verdicts == {"exdyna 25M": True, "topk 25M": False,       # 1.2x; 5x > 4x
                        "exdyna 100M": False,                        # 1.4x > 1.3x
                        "memory": False}                             # 2.5 > 2
    assert "kernels off 3.00×" in bench_select.judge(result)[0]["figure"]
    result["memory_copies_per_rank"] = 1.9
    assert bench_select.judge(result)[-1]["met"]


def test_tensorflow_rows_are_judged_against_their_own_limits():
    """The TF backend's rows: ExDyna and MiCRO within 2x the floor, the top-k family within 4x."""
    import bench_select

    def figures(seconds):
        return {"seconds": seconds, "over_floor": seconds / 0.01}

    result = {"sizes": [{"n": 25_000_000, "world_size": 4, "floor_seconds": 0.01, "methods": {},
                         "tensorflow": {"exdyna": figures(0.019), "micro": figures(0.021),
                                        "topk": figures(0.039), "randomk": figures(0.5)}}],
              "world_sizes": []}
    verdicts = {t["target"].split()[0]: t["met"] for t in bench_select.judge(result)}
    assert verdicts == {"exdyna": True, "micro": False, "topk": True}   # randomk: no TF target
    assert all("TensorFlow backend" in t["target"] for t in bench_select.judge(result))


def test_a_momentum_run_is_judged_on_the_momentum_floor():
    """``--momentum``: ExDyna and MiCRO against the floor of that path (one pass over u, g, e),
    the other methods and ExDyna's memory (which the velocity grows by a copy) without targets."""
    import bench_select

    def figures(seconds, momentum_floor=0.02):
        return {"seconds": seconds, "select_seconds": 0.0, "over_floor": seconds / 0.01,
                "over_momentum_floor": seconds / momentum_floor}

    methods = {name: {**figures(seconds), "kernels": {"on": figures(seconds), "off": figures(3 * seconds)}}
               for name, seconds in (("exdyna", 0.024), ("micro", 0.028), ("topk", 0.09))}
    result = {"momentum": 0.9, "nesterov": False, "memory_copies_per_rank": 2.9,
              "sizes": [{"n": 25_000_000, "world_size": 4, "floor_seconds": 0.01,
                         "momentum_floor_seconds": 0.02, "methods": methods}], "world_sizes": []}
    targets = bench_select.judge(result)
    assert [(t["target"].split()[0], t["met"]) for t in targets] == [("exdyna", True), ("micro", False)]
    assert "momentum floor" in targets[0]["target"] and "momentum=0.9" in targets[0]["target"]
    assert targets[0]["figure"].startswith("1.20× (24.0 ms vs 20.0 ms); kernels off 3.60×")
    assert bench_select.options_for("exdyna", 0.9, True) == {**bench_select.OPTIONS["exdyna"],
                                                             "momentum": 0.9, "nesterov": True}
    assert bench_select.options_for("topk") == bench_select.OPTIONS["topk"]
    assert bench_select.options_for("dgc") == bench_select.OPTIONS["dgc"]   # its own momentum


def test_an_adam_run_is_judged_on_the_adam_floor():
    """``--adam``: ExDyna and MiCRO against the floor of the Adam path's accumulation (one pass
    over g, u, v, e), every method with the path's options (one dense step)."""
    import bench_select

    def figures(seconds):
        return {"seconds": seconds, "select_seconds": 0.0, "over_floor": seconds / 0.01,
                "over_momentum_floor": seconds / 0.03}

    methods = {name: {**figures(seconds), "kernels": {"on": figures(seconds), "off": figures(3 * seconds)}}
               for name, seconds in (("exdyna", 0.036), ("micro", 0.042))}
    result = {"momentum": 0.0, "adam": True, "memory_copies_per_rank": 3.1,
              "sizes": [{"n": 25_000_000, "world_size": 4, "floor_seconds": 0.01,
                         "momentum_floor_seconds": 0.03, "methods": methods}], "world_sizes": []}
    targets = bench_select.judge(result)
    assert [(t["target"].split()[0], t["met"]) for t in targets] == [("exdyna", True), ("micro", False)]
    assert bench_select.ADAM_FLOOR in targets[0]["target"] and "on the Adam path" in targets[0]["target"]
    options = bench_select.options_for("exdyna", adam=True)
    assert options["dense_steps"] == 1 and options["adam"] == bench_select.AdamPath()
    assert "second_moment_refresh" not in options
    # --shared-v: the steps between refreshes, on the floor of the pass that does not write v
    shared = bench_select.judge({**result, "shared_v": True})
    assert [t["met"] for t in shared] == [t["met"] for t in targets]
    assert all(bench_select.SHARED_V_FLOOR in t["target"] and "with v shared" in t["target"] for t in shared)
    assert bench_select.options_for("exdyna", adam=True, shared_v=True)["second_moment_refresh"] \
        == bench_select.SHARED_V_REFRESH > bench_select.ADAM_WARMUP


def test_the_long_adam_run_is_held_to_the_long_moonshot():
    """``adam_quality.py --long --variants adam-shared-v``: dense and the chosen variant only, at
    10,000 steps, judged against the long moonshot (5% of dense) with no plain run beside it."""
    import math

    import adam_quality

    args = adam_quality.parse_args(["--long", "--methods", "lags", "--variants", "adam-shared-v"])
    assert args.steps == 10_000 and args.variants == ("adam-shared-v",) and args.densities == [0.001]
    assert [job[0] for job in adam_quality.jobs_of(args)] == ["dense/1", "lags+adam-shared-v/0.001"]

    def run(perplexity: float, sent: float) -> dict:
        return {"perplexity": perplexity, "heldout_loss": math.log(perplexity), "train_loss": 3.0,
                "payload_sent": sent}

    report = {"config": {"steps": 10_000, "densities": [0.001], "methods": {"lags": ("lags", {})}},
              "runs": {"dense/1": run(30.0, 100.0), "lags+adam-shared-v/0.001": run(31.4, 10.0)}}
    (target,) = adam_quality.targets(report)
    assert target["met"] and "within 5%" in target["target"] and "after 10,000 steps" in target["target"]
    report["runs"]["lags+adam-shared-v/0.001"] = run(31.6, 10.0)   # 1.053x
    assert not adam_quality.targets(report)[0]["met"]


def test_runs_at_more_seeds_are_judged_on_the_mean_loss():
    """``adam_quality.py --seeds``: a run at seed s is keyed ``@seed<s>``; a (method, path) with
    plain, path and dense runs at two or more seeds gets a target on the held-out loss averaged
    over them, with every seed's share of the gap shown; seed 0's targets stay as they were."""
    import math

    import adam_quality

    args = adam_quality.parse_args(["--seeds", "0", "1", "--methods", "deft", "--densities", "0.01",
                                    "--variants", "plain", "adam"])
    assert [job[0] for job in adam_quality.jobs_of(args)] == [
        "dense/1", "deft/0.01", "deft+adam/0.01", "dense/1@seed1", "deft/0.01@seed1", "deft+adam/0.01@seed1"]

    def run(loss: float) -> dict:
        return {"perplexity": math.exp(loss), "heldout_loss": loss, "train_loss": 3.0, "payload_sent": 6.0}

    losses = {"dense/1": 3.4, "deft/0.01": 3.6, "deft+adam/0.01": 3.59,            # seed 0: 5% closed
              "dense/1@seed1": 3.4, "deft/0.01@seed1": 4.0, "deft+adam/0.01@seed1": 3.6}   # seed 1: 67%
    report = {"config": {"steps": 2000, "densities": [0.01], "methods": {"deft": ("deft", {})}},
              "runs": {key: run(loss) for key, loss in losses.items()}}
    report["runs"]["dense/1"]["payload_sent"] = report["runs"]["dense/1@seed1"]["payload_sent"] = 100.0
    by_target = {t["target"]: t for t in adam_quality.targets(report)}
    averaged = [t for name, t in by_target.items() if "averaged over seeds 0, 1" in name]
    assert len(averaged) == 1 and averaged[0]["met"]            # (0.01 + 0.4) / (0.2 + 0.6) = 51%
    assert "51% on the mean (per seed: 5%, 67%)" in averaged[0]["figure"]
    seed_zero = [t for name, t in by_target.items() if name.startswith("deft on") and "averaged" not in name]
    assert len(seed_zero) == 1 and not seed_zero[0]["met"]
    assert "| deft | 0.01 | own v |" in adam_quality.markdown(report, None)
