"""What the measurement scripts share: where results go, the machine they describe, and how
figures are drawn."""

from __future__ import annotations

import contextlib
import os
import platform
from pathlib import Path
from typing import Any


def output_dir(requested: Path | None, quick: bool) -> Path:
    """The folder a script writes to: the one asked for, else bench/ (bench/quick/ for --quick,
    what `make bench` runs), created if needed."""
    folder = requested or Path("bench/quick" if quick else "bench")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def machine_info() -> dict:
    """CPU count and model, memory, kernel and Python of this machine."""
    info: dict = {"cpus": os.cpu_count(), "kernel": platform.release(),
                  "python": platform.python_version(), "cpu_model": None}
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu_model"] = line.split(":", 1)[1].strip()
                break
    with contextlib.suppress(ValueError, OSError):
        info["memory_gb"] = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    return info


def pyplot() -> Any | None:
    """``matplotlib.pyplot`` drawing to files (Agg: no display on these machines), or None with a
    note when matplotlib is missing, so that a script still writes its JSON and Markdown."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no figures", flush=True)
        return None
    return plt


def save(figure: Any, path: Path) -> str:
    """Lay out, write at the reports' resolution and free a figure; returns the path written."""
    import matplotlib.pyplot as plt

    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return str(path)
