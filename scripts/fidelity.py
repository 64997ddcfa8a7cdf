"""Fidelity: how closely each sparsifier delivers the density it was asked for, how evenly the
ranks share the work, and gradient build-up versus the number of ranks.

1. Curves over training steps (the figures the MiCRO and ExDyna papers are about), on N
   simulated ranks training a real model (hvd_sparse.sim): the density error
   d_t / ρ (aggregated distinct indices / elements, over the target), and the imbalance
   N·max_r c_r / Σ_r c_r − 1 (the padding waste of a padded index allgather; ExDyna's rebalancer
   drives it down) from every rank's own count c_r -- for MiCRO, ExDyna (exact sweep and
   neighbour rebalancer, paper threshold and tracking), DEFT, top-k, Gaussian-k, DGC and the hard
   threshold. In ExDyna's neighbour mode no rank knows every count; the simulator sees every
   rank's own count and derives the imbalance from them.
2. Build-up versus N: the union of the ranks' selections over k for top-k (between 1 and N), for
   N = 2 ... 1024 on the digits CNN at ρ = 0.001, beside the exclusive methods (MiCRO, ExDyna,
   DEFT), whose union is exactly the sum of the ranks' counts (plus DEFT's common layers) at
   every N: union / (Σ counts + common) must be 1.0 exactly, and the script fails if it is not.

Full run (about an hour on 2 shared cores; writes bench/fidelity.{json,png,md} and
bench/buildup.png):

    OMP_NUM_THREADS=1 python scripts/fidelity.py

Quick run (a minute or two; digits only, fewer steps, N ≤ 64; writes under bench/quick/):

    OMP_NUM_THREADS=1 python scripts/fidelity.py --quick

``--resume`` keeps the parts already in the output JSON; ``--part curves`` / ``--part buildup``
runs one part.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import numpy as np
import torch
from convergence import TASKS as RECIPES  # the convergence runs' recipe (lr, momentum, clip, batch)
from results import output_dir, pyplot, save

from hvd_sparse.sim import simulate
from hvd_sparse.sim.tasks import TASKS

# label -> (method, options, optimizer momentum or None for the recipe's)
CURVE_METHODS = {
    "micro": ("micro", {}, None),
    "exdyna": ("exdyna", {}, None),
    "exdyna-neighbour": ("exdyna", {"rebalance": "neighbour"}, None),
    "exdyna-tracking": ("exdyna", {"threshold_scaling": "tracking"}, None),
    "exdyna-tracking-neighbour": ("exdyna", {"threshold_scaling": "tracking", "rebalance": "neighbour"},
                                  None),
    "exdyna-tracking-histogram": ("exdyna", {"threshold_scaling": "tracking", "rebalance": "histogram"},
                                  None),
    "deft": ("deft", {}, None),
    "topk": ("topk", {}, None),
    "gaussiank": ("gaussiank", {}, None),
    "dgc": ("dgc", {}, 0.0),
    "threshold": ("threshold", {}, None),
}
FULL_CURVES = {"world_size": 8, "steps": 1000,
               "configs": [("digits", 0.01), ("digits", 0.001), ("lstm", 0.01)]}
QUICK_CURVES = {"world_size": 8, "steps": 200, "configs": [("digits", 0.01)]}
# label -> (method, options); ExDyna with the tracking threshold, so that its union / k (the
# achieved density over the target) means something after a few steps; MiCRO in paper mode.
BUILDUP_METHODS = {"topk": ("topk", {}), "micro": ("micro", {}),
                   "exdyna-tracking": ("exdyna", {"threshold_scaling": "tracking"}), "deft": ("deft", {})}
FULL_BUILDUP = {"sizes": [2, 4, 8, 16, 32, 64, 128, 256, 512, 1024], "steps": 20, "density": 0.001,
                "task": "digits"}
QUICK_BUILDUP = {"sizes": [2, 4, 8, 16, 32, 64], "steps": 10, "density": 0.001, "task": "digits"}
# Part 3: ExDyna's padding waste versus model size (char-LSTM of growing width, N = 4). A larger
# model gives every partition more entries per step (less count noise), but its load also sits in
# a smaller share of the vector, which the sweep's one block per step is slow to follow.
FULL_WASTE = {"world_size": 4, "steps": 600, "hidden": [128, 256, 512], "densities": [0.01, 0.001],
              "methods": ["exdyna", "exdyna-tracking", "exdyna-tracking-histogram"]}
SMOOTH = 25   # moving-average window of the plotted curves


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="short runs (make bench)")
    parser.add_argument("--out-dir", type=Path, default=None, help="default: bench, or bench/quick")
    parser.add_argument("--part", choices=("curves", "buildup", "waste", "all"), default="all")
    parser.add_argument("--resume", action="store_true", help="keep results already in the JSON")
    return parser.parse_args()


# --- part 1: curves over steps ----------------------------------------------------------------------
def curves(report: dict, spec: dict, out_json: Path) -> None:
    runs = report.setdefault("curves", {})
    for task, density in spec["configs"]:
        recipe = RECIPES[task]
        for label, (method, options, momentum) in CURVE_METHODS.items():
            key = f"{task}/{density:g}/{label}"
            if key in runs and runs[key]["steps"] == spec["steps"]:
                continue
            started = time.perf_counter()
            records = simulate(method, spec["world_size"], spec["steps"], density=density, task=task,
                               options=options, batch_size=recipe["batch_size"], lr=recipe["lr"],
                               momentum=recipe["momentum"] if momentum is None else momentum,
                               clip_norm=recipe["clip_norm"], schedule="cosine", seed=0)
            ratio = np.array([r["density_actual"] / r["density_target"] for r in records])
            imbalance = np.array([r["imbalance"] for r in records])
            body = slice(len(records) // 10, None)
            runs[key] = {
                "task": task, "density": density, "method": label, "options": options,
                "world_size": spec["world_size"], "steps": len(records),
                "density_ratio": [round(float(x), 5) for x in ratio],
                "imbalance": [round(float(x), 5) for x in imbalance],
                "buildup": [round(r["buildup"], 5) for r in records],
                "density_ratio_mean": float(ratio[body].mean()),
                "density_abs_error_mean": float(np.abs(ratio[body] - 1).mean()),
                "imbalance_mean": float(imbalance[body].mean()),
                "imbalance_p90": float(np.quantile(imbalance[body], 0.9)),
                "final_loss": float(np.mean([r["loss"] for r in records[-20:]])),
                "seconds": time.perf_counter() - started,
            }
            print(f"curves {key:<38} density/target {runs[key]['density_ratio_mean']:.3f}  "
                  f"imbalance {runs[key]['imbalance_mean']:.3f}  {runs[key]['seconds']:.0f}s", flush=True)
            out_json.write_text(json.dumps(report))


# --- part 2: build-up versus N -----------------------------------------------------------------------
def buildup(report: dict, spec: dict, out_json: Path) -> None:
    rows = report.setdefault("buildup", {})
    half = spec["steps"] // 2
    for size in spec["sizes"]:
        for label, (method, options) in BUILDUP_METHODS.items():
            key = f"{label}/{size}"
            if key in rows and rows[key]["steps"] == spec["steps"]:
                continue
            if method == "exdyna" and size > 256:   # the paper's 1024 blocks allow N <= 256
                options = dict(options, num_blocks="auto")
            started = time.perf_counter()
            records = simulate(method, size, spec["steps"], density=spec["density"], task=spec["task"],
                               options=options, lr=RECIPES[spec["task"]]["lr"], schedule="constant")
            seconds = time.perf_counter() - started
            exact = all(r["union"] == sum(r["counts"]) + r["common"] for r in records)
            tail = records[half:]
            rows[key] = {
                "method": label, "world_size": size, "steps": len(records), "options": options,
                "k": tail[-1]["k"],
                "union_over_k": float(np.mean([r["union"] / r["k"] for r in tail])),
                "union_over_k_max": float(max(r["union"] / r["k"] for r in tail)),
                "union_over_counts": float(np.mean([r["union"] / (sum(r["counts"]) + r["common"])
                                                    for r in tail])),
                "union_is_sum_of_counts": exact,
                "seconds_per_step": seconds / len(records),
            }
            print(f"buildup {key:<14} union/k {rows[key]['union_over_k']:8.2f}  union/(Σcounts+common) "
                  f"{rows[key]['union_over_counts']:.4f}  exact {exact}  "
                  f"{rows[key]['seconds_per_step']:.2f}s/step", flush=True)
            out_json.write_text(json.dumps(report))


# --- part 3: ExDyna's padding waste versus model size -------------------------------------------------
def lstm_parameters(hidden: int) -> int:
    return sum(p.numel() for p in TASKS["lstm"](hidden=hidden).model.parameters())


def waste(report: dict, spec: dict, out_json: Path) -> None:
    rows = report.setdefault("waste", {})
    recipe = RECIPES["lstm"]
    for hidden in spec["hidden"]:
        for density in spec["densities"]:
            for label in spec["methods"]:
                key = f"lstm-{hidden}/{density:g}/{label}"
                if key in rows and rows[key]["steps"] == spec["steps"]:
                    continue
                method, options, _ = CURVE_METHODS[label]
                started = time.perf_counter()
                records = simulate(method, spec["world_size"], spec["steps"], density=density, task="lstm",
                                   options=options, batch_size=recipe["batch_size"], lr=recipe["lr"],
                                   momentum=recipe["momentum"], clip_norm=recipe["clip_norm"],
                                   schedule="cosine", seed=0, task_options={"hidden": hidden})
                body = records[len(records) // 3:]   # after the rebalancer's first moves
                imbalance = np.array([r["imbalance"] for r in body])
                rows[key] = {
                    "hidden": hidden, "numel": lstm_parameters(hidden),
                    "density": density, "method": label, "world_size": spec["world_size"],
                    "steps": len(records), "k": records[0]["k"],
                    "imbalance_mean": float(imbalance.mean()),
                    "imbalance_p90": float(np.quantile(imbalance, 0.9)),
                    "density_ratio_mean": float(np.mean([r["density_actual"] / r["density_target"]
                                                         for r in body])),
                    "seconds": time.perf_counter() - started,
                }
                print(f"waste {key:<34} k {rows[key]['k']:>6}  imbalance {rows[key]['imbalance_mean']:.3f}  "
                      f"density/target {rows[key]['density_ratio_mean']:.3f}  {rows[key]['seconds']:.0f}s",
                      flush=True)
                out_json.write_text(json.dumps(report))


# --- report -------------------------------------------------------------------------------------------
def smooth(values: list[float]) -> np.ndarray:
    values = np.asarray(values, dtype=np.float64)
    if values.size < SMOOTH:
        return values
    kernel = np.ones(SMOOTH) / SMOOTH
    return np.convolve(values, kernel, mode="valid")


def plot(report: dict, out_dir: Path) -> list[str]:
    plt = pyplot()
    if plt is None:
        return []
    written = []
    runs = report.get("curves", {})
    configs = sorted({(r["task"], r["density"]) for r in runs.values()}, key=lambda c: (c[0], -c[1]))
    if configs:
        colors = {m: plt.cm.tab20(i % 20) for i, m in enumerate(CURVE_METHODS)}
        fig, axes = plt.subplots(len(configs), 2, figsize=(13, 4.2 * len(configs)), squeeze=False)
        for row, (task, density) in enumerate(configs):
            left, right = axes[row]
            for label in CURVE_METHODS:
                run = runs.get(f"{task}/{density:g}/{label}")
                if run is None:
                    continue
                style = {"color": colors[label], "linewidth": 1.0,
                         "linestyle": ":" if "neighbour" in label else "-"}
                x = np.arange(len(smooth(run["density_ratio"]))) + SMOOTH
                left.plot(x, smooth(run["density_ratio"]), label=label, **style)
                right.plot(x, smooth(run["imbalance"]), label=label, **style)
            name = "digits CNN" if task == "digits" else "char-LSTM"
            left.axhline(1.0, color="black", linewidth=0.8)
            left.set_yscale("log")
            left.set_ylabel("achieved / target density")
            left.set_title(f"density error, {name}, ρ = {density:g}, "
                           f"N = {report['config']['curves']['world_size']}")
            right.set_yscale("symlog", linthresh=0.1)
            right.set_ylim(bottom=0)
            right.axhline(0.1, color="green", linestyle="--", linewidth=0.8)
            right.set_ylabel("imbalance N·max c / Σc − 1")
            right.set_title(f"selection imbalance, {name}, ρ = {density:g}")
            for ax in (left, right):
                ax.set_xlabel(f"step (moving average of {SMOOTH})")
                ax.grid(alpha=0.3)
        axes[0][1].legend(fontsize=7, ncol=2)
        written.append(save(fig, out_dir / "fidelity.png"))
    rows = report.get("buildup", {})
    if rows:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        sizes = sorted({r["world_size"] for r in rows.values()})
        for method, marker in zip(BUILDUP_METHODS, "osD^", strict=True):  # labels
            points = [(n, rows[f"{method}/{n}"]) for n in sizes if f"{method}/{n}" in rows]
            if not points:
                continue
            if method == "topk":
                ax.plot([n for n, _ in points], [r["union_over_k"] for _, r in points], marker=marker,
                        label="top-k: union / k")
            else:
                ax.plot([n for n, _ in points], [r["union_over_counts"] for _, r in points], marker=marker,
                        label=f"{method}: union / (Σ counts + common)", linestyle="--")
        ax.plot(sizes, sizes, color="gray", linewidth=0.8, linestyle=":", label="N (no overlap at all)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("simulated ranks N")
        ax.set_ylabel("build-up")
        density = report["config"]["buildup"]["density"]
        ax.set_title(f"gradient build-up versus N (digits CNN, ρ = {density:g})")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        written.append(save(fig, out_dir / "buildup.png"))
    return written


def markdown(report: dict, figures: list[str]) -> str:
    config = report["config"]
    lines = [f"### Fidelity ({'quick' if config['quick'] else 'full'} run)", ""]
    runs = report.get("curves", {})
    if runs:
        spec = config["curves"]
        lines += [f"Density error and imbalance over {spec['steps']} steps on N = {spec['world_size']} "
                  "simulated ranks (means over the steps after the first 10%; imbalance = "
                  "N·max c / Σc − 1 from every rank's own count).", "",
                  "| task | ρ | method | achieved/target | mean abs. density error | imbalance mean | "
                  "imbalance p90 |", "|---|---|---|---|---|---|---|"]
        for key in sorted(runs, key=lambda k: (runs[k]["task"], -runs[k]["density"],
                                               list(CURVE_METHODS).index(runs[k]["method"]))):
            r = runs[key]
            lines.append(f"| {r['task']} | {r['density']:g} | {r['method']} | "
                         f"{r['density_ratio_mean']:.3f} | {100 * r['density_abs_error_mean']:.1f}% | "
                         f"{r['imbalance_mean']:.3f} | "
                         f"{r['imbalance_p90']:.3f} |")
        lines.append("")
    rows = report.get("buildup", {})
    if rows:
        spec = config["buildup"]
        sizes = sorted({r["world_size"] for r in rows.values()})
        exclusive = [m for m in BUILDUP_METHODS if m != "topk"]
        lines += [f"Build-up versus N ({spec['task']}, ρ = {spec['density']:g}, {spec['steps']} steps, means "
                  "over the second half). Top-k: union / k. Exclusive methods: union / (Σ counts + "
                  "common) -- exactly 1.0 at every step when the column 'exact' says yes -- and, for "
                  "reference, union / k (their achieved density over the target: the threshold's "
                  "accuracy, not build-up; at large N it cannot go below N / k, as every rank sends at "
                  "least one index).", "",
                  "| N | top-k union/k | "
                  + " | ".join(f"{m} union/(Σc+common) | exact | {m} union/k" for m in exclusive)
                  + " | s/step (top-k) |",
                  "|---" * (3 + 3 * (len(BUILDUP_METHODS) - 1)) + "|"]
        for n in sizes:
            top = rows.get(f"topk/{n}")
            cells = [str(n), f"{top['union_over_k']:.2f}" if top else "–"]
            for m in exclusive:
                r = rows.get(f"{m}/{n}")
                cells += ([f"{r['union_over_counts']:.4f}", "yes" if r["union_is_sum_of_counts"] else "NO",
                           f"{r['union_over_k']:.2f}"] if r else ["–"] * 3)
            cells.append(f"{top['seconds_per_step']:.2f}" if top else "–")
            lines.append("| " + " | ".join(cells) + " |")
        exact = all(r["union_is_sum_of_counts"] for r in rows.values() if r["method"] != "topk")
        lines += ["", f"Target 'exclusive methods' union/k exactly 1.0 at every N' (read as union = Σ counts "
                      f"+ common: no build-up): **{'met' if exact else 'NOT MET'}** for "
                      f"N = {sizes[0]} ... {sizes[-1]}.", ""]
    rows = report.get("waste", {})
    if rows:
        spec = config.get("waste") or FULL_WASTE
        lines += [f"ExDyna's padding waste versus model size (char-LSTM of growing width, N = "
                  f"{spec['world_size']}, {spec['steps']} steps, means over the last two thirds): "
                  "k is the target count per step (summed over the ranks); each method's cell: "
                  "imbalance mean (p90), achieved/target.", ""]
        lines += waste_table(rows)
    lines += [f"![{Path(f).stem}]({Path(f).name})" for f in figures] + [""]
    return "\n".join(lines)


def waste_table(rows: dict) -> list[str]:
    """One row per model width and density, one column per method."""
    methods = sorted({r["method"] for r in rows.values()})
    settings = sorted({(r["hidden"], r["numel"], r["density"], r["k"]) for r in rows.values()},
                      key=lambda s: (s[0], -s[2]))
    lines = ["| LSTM width | parameters | ρ | k | " + " | ".join(methods) + " |",
             "|---|---|---|---|" + "---|" * len(methods)]
    for hidden, numel, density, k in settings:
        cells = []
        for method in methods:
            r = next((r for r in rows.values() if (r["hidden"], r["density"], r["method"])
                      == (hidden, density, method)), None)
            cells.append(f"{r['imbalance_mean']:.3f} ({r['imbalance_p90']:.3f}), "
                         f"{r['density_ratio_mean']:.3f}" if r else "–")
        lines.append(f"| {hidden} | {numel} | {density:g} | {k} | " + " | ".join(cells) + " |")
    return [*lines, ""]


def judge(report: dict) -> list[dict]:
    """The issue's build-up target, met or not, with its figures (read by scripts/report.py)."""
    rows = report.get("buildup", {})
    if not rows:
        return []
    sizes = sorted({r["world_size"] for r in rows.values()})
    exclusive = sorted({r["method"] for r in rows.values() if r["method"] != "topk"})
    exact = all(r["union_is_sum_of_counts"] for r in rows.values() if r["method"] != "topk")
    worst = max((r["union_over_counts"] for r in rows.values() if r["method"] != "topk"), default=1.0)
    topk = {r["world_size"]: r["union_over_k"] for r in rows.values() if r["method"] == "topk"}
    figure = (f"N = {sizes[0]} … {sizes[-1]}: union = Σ counts + common at every step for "
              f"{', '.join(exclusive)} (largest mean ratio {worst:.4f})")
    if topk:
        figure += "; top-k union/k " + ", ".join(f"{topk[n]:.2f} (N={n})" for n in sorted(topk))
    return [{"target": "exclusive methods' union/k exactly 1.0 at every N (no build-up)",
             "met": exact, "figure": figure}]


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    out_dir = output_dir(args.out_dir, args.quick)
    out_json = out_dir / "fidelity.json"
    report = json.loads(out_json.read_text()) if args.resume and out_json.exists() else {}
    curve_spec = QUICK_CURVES if args.quick else FULL_CURVES
    buildup_spec = QUICK_BUILDUP if args.quick else FULL_BUILDUP
    waste_spec = None if args.quick else FULL_WASTE
    report["config"] = {"quick": args.quick, "curves": curve_spec, "buildup": buildup_spec,
                        "waste": waste_spec, "recipes": RECIPES, "python": platform.python_version(),
                        "torch": torch.__version__}
    if args.part in ("curves", "all"):
        curves(report, curve_spec, out_json)
    if args.part in ("buildup", "all"):
        buildup(report, buildup_spec, out_json)
    if args.part in ("waste", "all") and waste_spec is not None:
        waste(report, waste_spec, out_json)
    figures = plot(report, out_dir)
    report["targets"] = judge(report)
    out_json.write_text(json.dumps(report))
    (out_dir / "fidelity.md").write_text(markdown(report, figures))
    failed = [key for key, r in report.get("buildup", {}).items()
              if r["method"] != "topk" and not r["union_is_sum_of_counts"]]
    print(f"wrote {out_json}, {out_dir / 'fidelity.md'}" + "".join(f", {f}" for f in figures))
    if failed:
        raise SystemExit(f"union != sum of counts (+ common) for {failed}")


if __name__ == "__main__":
    main()
