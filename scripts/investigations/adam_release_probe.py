"""What happens to the Adam path when its dense steps end, at N ranks: the residual's norm, the
threshold and the achieved aggregate density step by step, for each configuration side by side.
An investigation behind issue 35's finding that at N = 16 ExDyna, MiCRO and DEFT on the Adam path
do not reach dense's quality while TopK and LAGS do (bench/scale/tta).

    OMP_NUM_THREADS=1 python scripts/investigations/adam_release_probe.py --size 16 --steps 160   # ~4 min

The task, recipe and density are scripts/time_to_accuracy.py's transformer study (AdamW,
ρ = 0.01, the Adam path's 100 dense steps). Writes bench/adam-release/probe.{json,md}.

``--residual-decay G`` (a candidate lever, not an option of the package): before each sparse
step of the Adam path every rank multiplies its residual by G, so an update left behind for s
steps counts G^s (leaky error feedback, as DeMo's momentum decay drops stale momentum). This
drops update mass on purpose. Writes bench/adam-release/decay-G.{json,md}.

    OMP_NUM_THREADS=1 python scripts/investigations/adam_release_probe.py --residual-decay 0.9 \
        --configs exdyna-tracking+adam deft+adam
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # scripts/: the helpers it builds on
import time_to_accuracy as tta

OUT = tta.REPO / "bench" / "adam-release"
KEYS = ("step", "loss", "density_actual", "threshold", "perplexity")


def decay_residuals(gamma: float) -> None:
    """Every engine multiplies a bucket's residual by ``gamma`` before each sparse step of the
    Adam path (``--residual-decay``): the investigation's stand-in for a lever."""
    from hvd_sparse.engine import core

    accumulate_select = core.Engine._accumulate_select

    def decayed(self, bucket, tensors, method, ctx, clear_inputs):
        if ctx.momentum is not None and self.algorithm.corrections.adam is not None:
            bucket.residual.mul_(gamma)
        return (yield from accumulate_select(self, bucket, tensors, method, ctx, clear_inputs))

    core.Engine._accumulate_select = decayed


def probe(name: str, size: int, steps: int) -> dict:
    """Every record of one configuration's run (the mean residual norm over ranks per step)."""
    import hvd_sparse.sim as sim

    method, options, density, optimizer = tta.GPT.training(name)
    rows: list[dict] = []

    def on_record(record: dict) -> None:
        row = {key: record[key] for key in KEYS if key in record}
        row["residual_norm"] = statistics.mean(record.get("residual_norm") or [0.0])
        rows.append(row)

    began = time.perf_counter()
    sim.simulate(method, size, steps, density=density, task=tta.GPT.task, options=options,
                 schedule="constant", evaluate_every=25, on_record=on_record, **optimizer)
    return {"config": name, "size": size, "rows": rows, "seconds": round(time.perf_counter() - began, 1)}


def markdown(runs: list[dict], density: float, title: str = "") -> str:
    """One table: per step after the dense ones, each configuration's residual norm, threshold,
    achieved density (target ``density``) and held-out perplexity where evaluated."""
    size = runs[0]["size"]
    lines = [f"# The Adam path after its dense steps ({size} simulated ranks, ρ = {density:g}{title})", "",
             "Per configuration: mean residual norm over ranks / threshold / achieved aggregate density "
             "(distinct entries over the model) / held-out perplexity (every 25 steps).", "",
             "| step | " + " | ".join(run["config"] for run in runs) + " |", "|---|" + "---|" * len(runs)]
    for i, row in enumerate(runs[0]["rows"]):
        if row["step"] < 99 or ((row["step"] + 1) % 10 and "perplexity" not in row):
            continue
        cells = []
        for run in runs:
            r = run["rows"][i]
            threshold = f"{r['threshold']:.2f}" if r.get("threshold") is not None else "-"
            ppl = f" / {r['perplexity']:.1f}" if "perplexity" in r else ""
            cells.append(f"{r['residual_norm']:.0f} / {threshold} / {r['density_actual']:.4f}{ppl}")
        lines.append(f"| {row['step'] + 1} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=160)
    parser.add_argument("--configs", nargs="+",
                        default=["exdyna-tracking+adam", "micro+adam", "deft+adam", "topk+adam"])
    parser.add_argument("--residual-decay", type=float, metavar="G",
                        help="multiply each residual by G before each sparse Adam step (a candidate lever)")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    stem = "probe"
    if args.residual_decay is not None:
        decay_residuals(args.residual_decay)
        stem = f"decay-{args.residual_decay:g}"
    runs = [probe(name, args.size, args.steps) for name in args.configs]
    OUT.mkdir(parents=True, exist_ok=True)
    title = "" if args.residual_decay is None else f", residual decayed by {args.residual_decay:g} a step"
    (OUT / f"{stem}.json").write_text(json.dumps(runs, indent=1))
    (OUT / f"{stem}.md").write_text(markdown(runs, tta.GPT.density, title))
    print(markdown(runs, tta.GPT.density, title))


if __name__ == "__main__":
    main()
