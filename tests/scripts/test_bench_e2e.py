"""The end-to-end benchmark's bookkeeping (scripts/bench_e2e.py and its worker): rotation of the
configurations, merging ranks (a step lasts as long as its slowest rank), per-repeat ratios to
dense, and the targets' verdicts. No Horovod job is started here."""

from __future__ import annotations

import statistics

import bench_e2e
import e2e_phases
import pytest
from workers import bench_e2e_worker


def test_block_order_puts_every_configuration_first_and_last():
    configs = ["a", "b", "c", "d"]
    orders = [bench_e2e_worker.block_order(configs, r) for r in range(8)]
    assert all(sorted(o) == configs for o in orders)
    assert {o[0] for o in orders} == set(configs) and {o[-1] for o in orders} == set(configs)
    assert orders[:4] == [configs, ["d", "c", "b", "a"], ["b", "c", "d", "a"], ["a", "d", "c", "b"]]
    odd = [bench_e2e_worker.block_order(configs[:3], r)[0] for r in range(6)]
    assert set(odd) == {"a", "b", "c"}


def rank_record(config, repeat, steps, **stats):
    base = dict.fromkeys(bench_e2e_worker.STAT_KEYS, 0.0)
    base.update(stats)
    return {"config": config, "repeat": repeat, "numel": 10, "steps": steps, **base}


def test_merge_ranks_takes_each_steps_slowest_rank():
    rank0 = [rank_record("dense", 0, [[0.1, 0.2, 0.3], [0.1, 0.1, 0.1]], density_actual=1.0)]
    rank1 = [rank_record("dense", 0, [[0.1, 0.4, 0.1], [0.2, 0.2, 0.2]], density_actual=0.5)]
    (merged,) = bench_e2e_worker.merge_ranks([rank0, rank1])
    assert merged["step_times"] == pytest.approx([0.6, 0.6])
    assert merged["step_seconds"] == pytest.approx(0.6)
    assert merged["slowest_compute_seconds"] == pytest.approx((0.5 + 0.4) / 2)
    assert merged["after_compute_seconds"] == pytest.approx((0.1 + 0.2) / 2)
    assert merged["density_actual"] == pytest.approx(0.75)
    assert merged["backward_seconds"] == pytest.approx((0.2 + 0.1 + 0.4 + 0.2) / 4)


def job_with(times_by_config: dict[str, list[float]], size=4, **extra) -> dict:
    records = []
    for config, times in times_by_config.items():
        for repeat, t in enumerate(times):
            record = {"config": config, "repeat": repeat, "step_seconds": t}
            for key in ("density_actual", "buildup", "bytes_sent", "bytes_received", "select_seconds",
                        "comm_wait_seconds", "forward_seconds", "backward_seconds",
                        "optimizer_step_seconds", "slowest_compute_seconds", "after_compute_seconds"):
                record[key] = 0.001 if key == "density_actual" else 0.0
            records.append(record)
    job = {"records": records, "size": size, "batch_per_rank": 8, **extra}
    job["summary"] = bench_e2e.summarize_job(job)
    return job


def test_ratios_are_taken_within_each_repeat():
    # The machine runs 3x slower in repeat 1: each repeat's ratio is taken within the repeat
    # (medians of the step times alone would give 0.3 / 2.0 = 0.15).
    job = job_with({"dense": [1.0, 3.0, 2.0], "exdyna": [0.3, 0.9, 0.2]})
    exdyna = job["summary"]["exdyna"]
    assert exdyna["ratio_to_dense"]["median"] == pytest.approx(0.3)
    assert exdyna["ratio_to_dense"]["min"] == pytest.approx(0.1)
    assert exdyna["ratio_to_dense"]["max"] == pytest.approx(0.3)
    assert exdyna["step_seconds"]["median"] == pytest.approx(0.3)
    assert exdyna["samples_per_second"]["median"] == pytest.approx(4 * 8 / 0.3)


