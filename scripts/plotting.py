"""What every measurement script needs to draw: matplotlib's pyplot on the file-only backend."""

from __future__ import annotations

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
