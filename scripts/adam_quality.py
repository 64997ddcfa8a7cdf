"""Quality under AdamW: every seed method plain and on the Adam path, on the transformer task.

The N-rank simulator (hvd_sparse.sim) trains the small GPT (hvd_sparse/sim/gpt.py, 0.93 M
parameters, the standard library's tree as text) with AdamW (lr 1e-3, weight decay 0.01) on 4
ranks for 2000 steps, every run with the same seeds and data; only the exchange changes:

* ``dense``: the plain average, torch's AdamW on it;
* ``<method>``: the method as users run it today, torch's AdamW on its sparse average;
* ``<method>+adam``: the method on the Adam path (docs/methods.md#adam-and-adamw; 100 dense steps,
  then error feedback on each rank's own Adam update);
* ``<method>+adam-shared-v`` (``--shared-v``): the same with the second moment shared by the
  ranks, refreshed from a dense average of the gradient every 20 sparse steps
  (``second_moment_refresh``), whose bytes count.

Methods: the seed methods (ExDyna with the tracking threshold, MiCRO, DEFT, LAGS) and TopK and
DGC beside them, at ρ = 0.01 and 0.001. What a run reports: the held-out perplexity (16 k
validation tokens) every 250 steps and at the end, its log (the held-out loss), the training loss
(mean of the last 100 steps' losses over ranks), and what it exchanged over every step, dense
steps included: the payload a rank puts into collectives (the engine's ``bytes_sent``) against a
dense allreduce's (4 bytes an entry), and the bytes on the wire of the ring algorithms
(convergence.py's ``WireGroup``).

The targets (issue 35): each seed method on the path closes at least half of today's gap to dense
(held-out loss, plain minus dense) at both densities, exchanging at most 20% of dense's bytes;
moonshots: within 5% of dense's held-out perplexity at ρ = 0.01 and 15% at ρ = 0.001.

    OMP_NUM_THREADS=1 python scripts/adam_quality.py --jobs 2            # about 1.5 hours here
    OMP_NUM_THREADS=1 python scripts/adam_quality.py --quick             # a few minutes
    OMP_NUM_THREADS=1 python scripts/adam_quality.py --long --jobs 2     # 10,000 steps at ρ = 0.001
    OMP_NUM_THREADS=1 python scripts/adam_quality.py --resume --shared-v --densities 0.01 --jobs 2
    OMP_NUM_THREADS=1 python scripts/adam_quality.py --long --methods lags --variants adam-shared-v --jobs 2
    OMP_NUM_THREADS=1 python scripts/adam_quality.py --resume --seeds 1 2 --methods micro deft \
        --densities 0.01 --variants plain adam adam-shared-v --jobs 2     # more seeds, beside seed 0

Writes bench/adam-quality.{json,md,png} (``--long``: bench/adam-quality-10k/; ``--quick``:
bench/quick/). ``--resume`` keeps the runs already in the JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import platform
import time
from pathlib import Path

import numpy as np
import torch
from convergence import exchange_figures, simulate_counted
from results import machine_info, output_dir, pyplot, save
from time_to_accuracy import SHARED_V, SHARED_V_EVERY

SEED_METHODS = ("exdyna-tracking", "micro", "deft", "lags")
PEERS = ("topk", "dgc")
METHODS = {"exdyna-tracking": ("exdyna", {"threshold_scaling": "tracking"}), "micro": ("micro", {}),
           "deft": ("deft", {}), "lags": ("lags", {}), "topk": ("topk", {}),
           "dgc": ("dgc", {"momentum": 0.0})}
DENSITIES = (0.01, 0.001)
WORLD_SIZE = 4
RECIPE = {"task": "gpt", "optimizer": "adamw", "lr": 1e-3, "weight_decay": 0.01, "batch_size": 8,
          "steps": 2000, "evaluate_every": 250, "seed": 0}
QUICK = {"steps": 300, "evaluate_every": 100, "methods": ("exdyna-tracking", "topk"), "densities": (0.01,)}
LONG = {"steps": 10_000, "evaluate_every": 1000, "methods": ("exdyna-tracking",), "densities": (0.001,),
        "variants": ("adam",)}
# The targets.
GAP_SHARE = 0.5             # the path closes at least half of the plain method's gap
BYTES_SHARE = 0.20          # ... exchanging at most 20% of dense's bytes, dense steps included
MOONSHOT = {0.01: 0.05, 0.001: 0.15}   # held-out perplexity within 5% / 15% of dense
LONG_MOONSHOT = 0.05        # the long run: within 5% of dense
TRAIN_TAIL = 100            # steps in the training loss's mean


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help=f"{QUICK['steps']} steps, two methods, ρ = 0.01")
    parser.add_argument("--long", action="store_true",
                        help=f"dense and ExDyna tracking on the path at ρ = 0.001 for {LONG['steps']} steps")
    parser.add_argument("--methods", nargs="+", choices=list(METHODS), default=None)
    parser.add_argument("--densities", nargs="+", type=float, default=None)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--jobs", type=int, default=1, help="runs at once (one core each)")
    parser.add_argument("--resume", action="store_true", help="keep the runs already in the JSON")
    parser.add_argument("--shared-v", action="store_true",
                        help=f"also the path with a shared second moment (refreshed every {SHARED_V_EVERY})")
    parser.add_argument("--variants", nargs="+", choices=list(LABELS), default=None,
                        help="which runs of each method (default: plain and adam; --long: adam)")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0],
                        help="seeds of model and data (default 0); the tables show seed 0, the "
                             "others are reported beside it, per seed and on the mean")
    parser.add_argument("--out-dir", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.quick and args.long:
        parser.error("--quick and --long exclude each other")
    mode = QUICK if args.quick else LONG if args.long else {}
    args.steps = args.steps or mode.get("steps", RECIPE["steps"])
    args.evaluate_every = mode.get("evaluate_every", RECIPE["evaluate_every"])
    args.methods = args.methods or list(mode.get("methods", SEED_METHODS + PEERS))
    args.densities = args.densities or list(mode.get("densities", DENSITIES))
    args.variants = tuple(args.variants or mode.get("variants", ("plain", "adam")))
    args.variants += ("adam-shared-v",) if args.shared_v and "adam-shared-v" not in args.variants else ()
    if args.out_dir is None and args.long:
        args.out_dir = Path("bench/adam-quality-10k")
    return args


def run_key(name: str, density: float, seed: int = 0) -> str:
    """A run's key in the report: seed 0's as it always was, another seed's with ``@seed<s>``."""
    return f"{name}/{density:g}" + (f"@seed{seed}" if seed else "")