def test_targets_verdicts():
    comm = job_with({"dense": [1.0] * 3, "exdyna": [0.34] * 3, "exdyna-tracking": [0.36] * 3,
                     "topk": [0.5] * 3, "local": [0.1] * 3},
                    model="mlp25m", net="1gbit", size=4)
    compute = job_with({"dense": [1.0] * 3, "exdyna": [1.14] * 3, "exdyna-tracking": [1.2] * 3},
                       model="cnn", net="loopback", size=4)
    elsewhere = job_with({"dense": [1.0], "exdyna": [0.9]}, model="mlp25m", net="loopback", size=4)
    verdicts = {(t["config"], "overhead" in t): t for t in
                bench_e2e.evaluate_targets([comm, compute, elsewhere])}
    assert len(verdicts) == 4
    assert verdicts["exdyna", False]["met"] and not verdicts["exdyna-tracking", False]["met"]
    assert verdicts["exdyna-tracking", False]["met_faster_than_topk"]
    assert verdicts["exdyna", True]["met"] and not verdicts["exdyna-tracking", True]["met"]
    assert verdicts["exdyna", True]["overhead"] == pytest.approx(0.14)
    assert verdicts["exdyna", True]["verdict"] == "met"
    assert verdicts["exdyna-tracking", False]["verdict_ratio"] == "not met"
    slow = job_with({"dense": [1.0], "exdyna": [0.3], "topk": [0.25]}, model="mlp25m", net="1gbit",
                    size=4)
    (verdict,) = bench_e2e.evaluate_targets([slow])
    assert verdict["met_ratio"] and not verdict["met_faster_than_topk"] and not verdict["met"]


def test_kernel_targets():
    # Ratios are paired per visit: deft is faster than top-k in every visit, lags in one of three.
    job = job_with({"topk": [1.0, 3.0, 1.0], "deft": [0.9, 2.5, 0.95], "lags": [1.1, 3.1, 1.0],
                    "exdyna-tracking": [0.8, 2.0, 0.8], "topk@ref": [1.5, 3.5, 1.4],
                    "lags@ref": [1.0, 3.0, 0.9]}, model="mlp25m", net="1gbit", size=2)
    targets = {(t["config"], t["reference"]): t for t in bench_e2e.evaluate_targets([job])
               if t["kind"] == "kernels"}
    assert set(targets) == {("deft", "topk"), ("lags", "topk"), ("deft", "exdyna-tracking"),
                            ("topk", "topk@ref"), ("lags", "lags@ref")}
    assert targets["deft", "topk"]["ratio"] == pytest.approx(0.9) and targets["deft", "topk"]["met"]
    assert not targets["lags", "topk"]["met"]
    assert targets["deft", "exdyna-tracking"]["ratio"] == pytest.approx(1.1875)
    assert targets["deft", "exdyna-tracking"]["met"]
    assert targets["topk", "topk@ref"]["met"] and not targets["lags", "lags@ref"]["met"]
    assert "paired visits" in targets["topk", "topk@ref"]["figure"]


