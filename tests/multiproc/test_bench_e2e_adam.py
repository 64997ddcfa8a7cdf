"""bench_e2e's AdamW jobs (``--optimizer adamw``): a real 2-rank Horovod job of the transformer
task's model, dense AdamW beside a method on the Adam path (``+adam``: hvd_sparse's AdamW linked
to the compressor), as time_to_accuracy.py's transformer study times them."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.multiproc.launch import REPO

pytestmark = pytest.mark.multiproc


@pytest.mark.timeout(300)
def test_an_adamw_job_times_the_adam_path_after_its_dense_steps(tmp_path):
    out = tmp_path / "adam"
    result = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "bench_e2e.py"), "--models", "word-gpt",
         "--nets", "loopback", "--sizes", "2", "--optimizer", "adamw", "--density", "0.01",
         "--configs", "dense,exdyna-tracking+adam", "--rounds", "2", "--warmup", "1",
         "--sparse-warmup", "3", "--settle", "150", "--job-timeout", "240", "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=280, check=False)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    job = json.loads(out.with_suffix(".json").read_text())["jobs"][0]
    assert job["optimizer"] == "adamw" and job["model"] == "word-gpt"
    rows = job["summary"]
    assert set(rows) == {"dense", "exdyna-tracking+adam", "local"}
    # past its one dense step, settled, the path sends about ρ, a small part of dense's bytes
    settle = next(r["settle"] for r in job["records"] if r["config"] == "exdyna-tracking+adam")
    assert settle["settled"], settle
    assert 0.001 < rows["exdyna-tracking+adam"]["density_actual"] < 0.05
    assert rows["exdyna-tracking+adam"]["bytes_sent"] < 0.2 * rows["dense"]["bytes_sent"]
    assert "without the Adam path" not in result.stdout + result.stderr   # linked: no warning


def test_the_adam_path_needs_adamw():
    result = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "bench_e2e.py"), "--models", "word-gpt",
         "--nets", "loopback", "--sizes", "2", "--configs", "dense,topk+adam", "--rounds", "1",
         "--job-timeout", "120"],
        cwd=REPO, capture_output=True, text=True, timeout=150, check=False)
    assert result.returncode == 2   # refused before any job starts
    assert "need --optimizer adamw" in result.stderr
