"""The cost model's byte counts (hvd_sparse/plan/traffic.py) against what a real 2-rank Horovod
job's compressors report sending (``stats()["bytes_sent"]``, through scripts/bench_e2e.py)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.multiproc.launch import REPO

pytestmark = pytest.mark.multiproc


@pytest.mark.timeout(300)
def test_derived_bytes_are_what_the_torch_face_sends(tmp_path):
    sys.path.insert(0, str(REPO / "scripts"))
    from models import e2e_models

    from hvd_sparse.algorithms import METHODS
    from hvd_sparse.plan import bytes_per_rank, steady_traffic

    out = tmp_path / "bytes"
    result = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "bench_e2e.py"), "--models", "cnn", "--nets", "loopback",
         "--sizes", "2", "--configs", "topk,lags,exdyna-tracking", "--density", "0.01", "--rounds", "2",
         "--warmup", "1", "--sparse-warmup", "30", "--job-timeout", "240", "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=280, check=False)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    rows = json.loads(out.with_suffix(".json").read_text())["jobs"][0]["summary"]
    sizes = [p.numel() for p in e2e_models.build("cnn", "torch").model.parameters()]

    def derived(name: str, **options) -> int:
        algorithm = next(cls for cls in METHODS if cls.name == name)(0.01, **options)
        return bytes_per_rank(steady_traffic(algorithm, sizes, 2))

    # fixed k: exactly (top-k per tensor, packed as the face packs it; LAGS per group)
    assert rows["topk"]["bytes_sent"] == derived("topk")
    assert rows["lags"]["bytes_sent"] == derived("lags")
    # a threshold holding the density: within the per-step variation of its count
    assert rows["exdyna-tracking"]["bytes_sent"] == pytest.approx(
        derived("exdyna", threshold_scaling="tracking"), rel=0.5)