def test_overhead_targets_on_loopback():
    # PyTorch's ResNet-18: no configuration with the kernels on above 1.1x dense's step.
    resnet = job_with({"dense": [1.0] * 3, "exdyna-tracking": [1.05] * 3, "micro": [1.2] * 3,
                       "topk@ref": [2.0] * 3, "fp16": [1.5] * 3, "local": [0.9] * 3},
                      model="resnet18", net="loopback", size=2)
    # TensorFlow: throughput (the inverse of the step ratio) against 0.9x for seeds, 0.7x top-k.
    tf = job_with({"dense": [1.0] * 3, "exdyna-tracking": [1.1] * 3, "lags": [1.2] * 3,
                   "topk": [1.4] * 3}, model="mobilenetv2", net="loopback", size=2,
                  framework="tensorflow")
    slow_net = job_with({"dense": [1.0], "micro": [2.0]}, model="resnet18", net="1gbit", size=2)
    targets = {(t["config"], t["target"].split("(")[1].split(",")[0]): t
               for t in bench_e2e.evaluate_targets([resnet, tf, slow_net]) if t["kind"] == "overhead"}
    assert set(targets) == {("exdyna-tracking", "torch"), ("micro", "torch"),
                            ("exdyna-tracking", "tensorflow"), ("lags", "tensorflow"),
                            ("topk", "tensorflow")}
    assert targets["exdyna-tracking", "torch"]["met"] and not targets["micro", "torch"]["met"]
    assert targets["exdyna-tracking", "tensorflow"]["met"]          # 1 / 1.1 = 0.91x dense
    assert not targets["lags", "tensorflow"]["met"]                 # 0.83x
    assert targets["topk", "tensorflow"]["met"]                     # 0.71x
    assert "0.714× dense's throughput" in targets["topk", "tensorflow"]["figure"]
    # TensorFlow jobs take no part in the PyTorch-only targets (kernels, phases).
    assert all(t["kind"] == "overhead" for t in bench_e2e.evaluate_targets([tf]))
    # TensorFlow's ResNet-18: the throughput targets, and the 1.1x step of every configuration.
    tf_resnet = job_with({"dense": [1.0] * 3, "micro": [1.05] * 3, "dgc": [1.3] * 3},
                         model="resnet18", net="loopback", size=2, framework="tensorflow")
    claims = {t["target"]: t["met"] for t in bench_e2e.evaluate_targets([tf_resnet])}
    assert claims == {"micro throughput >= 0.9× dense's (tensorflow, resnet18, loopback, 2 ranks)": True,
                      "micro step <= 1.1× dense's (tensorflow, resnet18, loopback, 2 ranks)": True,
                      "dgc step <= 1.1× dense's (tensorflow, resnet18, loopback, 2 ranks)": False}


def test_reference_configurations_resolve():
    assert bench_e2e_worker.resolve("deft@ref") == ("deft", {}, "off")
    assert bench_e2e_worker.resolve("deft")[2] == "auto"
    assert not bench_e2e_worker.known("dense@ref") and not bench_e2e_worker.known("nothing")


def test_markdown_states_the_verdicts():
    job = job_with({"dense": [1.0] * 2, "exdyna": [0.3] * 2, "topk": [0.5] * 2, "local": [0.1] * 2},
                   model="mlp25m", net="1gbit", size=4, numel=25_000_000, configs=["dense", "exdyna"],
                   schedule="blocks", repeats=2, steps=2, launcher="gloo", wall_seconds=1.0,
                   load_average_before=[1.0], load_average_after=[1.0],
                   probe={"bus_gbit_s_median": 0.9, "bytes": 1e6})
    result = {"mode": "quick", "machine": {}, "load_average_start": [1.0], "command": "x",
              "density": 0.001, "plan": {"warmup": 1, "sparse_warmup": 5}, "netem_note": "",
              "jobs": [job], "targets": bench_e2e.evaluate_targets([job])}
    text = bench_e2e.markdown(result)
    assert "| exdyna | 300 [300–300] |" in text
    assert "0.300× dense (0.300–0.300)" in text
    assert "| ratio: met; faster than top-k: yes |" in text


def test_rates():
    assert bench_e2e.rate_bits("10gbit") == 1e10
    assert bench_e2e.rate_bits("100mbit") == 1e8
    assert bench_e2e.rate_bits("loopback") is None


def test_verdict_is_qualified_when_the_interval_crosses_the_limit():
    assert bench_e2e.verdict(0.30, [0.25, 0.34], 0.35) == "met"
    assert bench_e2e.verdict(0.30, [0.25, 0.40], 0.35) == "met (within noise)"
    assert bench_e2e.verdict(0.40, [0.30, 0.45], 0.35) == "not met (within noise)"
    assert bench_e2e.verdict(0.40, [0.36, 0.45], 0.35) == "not met"
    noisy = [1.0, 1.5, 0.9, 1.2, 1.1, 0.8, 1.3]
    lo, hi = bench_e2e.median_ci(noisy)
    assert lo <= statistics.median(noisy) <= hi and lo < hi
    assert bench_e2e.median_ci(noisy) == [lo, hi]  # seeded


