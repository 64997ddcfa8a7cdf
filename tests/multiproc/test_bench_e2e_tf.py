"""bench_e2e's TensorFlow jobs (``--framework tensorflow``): a real 2-rank Horovod job of
scripts/workers/bench_e2e_tf_worker.py, summarised into the same tables and targets as the PyTorch jobs."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.multiproc.launch import REPO

pytestmark = pytest.mark.multiproc


@pytest.mark.timeout(420)
def test_a_tensorflow_job_runs_every_kind_of_configuration_and_is_summarised(tmp_path):
    out = tmp_path / "tf"
    configs = "dense,fp16,exdyna-tracking,topk-model"
    result = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "bench_e2e.py"), "--framework", "tensorflow",
         "--models", "cnn", "--nets", "loopback", "--sizes", "2", "--configs", configs,
         "--rounds", "2", "--warmup", "1", "--sparse-warmup", "2", "--settle", "30",
         "--job-timeout", "360",
         "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=400, check=False)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    job = json.loads(out.with_suffix(".json").read_text())["jobs"][0]
    assert job["framework"] == "tensorflow" and job["size"] == 2
    assert job["configs"] == [*configs.split(","), "local"]
    rows = job["summary"]
    assert set(rows) == set(job["configs"])
    assert all(row["step_seconds"]["n"] == 2 for row in rows.values())
    # Traced on the first call only (twice there: once more as SGD creates its variables); a
    # retrace per step would time graph building, not training.
    assert all(r["traces"] <= 2 for r in job["records"]), [r["traces"] for r in job["records"]]
    assert 0 < rows["exdyna-tracking"]["density_actual"] < 0.05
    assert rows["dense"]["density_actual"] == 1.0
    assert job["probe"]["bus_gbit_s_median"] > 0
    # --settle: each sparsifier's record says how many extra steps it took (rank 0 decided for
    # both through broadcast_object), Horovod's own compressions none
    settle = {r["config"]: r.get("settle") for r in job["records"]}
    assert settle["dense"] is None and settle["fp16"] is None
    for config in ("exdyna-tracking", "topk-model"):
        assert settle[config]["steps"] in (0, 10, 20, 30), settle
        assert settle[config]["settled"] or settle[config]["steps"] == 30, settle
    text = out.with_suffix(".md").read_text()
    assert "Settling (`--settle 30`)" in text
    assert "#### cnn in TensorFlow" in text
    assert "exdyna-tracking throughput >= 0.9× dense's (tensorflow, cnn, loopback, 2 ranks)" in text
    assert "topk-model throughput >= 0.7× dense's" in text


def test_a_model_of_one_framework_is_refused_in_the_other():
    result = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "bench_e2e.py"), "--models", "mobilenetv2",
         "--nets", "loopback", "--sizes", "2"],
        cwd=REPO, capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 2
    assert "exists only in tensorflow: pass --framework accordingly" in result.stderr
