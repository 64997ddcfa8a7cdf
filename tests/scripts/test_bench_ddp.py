"""The DDP benchmark's bookkeeping (scripts/bench_ddp.py): a step lasts as long as its slowest
rank, ratios to dense are taken within each repeat, and every configuration names a hook. The
real torchrun job is started once, at its smallest, by the multiproc test below."""

from __future__ import annotations

import json

import bench_ddp
import pytest


def test_merge_ranks_takes_each_steps_slowest_rank():
    ranks = [{"config": "topk", "times": [0.1, 0.4], "density_actual": 0.01, "bytes_sent": 10,
              "comm_wait_seconds": 0.0},
             {"config": "topk", "times": [0.3, 0.2], "density_actual": 0.03, "bytes_sent": 30,
              "comm_wait_seconds": 0.0}]
    merged = bench_ddp.merge_ranks(ranks, repeat=1)
    assert merged["step_seconds"] == pytest.approx(0.35) and merged["repeat"] == 1
    assert merged["density_actual"] == pytest.approx(0.02) and merged["bytes_sent"] == 20


def test_ratios_are_taken_within_each_repeat():
    # The machine runs 3x slower in repeat 1: each repeat's own ratio is 0.5.
    records = [{"config": c, "repeat": r, "step_seconds": t * (3 if r else 1)}
               for r in (0, 1) for c, t in (("dense", 1.0), ("exdyna", 0.5))]
    summary = bench_ddp.summarize(records)
    assert summary["exdyna"]["ratio"] == pytest.approx(0.5)
    assert summary["exdyna"]["ratio_low"] == summary["exdyna"]["ratio_high"] == pytest.approx(0.5)
    assert summary["dense"]["step_ms"] == pytest.approx(2000.0)
    markdown = bench_ddp.markdown({"model": "m", "size": 2, "command": "c", "repeats": 2, "steps": 1,
                                   "batch": 8, "density": 0.001, "summary": summary,
                                   "machine": {"cpus": 2, "cpu_model": "x"}})
    assert "| exdyna | " in markdown and "0.50 (0.50-0.50)" in markdown


def test_unknown_configurations_are_refused_naming_the_choices(capsys):
    with pytest.raises(SystemExit):
        bench_ddp.main(["--configs", "dense,zip"])
    assert "unknown configurations ['zip']" in capsys.readouterr().err


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_a_small_job_measures_every_kind_of_hook(tmp_path):
    bench_ddp.main(["--model", "cnn", "--configs", "dense,fp16,powersgd-1,exdyna,local", "--repeats", "1",
                    "--steps", "1", "--warmup", "2", "--batch", "2", "--out-dir", str(tmp_path)])
    job = json.loads((tmp_path / "ddp.json").read_text())
    assert set(job["summary"]) == {"dense", "fp16", "powersgd-1", "exdyna", "local"}
    assert job["summary"]["exdyna"]["density_actual"] > 0 and job["summary"]["dense"]["ratio"] == 1.0
    assert (tmp_path / "ddp.md").read_text().startswith("### DDP step time, cnn, 2 ranks on loopback")


def test_the_targets_are_judged_where_the_run_measured_them():
    row = {"step_ms": 100.0, "ratio": 0.3, "ratio_ci95": [0.25, 0.4]}
    job = {"net": "1gbit", "summary": {"exdyna": row, "deft": {"step_ms": 130.0},
                                       "powersgd-4": {"step_ms": 90.0}},
           "horovod": {"exdyna": 0.095, "deft": 0.100}}
    verdicts = {t["target"]: t["met"] for t in bench_ddp.targets(job)}
    assert verdicts == {"ExDyna step <= 0.35x no hook (1 Gbit/s)": True,
                        "ExDyna faster than PowerSGD rank 4": False,
                        "exdyna: DDP step within 10% of the Horovod face": True,
                        "deft: DDP step within 10% of the Horovod face": False}
    loopback = bench_ddp.targets({**job, "net": "loopback", "horovod": {}})
    assert [t["target"] for t in loopback] == ["ExDyna faster than PowerSGD rank 4"]