LABELS = {"plain": "", "adam": "+adam", "adam-shared-v": SHARED_V}   # variant -> suffix of its runs


def jobs_of(args: argparse.Namespace) -> list[tuple[str, str, float, str, int]]:
    """(key, method name, density, variant, seed) of every run of the matrix; dense once a seed."""
    jobs = []
    for seed in args.seeds:
        jobs.append((run_key("dense", 1.0, seed), "dense", 1.0, "plain", seed))
        for density in args.densities:
            for name in args.methods:
                for variant in args.variants:
                    key = run_key(name + LABELS[variant], density, seed)
                    jobs.append((key, name, density, variant, seed))
    return jobs


def run_one(job: tuple[str, str, float, str, int], steps: int, evaluate_every: int) -> tuple[str, dict]:
    """One run of the matrix in this process (one torch thread): what the report keeps of it."""
    torch.set_num_threads(1)
    key, name, density, variant, seed = job
    method, options = ("dense", {}) if name == "dense" else METHODS[name]
    if variant == "adam-shared-v":
        options = {**options, "second_moment_refresh": SHARED_V_EVERY}
    adam = variant != "plain"
    started = time.perf_counter()
    records = simulate_counted(
        method, WORLD_SIZE, steps, density=density, task=RECIPE["task"], options=options,
        batch_size=RECIPE["batch_size"], lr=RECIPE["lr"], optimizer=RECIPE["optimizer"],
        weight_decay=RECIPE["weight_decay"], adam_path=adam, seed=seed, evaluate_every=evaluate_every)
    return key, {**condense(records, name, density, adam, time.perf_counter() - started), "seed": seed}


