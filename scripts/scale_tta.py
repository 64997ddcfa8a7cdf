"""Time to accuracy at scale: steps to dense's quality from the N-rank simulator at N = 16 (and
64), times each method's step projected by scripts/scale.py's cost model. The steps are measured
(the simulator makes every rank's decisions); the seconds are a projection, and labelled so.

The task is time_to_accuracy.py's transformer study (the small GPT on the standard library's
words, AdamW, ρ = 0.01, every method on the Adam path) with the per-rank batch held fixed: the
global batch grows with N, as it does when a job adds workers. Dense trains ``--dense-steps``;
the target is its held-out perplexity plus 2%; every other configuration trains until it gets
there or for ``--budget`` times dense's steps. Time to target = the path's 100 dense steps at
dense's projected step + the rest at the method's, per profile and rate; speedup over dense.

    OMP_NUM_THREADS=1 python scripts/scale_tta.py --curves --sizes 16      # ~70 min here
    OMP_NUM_THREADS=1 python scripts/scale_tta.py --curves --configs dense topk+adam-shared-v &
    OMP_NUM_THREADS=1 python scripts/scale_tta.py --curves --configs dense lags+adam-shared-v
                                                     # two processes fill one report
    OMP_NUM_THREADS=1 python scripts/scale_tta.py --curves --sizes 64 --configs dense topk+adam
    python scripts/scale_tta.py                                           # the report from saved curves

Writes bench/scale/tta/{tta.json, scale-tta.md}.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import scale
import time_to_accuracy as tta
from results import pyplot, save

OUT = scale.OUT / "tta"
PATH_METHODS = ("exdyna-tracking", "micro", "deft", "lags", "topk", "dgc")
CONFIGS = ("dense", *(f"{m}{tta.ADAM_PATH}" for m in PATH_METHODS),
           *(f"{m}{tta.SHARED_V}" for m in PATH_METHODS))
MODEL = "word-gpt"


def setup(sizes: list[int], dense_steps: int, budget: float) -> tta.Setup:
    """The transformer study at these world sizes, written into this script's folder."""
    return dataclasses.replace(tta.GPT, world_sizes=tuple(sizes), dense_steps=dense_steps, budget=budget,
                               configs=CONFIGS, out_dir=OUT)


def times_to_target(report: dict, study: tta.Setup, profiles: dict, rates: list[str]) -> list[dict]:
    """Per N with curves, profile, rate and configuration: steps to the target and the projected
    seconds to it (dense steps of the Adam path at dense's step), with the speedup over dense."""
    sizes = scale.model_sizes(MODEL)
    projections: dict = {}   # (N, profile, rate) -> every configuration's projected step

    def projected_at(world: int, profile, rate: str) -> dict:
        key = (world, profile.name, rate)
        if key not in projections:
            network = scale.Network(scale.parse_rate(rate), latency=profile.latency,
                                    overhead=profile.overhead, allreduce=profile.allreduce)
            projections[key] = scale.project(sizes, profile.compute[MODEL], profile, world, network,
                                             study.density)
        return projections[key]

    rows = []
    for key, run in report["curves"].items():
        name, world = key.split("/")
        target = tta.target_of(report, int(world))
        steps = tta.steps_to_target(run["curve"], target)
        for profile in profiles.values():
            for rate in rates:
                projected = projected_at(int(world), profile, rate)
                row = {"config": name, "world": int(world), "profile": profile.name, "rate": rate,
                       "steps": steps, "best": min(v for _, v in run["curve"])}
                if steps is not None:
                    method = projected[tta.adam_variant(name)[0]]["step"]
                    if name.endswith(tta.SHARED_V):   # the refresh: a dense allreduce every K steps
                        method += projected["dense"]["comm"] / tta.SHARED_V_EVERY
                    warm = min(study.warmup_steps(name), steps)
                    row["seconds"] = warm * projected["dense"]["step"] + (steps - warm) * method
                rows.append(row)
    for row in rows:
        dense = next((r for r in rows if r["config"] == "dense" and r["world"] == row["world"]
                      and r["profile"] == row["profile"] and r["rate"] == row["rate"]), {})
        if row.get("seconds") and dense.get("seconds"):
            row["speedup"] = dense["seconds"] / row["seconds"]
    return rows


PLOTTED = (("cpu", "1gbit"), ("gpu", "10gbit"))