class FakeSource:
    """A compressor's cheap timing accessors, as the worker reads them after each step."""

    def __init__(self, times, marks, timeline=()):
        self.times, self.marks, self.timeline = times, marks, list(timeline)

    def step_times(self):
        return dict(self.times)

    def step_marks(self):
        return dict(self.marks)

    def collective_timeline(self):
        return list(self.timeline)


def phases_of(step, unaccounted=0.0, hidden=0.0, inflight=0.0):
    """One rank's phases of a step of ``step`` seconds with ``unaccounted`` left over."""
    clock = [10.0, 10.1, 10.1 + 0.3, 10.0 + step]   # forward 0.1, backward 0.3 (hooks 0.05)
    # optimizer.step: Horovod waits 0.02, decompress 0.1, the update 0.05, the rest unaccounted
    ended = clock[2] + 0.02 + 0.1
    update = step - 0.4 - 0.12 - unaccounted
    source = FakeSource({"hook_seconds": 0.05, "decompress_seconds": 0.1, "select_seconds": 0.01,
                         "comm_inflight_seconds": inflight, "comm_hidden_seconds": hidden},
                        {"decompress_ended": ended},
                        [{"name": "e2e.x.model.idx", "bytes": 40, "issued": 0.1, "completed": 0.2},
                         {"name": "e2e.x.model.val", "bytes": 80, "issued": 0.1, "completed": None}])
    return e2e_phases.rank_phases(clock, update, source)


def test_rank_phases_add_up_to_the_step():
    p = phases_of(1.0, unaccounted=0.03)
    assert p["step"] == pytest.approx(1.0)
    assert p["backward_compute"] == pytest.approx(0.25) and p["hooks"] == pytest.approx(0.05)
    assert p["horovod_wait"] == pytest.approx(0.02) and p["decompress"] == pytest.approx(0.1)
    assert p["unaccounted"] == pytest.approx(0.03)
    assert sum(p[k] for k in e2e_phases.PHASES) == pytest.approx(p["step"])
    assert p["collectives"] == {"idx": [1, 40, pytest.approx(0.1)]}   # val not seen complete
    local = e2e_phases.rank_phases([0.0, 0.1, 0.3, 0.45], 0.15, None)
    assert local["unaccounted"] == pytest.approx(0.0) and local["hooks"] == 0.0


def record_with_phases(config, repeat, per_rank_steps):
    return {"config": config, "repeat": repeat, "step_seconds": max(p["step"] for p in per_rank_steps[0]),
            "phases": e2e_phases.slowest_rank_phases(per_rank_steps)}


def test_breakdown_takes_the_slowest_rank_and_fails_when_it_does_not_add_up():
    fast, slow = phases_of(0.5), phases_of(0.8, unaccounted=0.01, hidden=0.06, inflight=0.1)
    merged = e2e_phases.slowest_rank_phases([[fast, slow]])
    assert merged["step"] == pytest.approx(0.8) and merged["unaccounted"] == pytest.approx(0.01)
    assert merged["late_rank"] == pytest.approx(0.0)   # both ended backward at 0.4 s
    late = dict(fast, backward_compute=fast["backward_compute"] + 0.05)
    assert e2e_phases.slowest_rank_phases([[late, slow]])["late_rank"] == pytest.approx(0.05)
    good = e2e_phases.summarize_phases([record_with_phases("lags", 0, [[fast, slow]])])
    assert good["adds_up"] and good["hidden_share"] == pytest.approx(0.6)
    # A breakdown that misses 20% of the step does not add up, and its target says so.
    bad = e2e_phases.summarize_phases([record_with_phases("deft", 0, [[phases_of(1.0, unaccounted=0.2)]])])
    assert bad["unaccounted_share"] == pytest.approx(0.2) and not bad["adds_up"]
    job = {"model": "mlp25m", "net": "1gbit", "size": 2, "summary": {
        "lags": {"phases": good}, "deft": {"phases": bad},
        "micro": {"ratio_to_local": {"median": 1.3, "ci95": [1.2, 1.4], "n": 5}}}}
    targets = {t["target"].split(" (")[0]: t for t in e2e_phases.phase_targets(job, bench_e2e.verdict)}
    adds_up = targets["the breakdown adds up to the step within 10% for every configuration"]
    assert not adds_up["met"] and "deft" in adds_up["figure"]
    assert targets["lags hides >= 40% of its communication"]["met"]
    micro = targets["micro step within 1.25× of the compute-only step"]
    assert not micro["met"] and micro["verdict"] == "not met (within noise)"