def condense(records: list[dict], name: str, density: float, adam: bool, seconds: float) -> dict:
    """Curves, final quality and the exchange of one run."""
    curve = [[r["step"] + 1, r["perplexity"]] for r in records if "perplexity" in r]
    every = max(1, len(records) // 200)
    losses = [r["loss"] for r in records]
    return {"method": name, "density": density, "adam": adam, "steps": len(records),
            "perplexity": curve[-1][1], "heldout_loss": math.log(curve[-1][1]), "curve": curve,
            "train_loss": float(np.mean(losses[-TRAIN_TAIL:])),
            "loss_curve": [[i + 1, round(float(np.mean(losses[i:i + every])), 4)]
                           for i in range(0, len(losses), every)],
            "finite": all(math.isfinite(x) for x in losses),
            **exchange_figures(records), "seconds": seconds}


def run_all(args: argparse.Namespace, out_json: Path) -> dict:
    report = json.loads(out_json.read_text()) if args.resume and out_json.exists() else {"runs": {}}
    kept = report.get("config", {})   # --resume: the saved runs' methods and densities stay reported
    methods = list(dict.fromkeys([*kept.get("methods", {}), *args.methods]))
    densities = sorted({*kept.get("densities", []), *args.densities}, reverse=True)
    seeds = sorted({*kept.get("seeds", [0]), *args.seeds})
    report["config"] = {"recipe": RECIPE, "world_size": WORLD_SIZE, "steps": args.steps, "seeds": seeds,
                        "methods": {m: METHODS[m] for m in methods}, "densities": densities,
                        "python": platform.python_version(), "torch": torch.__version__,
                        "machine": machine_info()}
    pending = [job for job in jobs_of(args)
               if report["runs"].get(job[0], {}).get("steps") != args.steps]
    with multiprocessing.get_context("spawn").Pool(max(1, args.jobs)) as pool:
        waiting = [pool.apply_async(run_one, (job, args.steps, args.evaluate_every)) for job in pending]
        for result in waiting:
            key, run = result.get()
            report["runs"][key] = run
            print(f"{key:<28} perplexity {run['perplexity']:8.2f}  train loss {run['train_loss']:.3f}  "
                  f"payload {run['payload_sent'] / dense_payload(report):.4f} of dense  "
                  f"{run['seconds']:.0f}s", flush=True)
            out_json.write_text(json.dumps(report))
    return report


def dense_payload(report: dict) -> float:
    """A dense step's payload per rank: every entry once, 4 bytes (a dense run's own figure, the
    same at every seed)."""
    dense = [run for key, run in report["runs"].items() if key.split("@")[0] == run_key("dense", 1.0)]
    return dense[0]["payload_sent"] if dense else math.nan


# --- the report ------------------------------------------------------------------------------------
def gap_closed(plain: float, path: float, dense: float) -> float:
    """The share of the plain method's gap to dense that the path closes (1: all of it)."""
    gap = plain - dense
    return (plain - path) / gap if gap > 0 else math.nan


def rows(report: dict, suffix: str = "+adam") -> list[dict]:
    """One row per (density, method): plain, path (the runs named with ``suffix``), dense, the gap
    closed and the bytes."""
    runs, out = report["runs"], []
    dense = runs.get(run_key("dense", 1.0))
    if dense is None:
        return out
    for density in report["config"]["densities"]:
        for name in report["config"]["methods"]:
            plain, path = runs.get(run_key(name, density)), runs.get(run_key(name + suffix, density))
            if path is None:
                continue
            row = {"density": density, "method": name, "path": path, "plain": plain, "dense": dense,
                   "bytes": path["payload_sent"] / dense["payload_sent"],
                   "ppl_ratio": path["perplexity"] / dense["perplexity"]}
            if plain is not None:
                row["closed"] = gap_closed(plain["heldout_loss"], path["heldout_loss"], dense["heldout_loss"])
                row["closed_train"] = gap_closed(plain["train_loss"], path["train_loss"], dense["train_loss"])
            out.append(row)
    return out


def seed_rows(report: dict) -> list[dict]:
    """The (method, density, path) runs at more than one seed: per seed the share of its plain
    run's gap closed (each against dense at that seed), and the share on the held-out losses
    averaged over those seeds."""
    runs = report["runs"]
    seeds = sorted({0, *(int(key.split("@seed")[1]) for key in runs if "@seed" in key)})
    out = []
    for density in report["config"]["densities"]:
        for name in report["config"]["methods"]:
            for suffix in ("+adam", SHARED_V):
                trios = {seed: [runs.get(run_key(n, d, seed)) for n, d in
                                ((name, density), (name + suffix, density), ("dense", 1.0))]
                         for seed in seeds}
                complete = {seed: trio for seed, trio in trios.items() if all(trio)}
                if len(complete) > 1:
                    out.append(_over_seeds(name, density, suffix, complete))
    return out


def _over_seeds(name: str, density: float, suffix: str, trios: dict[int, list[dict]]) -> dict:
    """``seed_rows``' row of one (method, density, path) from its (plain, path, dense) runs a seed."""
    def closed(plain: dict, path: dict, dense: dict) -> float:
        return gap_closed(plain["heldout_loss"], path["heldout_loss"], dense["heldout_loss"])

    mean = [{"heldout_loss": float(np.mean([trio[i]["heldout_loss"] for trio in trios.values()]))}
            for i in range(3)]
    return {"method": name, "density": density, "suffix": suffix, "seeds": list(trios), "runs": trios,
            "per_seed": {seed: closed(*trio) for seed, trio in trios.items()}, "closed": closed(*mean),
            "bytes": max(path["payload_sent"] / dense["payload_sent"] for _, path, dense in trios.values())}


PATHS = {"+adam": "the Adam path", SHARED_V: "the Adam path with a shared second moment"}


def targets(report: dict) -> list[dict]:
    """The issue's targets as scripts/report.py collects them: met or not, with the figures, and
    the short ``label`` this report's summary lines use. A run of ``LONG``'s length is held to the
    long moonshot, and needs no plain run beside it."""
    out, steps = [], report["config"]["steps"]
    long = steps >= LONG["steps"]
    for suffix in PATHS:
        for row in rows(report, suffix):
            if row["method"] not in SEED_METHODS:
                continue
            density, share = row["density"], row["bytes"]
            if row["plain"] is not None:
                closed = row.get("closed", math.nan)
                out.append(_required(row["method"], suffix, density, steps, closed, share, "",
                                     f"{closed:.0%} of the gap closed: held-out loss "
                                     f"{row['plain']['heldout_loss']:.3f} plain, "
                                     f"{row['path']['heldout_loss']:.3f} on the path, "
                                     f"{row['dense']['heldout_loss']:.3f} dense; {share:.1%} of dense's "
                                     "bytes"))
            moon = LONG_MOONSHOT if long else MOONSHOT.get(density, LONG_MOONSHOT)
            out.append({"target": f"moonshot: {row['method']} on {PATHS[suffix]} within {moon:.0%} of dense "
                                  f"AdamW's held-out perplexity at ρ = {density:g}"
                                  + (f" after {steps:,} steps" if long else ""),
                        "met": bool(row["ppl_ratio"] <= 1 + moon),
                        "figure": f"{row['ppl_ratio']:.3f}x dense; {share:.1%} of dense's bytes",
                        "label": _label(row["method"], suffix, density)})
    for row in seed_rows(report):
        seeds = ", ".join(map(str, row["seeds"]))
        out.append(_required(row["method"], row["suffix"], row["density"], steps, row["closed"], row["bytes"],
                             seeds, f"{row['closed']:.0%} on the mean (per seed: "
                             + ", ".join(f"{closed:.0%}" for closed in row["per_seed"].values())
                             + f"); at most {row['bytes']:.1%} of dense's bytes"))
    return out


def _required(method: str, suffix: str, density: float, steps: int, closed: float, share: float,
              seeds: str, figure: str) -> dict:
    """The required target of one method on one path: at least half its plain gap closed within the
    byte budget; ``seeds``: judged on the loss averaged over these seeds ("": seed 0 alone)."""
    over = f", on the held-out loss averaged over seeds {seeds}" if seeds else ""
    return {"target": f"{method} on {PATHS[suffix]} closes at least half of its plain gap to dense AdamW at "
                      f"ρ = {density:g} with at most {BYTES_SHARE:.0%} of dense's bytes{over} (transformer "
                      f"task, {WORLD_SIZE} ranks, {steps} steps)",
            "met": bool(closed >= GAP_SHARE and share <= BYTES_SHARE), "figure": figure,
            "label": _label(method, suffix, density) + (f" on the mean of seeds {seeds}" if seeds else "")}


def _label(method: str, suffix: str, density: float) -> str:
    """'<method> at ρ = x', with '(shared v)' on that path: a target in the summary lines."""
    return f"{method}{' (shared v)' if suffix == SHARED_V else ''} at ρ = {density:g}"


def markdown(report: dict, figure: str | None) -> str:
    config = report["config"]
    out = [f"{WORLD_SIZE} simulated ranks, the small GPT (hvd_sparse/sim/gpt.py) on the standard "
           f"library's tree, AdamW (lr {RECIPE['lr']:g}, weight decay {RECIPE['weight_decay']:g}), "
           f"batch {RECIPE['batch_size']} windows of 32 tokens a rank, {config['steps']} steps, seed "
           f"{RECIPE['seed']}. Held-out perplexity over 16 k validation tokens at the last step; the "
           "Adam path: docs/methods.md#adam-and-adamw. Bytes: the payload a rank puts into collectives "
           "over the whole run, dense steps and refreshes included, against a dense allreduce's (the JSON "
           f"also has each run's training loss, the mean of its last {TRAIN_TAIL} steps, and its bytes on "
           "the wire).", ""]
    dense = report["runs"].get(run_key("dense", 1.0))
    if dense:
        out += [f"Dense AdamW: held-out perplexity {dense['perplexity']:.2f} (loss "
                f"{dense['heldout_loss']:.3f}), training loss {dense['train_loss']:.3f}. Each cell: held-out "
                "perplexity (x dense; the share of the plain run's gap in held-out loss closed; the run's "
                "bytes against dense's). Own v: the Adam path as it defaults; shared v: with "
                f"`second_moment_refresh={SHARED_V_EVERY}`.", ""]
    out += ["| method | ρ | plain | on the path (own v) | on the path (shared v) |", "|---|---|---|---|---|"]
    paths = {suffix: {(r["method"], r["density"]): r for r in rows(report, suffix)}
             for suffix in ("+adam", SHARED_V)}
    for density in report["config"]["densities"]:
        for name in report["config"]["methods"]:
            plain = report["runs"].get(run_key(name, density))
            cells = [path_cell(paths[suffix].get((name, density))) for suffix in ("+adam", SHARED_V)]
            if plain or any(cell != "-" for cell in cells):
                shown = f"{plain['perplexity']:.2f}" if plain else "-"
                out.append(f"| {name} | {density:g} | {shown} | " + " | ".join(cells) + " |")
    out += seeds_table(report)
    if config["steps"] >= LONG["steps"]:
        out += ["", "Lowest held-out perplexity during the run (a long run can overfit the corpus): "
                + "; ".join(f"{key.split('/')[0]} {min(p for _, p in run['curve']):.2f} (step "
                            f"{min(run['curve'], key=lambda point: point[1])[0]})"
                            for key, run in report["runs"].items()) + "."]
    judged = targets(report)
    moonshot = (f"within {LONG_MOONSHOT:.0%} of dense's perplexity after {config['steps']:,} steps"
                if config["steps"] >= LONG["steps"] else "within 5% of dense's perplexity at ρ = 0.01, "
                "15% at 0.001")
    for kind, test in (("Required (half the gap closed with at most 20% of dense's bytes)",
                        lambda t: not t["target"].startswith("moonshot")),
                       (f"Moonshot ({moonshot})", lambda t: t["target"].startswith("moonshot"))):
        met = [t["label"] for t in judged if test(t) and t["met"]]
        missed = [t["label"] for t in judged if test(t) and not t["met"]]
        if not met and not missed:
            continue
        out += ["", f"{kind}, seed methods: met by {', '.join(met) or 'none'}; not met by "
                f"{', '.join(missed) or 'none'}."]
    if figure:
        out += ["", f"![held-out perplexity over training]({Path(figure).name})"]
    return "\n".join(out) + "\n"


def seeds_table(report: dict) -> list[str]:
    """The runs at more than one seed (``seed_rows``): per seed, held-out perplexity plain → on
    the path (dense at that seed; the share of the gap closed), and the share on the mean loss."""
    judged = seed_rows(report)
    if not judged:
        return []
    seeds = sorted({seed for row in judged for seed in row["seeds"]})
    out = ["", "At more seeds (model and data seeded alike, the same recipe; judged beside seed 0 on the "
           "held-out loss averaged over the seeds). Each cell: held-out perplexity plain → on the path "
           "(dense's at that seed; the share of the gap closed).", "",
           "| method | ρ | path | " + " | ".join(f"seed {s}" for s in seeds) + " | on the mean loss |",
           "|---|---|---|" + "---|" * (len(seeds) + 1)]
    for row in judged:
        cells = []
        for seed in seeds:
            if seed not in row["seeds"]:
                cells.append("-")
                continue
            plain, path, dense = row["runs"][seed]
            cells.append(f"{plain['perplexity']:.2f} → {path['perplexity']:.2f} ({dense['perplexity']:.2f}; "
                         f"{row['per_seed'][seed]:.0%})")
        kind = "shared v" if row["suffix"] == SHARED_V else "own v"
        out.append(f"| {row['method']} | {row['density']:g} | {kind} | " + " | ".join(cells)
                   + f" | {row['closed']:.0%} |")
    return out


def path_cell(row: dict | None) -> str:
    if row is None:
        return "-"
    closed = f"{row['closed']:.0%}" if "closed" in row else "no plain run"
    return f"{row['path']['perplexity']:.2f} ({row['ppl_ratio']:.3f}x; {closed}; {row['bytes']:.1%})"


def plot(report: dict, path: Path) -> str | None:
    plt = pyplot()
    if plt is None or not report["runs"]:
        return None
    densities = report["config"]["densities"]
    figure, axes = plt.subplots(1, len(densities), figsize=(6 * len(densities), 4), squeeze=False)
    dense = report["runs"].get(run_key("dense", 1.0))
    for axis, density in zip(axes[0], densities, strict=True):
        if dense:
            axis.plot(*zip(*dense["curve"], strict=True), color="black", label="dense")
        for name in report["config"]["methods"]:
            for suffix, style in (("", ":"), ("+adam", "-"), (SHARED_V, "--")):
                run = report["runs"].get(run_key(name + suffix, density))
                if run:
                    axis.plot(*zip(*run["curve"], strict=True), style, label=name + suffix)
        axis.set(title=f"ρ = {density:g}", xlabel="step", ylabel="held-out perplexity", yscale="log")
        axis.legend(fontsize=7, ncol=2)
    return save(figure, path)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    folder = output_dir(args.out_dir, args.quick)
    out_json = folder / "adam-quality.json"
    report = run_all(args, out_json)
    report["targets"] = targets(report)
    out_json.write_text(json.dumps(report))
    figure = plot(report, folder / "adam-quality.png")
    (folder / "adam-quality.md").write_text(markdown(report, figure))
    print((folder / "adam-quality.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