def plot(rows: list[dict]) -> str | None:
    """Projected seconds to the target against N, one panel per profile and rate of ``PLOTTED``,
    one line per configuration through the sizes where it got there (listed with the sizes
    where it did not)."""
    plt = pyplot()
    if plt is None or not rows:
        return None
    figure, axes = plt.subplots(1, len(PLOTTED), figsize=(6 * len(PLOTTED), 4.2), squeeze=False)
    for ax, (profile, rate) in zip(axes[0], PLOTTED, strict=True):
        mine = [r for r in rows if (r["profile"], r["rate"]) == (profile, rate)]
        for name in dict.fromkeys(r["config"] for r in mine):
            runs = [r for r in mine if r["config"] == name]
            points = sorted((r["world"], r["seconds"]) for r in runs if r.get("seconds"))
            missed = sorted(r["world"] for r in runs if not r.get("seconds"))
            label = name + (f" (not reached at N = {', '.join(map(str, missed))})" if missed else "")
            if points:
                ax.plot(*zip(*points, strict=True), marker="o", label=label,
                        linestyle="-" if name == "dense" else "--")
            else:
                ax.plot([], [], label=label)
        ax.set(title=f"{profile} profile, {rate} (seconds projected)", xscale="log", yscale="log",
               xlabel="ranks N", ylabel="seconds to dense's perplexity")
        ax.legend(fontsize=7)
    return save(figure, OUT / "tta-vs-n.png")


def markdown(rows: list[dict], study: tta.Setup, profiles: dict) -> str:
    """One table per N: steps measured, seconds projected for every profile and rate."""
    lines = ["# Time to accuracy at scale (steps simulated, seconds projected)", "",
             f"The transformer study (`{study.task}`, AdamW, ρ = {study.density:g}, per-rank batch "
             f"{study.recipe['batch_size']} held fixed), target dense's held-out perplexity after "
             f"{study.dense_steps} steps + 2%, budget {study.budget:g}x; seconds from scripts/scale.py's "
             "cost model (a projection).", ""]
    lines += [f"- {p.note}" for p in profiles.values()]
    for world in sorted({r["world"] for r in rows}):
        mine = [r for r in rows if r["world"] == world]
        columns = sorted({(r["profile"], r["rate"]) for r in mine},
                         key=lambda c: (c[0], scale.parse_rate(c[1])))
        lines += ["", f"## N = {world}", "",
                  "| configuration | steps to target | " + " | ".join(f"{p} {r}" for p, r in columns) + " |",
                  "|---|---|" + "---|" * len(columns)]
        for name in dict.fromkeys(r["config"] for r in mine):
            cells = []
            for column in columns:
                row = next(r for r in mine if r["config"] == name and (r["profile"], r["rate"]) == column)
                cells.append(f"{row['seconds']:.0f} s ({row['speedup']:.2f}x)" if row.get("speedup") else "-")
            first = next(r for r in mine if r["config"] == name)
            steps = first["steps"] if first["steps"] is not None else f"not reached ({first['best']:.2f})"
            lines.append(f"| {name} | {steps} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    """Train the curves when asked, then compose and write the report."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--curves", action="store_true")
    parser.add_argument("--sizes", type=int, nargs="+", default=[16])
    parser.add_argument("--dense-steps", type=int, default=500)
    parser.add_argument("--budget", type=float, default=3.0)
    parser.add_argument("--rates", nargs="+", default=["1gbit", "10gbit", "25gbit"])
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS,
                        help="the configurations to train (dense first: it sets the target)")
    args = parser.parse_args()
    study = setup(args.sizes, args.dense_steps, args.budget)
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / "tta.json"
    report = json.loads(path.read_text()) if path.exists() else {"curves": {}}

    def save() -> None:   # merged with the file's curves: several processes may fill one report
        if path.exists():
            report["curves"] = {**json.loads(path.read_text())["curves"], **report["curves"]}
        path.write_text(json.dumps(report, indent=1))

    if args.curves:
        import torch

        torch.set_num_threads(1)
        tta.run_curves(study, report, args.configs, args.sizes, save)
    fits = scale.load_fits(scale.OUT / "calibration.json")
    profiles = {"cpu": scale.calibrated_cpu_profile([MODEL], fits), "gpu": scale.gpu_profile()}
    rows = times_to_target(report, study, profiles, args.rates)
    report["rows"] = rows
    save()
    figure = plot(rows)
    text = markdown(rows, study, profiles)
    if figure:
        text += f"\n![time to accuracy against N]({figure.rsplit('/', 1)[-1]})\n"
    (OUT / "scale-tta.md").write_text(text)
    print(markdown(rows, study, profiles))


if __name__ == "__main__":
    main()
