"""The demo as `make demo` runs it: a real horovodrun job of examples/digits_torch.py with ExDyna
(tracking threshold), then the same job dense, side by side."""

from __future__ import annotations

import re

import pytest

from tests.multiproc.launch import REPO, launch

pytestmark = pytest.mark.multiproc


@pytest.mark.timeout(300)
def test_the_demo_learns_with_exdyna_and_reports_the_dense_run_beside_it():
    result = launch(str(REPO / "examples" / "digits_torch.py"), 2, "gloo",
                    ["--method", "exdyna", "--option", "threshold_scaling=tracking", "--compare-dense"],
                    timeout=280)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    assert "done: weights identical on all 2 ranks" in result.stdout
    assert "threshold_scaling='tracking'" in result.stdout
    ours = re.search(r"exdyna: test accuracy ([\d.]+), sent [\d.]+ MiB per rank \(([\d.]+) x dense\)",
                     result.stdout)
    dense = re.search(r"dense: test accuracy ([\d.]+)", result.stdout)
    assert ours and dense, result.stdout[-2000:]
    assert float(ours.group(1)) >= 0.85 and float(dense.group(1)) >= 0.85
    assert float(ours.group(2)) < 0.1   # density 0.01: far fewer bytes than dense
