"""scripts/investigations/lags_assumption.py: a tiny run writes the per-layer δ of the LAGS assumption
check as JSON (and a plot where matplotlib is installed)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_assumption_script_writes_json_and_plot(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("sklearn")
    out, plot = tmp_path / "delta.json", tmp_path / "delta.png"
    result = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "investigations" / "lags_assumption.py"), "--epochs", "2",
         "--max-steps", "4", "--workers", "2", "--out", str(out), "--plot", str(plot)],
        capture_output=True, text=True, timeout=240, check=False, cwd=REPO)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert len(report["epochs"]) == 2 and report["workers"] == 2
    layers = report["layers"]
    assert layers and all(name in report["epochs"][-1]["delta"] for name in layers)
    assert all(0 < d < 2 for d in report["epochs"][-1]["delta"].values())
    assert "delta" in result.stdout
    if report.get("plot"):
        assert plot.stat().st_size > 0