def test_every_run_has_the_compute_only_row_and_its_ratio():
    parser = bench_e2e.build_parser()
    plan = bench_e2e.make_plan(parser.parse_args(["--configs", "dense,deft"]), parser)
    assert plan["configs"] == ["dense", "deft", "local"]
    job = job_with({"dense": [1.0, 2.0], "deft": [0.3, 0.5], "local": [0.25, 0.5]})
    assert job["summary"]["deft"]["ratio_to_local"]["median"] == pytest.approx(1.1)


def test_settled_spans_exclusive_to_full_buildup():
    assert bench_e2e_worker.settled(0.001, 0.001, 2)
    assert bench_e2e_worker.settled(0.004, 0.001, 2)          # 2x a full build-up of 2 ranks
    assert not bench_e2e_worker.settled(0.0041, 0.001, 2)
    assert not bench_e2e_worker.settled(0.198, 0.001, 2)      # MiCRO's paper start on ResNet-18
    assert not bench_e2e_worker.settled(0.00049, 0.001, 2)


class _Args:
    density, settle = 0.001, 100


class _Falling:
    """A compressor whose density falls 10x every 10 steps, from 0.1."""

    def __init__(self):
        self.steps = 0

    def step(self, *batch):
        self.steps += 1

    def stats(self):
        return {"density_actual": 0.1 / 10 ** (self.steps // 10)}


def test_settle_steps_until_settled_and_every_rank_follows_rank0():
    falling, verdicts = _Falling(), []

    def agree(done, i):
        verdicts.append((done, i))
        return done

    out = bench_e2e_worker.settle(falling.step, falling, [(0, 0)], 0, _Args(), 2, agree)
    assert out == {"steps": 20, "density": 0.001, "settled": True}
    assert verdicts == [(False, 0), (False, 10), (True, 20)]
    # the limit stops it, and the record says it did not settle; rank 0's "stop" is obeyed
    args = _Args()
    args.settle = 10
    out = bench_e2e_worker.settle(_Falling().step, _Falling(), [(0, 0)], 0, args, 2, lambda d, i: d)
    assert out["steps"] == 10 and not out["settled"]
    assert bench_e2e_worker.settle(falling.step, falling, [], 0, _Args(), 2, lambda d, i: True)["steps"] == 0
    assert bench_e2e_worker.settle(falling.step, None, [], 0, _Args(), 2, agree) is None


def test_settle_lines_name_what_settling_did():
    job = {"settle": 600, "records": [
        {"config": "micro", "settle": {"steps": 230, "density": 0.0021, "settled": True}},
        {"config": "micro", "settle": {"steps": 230, "density": 0.0021, "settled": True}},
        {"config": "dgc", "settle": {"steps": 600, "density": 0.01, "settled": False}},
        {"config": "dense"}]}
    text = " ".join(bench_e2e.settle_lines(job))
    assert "micro 230 (density 2.10e-03)" in text and "dgc 600 (NOT settled, density 1.00e-02)" in text
    assert bench_e2e.settle_lines({"records": [{"config": "dense"}]}) == []


def test_adam_path_configurations_resolve_in_the_torch_worker_only():
    method, options, kernels = bench_e2e_worker.resolve("dgc+adam")
    assert (method, kernels) == ("dgc", "auto")
    assert options == {"adam_path": True}
    from workers import bench_e2e_tf_worker

    assert not bench_e2e_tf_worker.known("dgc+adam") and bench_e2e_tf_worker.known("dgc")
