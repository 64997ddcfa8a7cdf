"""BENCHMARKS.md is written by scripts/report.py from bench/, never by hand, and stays a page a
user can read: regenerating it from the committed results gives the committed text (all but the
line naming the machine), within 600 lines."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PAGE_LINES = 600


def without_machine(text: str) -> list[str]:
    return [line for line in text.splitlines() if not line.startswith("Machine of this report:")]


def test_the_page_is_regenerated_from_bench_as_committed(tmp_path):
    (tmp_path / "bench").symlink_to(REPO / "bench", target_is_directory=True)
    subprocess.run([sys.executable, str(REPO / "scripts" / "report.py"), "--bench-dir", "bench",
                    "--out", "BENCHMARKS.md"], cwd=tmp_path, check=True, capture_output=True, timeout=120)
    for name in ("BENCHMARKS.md", "BENCHMARKS-archive.md"):
        assert without_machine((tmp_path / name).read_text()) == without_machine((REPO / name).read_text()), (
            f"{name} differs from what scripts/report.py writes: run `python scripts/report.py`")


def test_the_page_is_short_enough_to_read():
    assert len((REPO / "BENCHMARKS.md").read_text().splitlines()) <= PAGE_LINES


def test_the_readme_first_table_is_read_from_the_benchmark_results():
    import report

    readme = (REPO / "README.md").read_text()
    assert readme == report.with_readme_table(readme, report.readme_table(REPO / "bench")), (
        "README.md's first table differs from the results: run `python scripts/report.py`")
    assert "| step time, the same model |" in readme
