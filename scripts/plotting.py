"""What every measurement script needs to draw: matplotlib's pyplot on the file-only backend."""

from __future__ import annotations

from pathlib import Path
from typing import Any


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
