"""scripts/scale.py's own arithmetic: the network fit from calibration timings, the measured
selection's interpolation, the straggler's growth with N, the crossovers and the verdict of the
validation table."""

from __future__ import annotations

import pytest

np = pytest.importorskip("numpy")
pytest.importorskip("torch")

import scale  # noqa: E402

from hvd_sparse.plan import BucketTraffic  # noqa: E402


def test_the_network_fit_takes_small_message_costs_and_large_message_slopes():
    # 2 ranks; allreduce: 1 ms + bytes / 100 MB/s (bus bytes = B); allgather: 2 ms + B / 50 MB/s
    sizes = [1 << 10, 16 << 10, 1 << 20, 16 << 20]
    timings = {"size": 2, "allreduce": [[b, 1e-3 + b / 1e8] for b in sizes],
               "allgather": [[b, 2e-3 + b / 5e7] for b in sizes]}
    fit = scale.fit_network(timings)
    assert fit["allreduce"]["overhead"] == pytest.approx(1e-3, rel=1e-6)
    assert fit["allreduce"]["bandwidth"] == pytest.approx(8e8, rel=1e-6)
    assert fit["allgather"]["overhead"] == pytest.approx(2e-3, rel=1e-6)
    assert fit["allgather"]["bandwidth"] == pytest.approx(4e8, rel=1e-6)
    network = scale.calibrated_network(fit)
    assert network.seconds("allgather", [1 << 20, 1 << 20]) == pytest.approx(2e-3 + (1 << 20) / 5e7)


def test_measured_selection_interpolates_and_scales_the_scan_with_n():
    # floor 1 ns/entry; the method 1 ns/entry above it at N = 2 (exclusive: over n/2 scanned)
    points = tuple((n, 1e-9 * n, 2e-9 * n) for n in (1e5, 1e6, 1e7))
    model = scale.MeasuredSelection(points, world=2, exclusive=True)
    bucket = BucketTraffic("model", (0,), 3_000_000, 1_500_000, ())
    assert model.seconds(bucket) == pytest.approx(6e-3, rel=1e-6)
    at_16 = BucketTraffic("model", (0,), 3_000_000, 187_500, ())   # 1/8 of N = 2's scan
    assert model.seconds(at_16) == pytest.approx(3e-3 + 3e-3 / 8, rel=1e-6)
    assert model.seconds(BucketTraffic("dense", (0,), 100, 0, ())) == 0.0


def test_the_straggler_grows_like_the_expected_maximum_of_n_deviates():
    assert scale.straggler_factor(2) == pytest.approx(1.0, rel=1e-3)
    assert scale.straggler_factor(16) == pytest.approx(1.766 / 0.5642, rel=1e-2)
    assert scale.straggler_factor(1024) > scale.straggler_factor(64) > scale.straggler_factor(16)


def test_crossover_is_the_first_n_from_which_a_method_stays_ahead():
    def rows(exdyna, topk):
        return {"exdyna-tracking": {"step": exdyna}, "micro": {"step": 9.0}, "deft": {"step": 9.0},
                "lags": {"step": 9.0}, "topk": {"step": topk}, "dgc": {"step": 1.0}, "dense": {"step": 5.0}}
    table = {"cpu|m|1gbit": {"2": rows(2.0, 1.0), "16": rows(2.0, 3.0), "64": rows(2.0, 1.5),
                             "256": rows(2.0, 4.0)}}
    exdyna = next(c for c in scale.crossovers(table, [2, 16, 64, 256]) if c["method"] == "exdyna-tracking")
    assert exdyna["topk"] == 256 and exdyna["dense"] == 2 and exdyna["dgc"] is None


def test_the_validation_verdict_needs_the_median_and_every_pair():
    fit = {op: {"overhead": 1e-3, "bandwidth": 1e9} for op in ("allreduce", "allgather")}
    rows = [{"model": "m", "size": 2, "net": "1gbit", "config": c, "measured": 1.0, "predicted": 1.0 + e,
             "error": e} for c, e in (("a", 0.1), ("b", -0.12), ("c", 0.05))]
    assert "NOT met" not in "\n".join(scale.validation_markdown(rows, {"1gbit": fit}))
    rows.append({**rows[0], "size": 4, "config": "e", "error": 0.9})   # 4 ranks: shown, not judged
    text = "\n".join(scale.validation_markdown(rows, {"1gbit": fit}))
    assert "NOT met" not in text and "| m | 4 | 1gbit | e |" in text
    rows.append({**rows[0], "config": "d", "error": 0.31})
    assert "NOT met" in "\n".join(scale.validation_markdown(rows, {"1gbit": fit}))


def test_the_summary_answers_the_issue_from_saved_reports():
    import scale_summary

    def rows(**steps):
        return {c: {"step": s} for c, s in steps.items()}

    table = {"gpu|m|10gbit": {n: rows(dense=1.0, lags=0.5, **{"exdyna-tracking": 0.1}, topk=0.2, dgc=0.4)
                              for n in ("2", "16", "64")},
             "gpu|m|1gbit": {"16": rows(dense=2.0, lags=0.5)}}
    validation = [{"model": "m", "size": 2, "net": net, "config": "dense", "measured": 0.1,
                   "predicted": 0.1 * (1 + e), "error": e} for net, e in (("1gbit", 0.1), ("100mbit", -0.4))]
    crossing = [{"profile": "gpu", "model": "m", "rate": "10gbit", "method": "exdyna-tracking",
                 "topk": 2, "dgc": None, "dense": 16}]
    tta = {"rows": [{"config": "dense", "world": 16, "profile": "gpu", "rate": "10gbit", "steps": 400,
                     "best": 3.0, "seconds": 8.0, "speedup": 1.0},
                    {"config": "exdyna-tracking+adam", "world": 16, "profile": "gpu", "rate": "10gbit",
                     "steps": None, "best": 4.0},
                    {"config": "exdyna-tracking+adam-shared-v", "world": 16, "profile": "gpu",
                     "rate": "10gbit", "steps": 500, "best": 2.9, "seconds": 9.0, "speedup": 0.89}]}
    text = scale_summary.summary({"profiles": {"gpu": "assumed"}, "density": 0.001, "validation": validation,
                                  "table": table, "crossovers": crossing}, tta)
    assert "median |error| 25%, largest 40%" in text and "NOT met" in text   # one pair beyond 30%
    assert "| dense | 100.0 / 110.0 (+10%) | 100.0 / 60.0 (-40%) |" in text
    assert "| m | 16 | 1000.0 | 100.0 | 200.0 | 400.0 | 2.00x | 4.00x |" in text
    assert "| m | 2 |" not in text                      # the question is N >= 16
    assert "| configuration | N = 16, own v: steps | seconds (speedup) | N = 16, shared v: steps |" in text
    assert "| exdyna-tracking+adam | not reached (best 4.00) | - | 500 | 9.0 (0.89x) |" in text
    assert "| dense | 400 | 8.0 (1.00x) | - | - |" in text
    assert "| m | 2 / - / 16 |" in text
    assert "m gpu 4.00x" in text                        # LAGS over dense at N = 16, 1gbit
