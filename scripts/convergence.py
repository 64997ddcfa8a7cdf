"""Convergence: dense and every sparsifier after a fixed budget, on 4 simulated ranks.

Every run uses the N-rank simulator (hvd_sparse.sim: the engine and the methods' own code over
the lockstep local group, each rank its own minibatches) with the same seeds, the same data order,
the same optimizer and the same learning-rate schedule; only the method changes:

* digits CNN (scikit-learn's load_digits, 38k parameters): test accuracy after the budget;
* character-level LSTM (pydoc_data topics, 99k parameters): held-out perplexity after the budget;

at densities 0.01 and 0.001. Each method runs with its defaults (ExDyna both in paper mode and
with ``threshold_scaling="tracking"``; DGC without optimizer momentum, its own momentum correction being
inside the compressor, as its documentation says), and the seed methods, top-k and DGC once more
"with corrections" (``+corr``: the engine's momentum correction, warm-up and the rest,
hvd_sparse/algorithms/corrections.py, in the recipe ``RECIPE``), ExDyna tracking also with each
correction alone (``+momentum``, ``+warmup``, ``+dense-steps``, ``+dense-below``). A run with the
momentum correction uses an optimizer without momentum (the momentum is in the update); every
other run keeps the task's recipe. ``dgc-matched`` is DGC at ρ/N, whose build-up brings its
aggregate density to about the exclusive methods' ρ.

Equal aggregate density: a configuration named ``<name>@<s>x`` runs ``<name>`` at ρ × s (not in
the default matrix). Each configuration's runs at every density (both ρ, every scale) make one
curve of quality against aggregate density; the report interpolates every curve at every run's
aggregate density (linear in its log, never beyond the measured range) and judges ExDyna tracking
with corrections (the momentum correction alone, and the recipe) against the best DGC curve
(plain, and with the recipe) at the same aggregate density:

    OMP_NUM_THREADS=1 python scripts/convergence.py --resume --tasks lstm --densities 0.001 \
        --methods exdyna-tracking+corr@2x exdyna-tracking+corr@4x exdyna-tracking+momentum@4x \
        dgc@0.125x

Besides quality the runs record the achieved density, the build-up, ExDyna's padding waste
(imbalance = N·max count / union − 1) and what a step exchanges: the aggregate density (union /
entries, over every step of the run, warm-up and dense steps included) and the bytes each rank
puts on the wire and takes off it, counted at the simulator's collectives on the ring algorithms
(``wire_bytes``: an allgather's forwarded blocks and both halves of an allreduce included), next
to the engine's own payload counters (``bytes_sent``/``bytes_received``: what a rank contributes
to and gets out of a collective).

Full run (a few hours on 2 shared cores; writes bench/convergence.{json,png,md},
bench/convergence_exdyna.png, bench/convergence_exchange.png and
bench/convergence_equal_density.png):

    OMP_NUM_THREADS=1 python scripts/convergence.py

Quick run (a few minutes, fewer steps, one seed, no single levers; writes under bench/quick/):

    OMP_NUM_THREADS=1 python scripts/convergence.py --quick

Long run (char-LSTM, dense and ExDyna tracking with corrections at ρ = 0.001 for 10,000 steps;
writes under bench/convergence-10k/):

    OMP_NUM_THREADS=1 python scripts/convergence.py --long

``--resume`` skips the runs already in the output JSON (one run is saved as soon as it ends;
with ``--remeasure`` it runs again those saved before the exchange was measured);
``--methods exdyna dense`` / ``--tasks lstm`` / ``--densities 0.01`` select.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import platform
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from unittest import mock

import numpy as np
import torch
from results import output_dir, pyplot, save

import hvd_sparse.sim as sim_module
from hvd_sparse.algorithms.corrections import RECOMMENDED
from hvd_sparse.comm.local import LocalGroup
from hvd_sparse.comm.protocol import ALLGATHER, ALLREDUCE, BROADCAST, NEIGHBOURS
from hvd_sparse.engine.patterns import ITEMSIZE
from hvd_sparse.engine.planning import plan_buckets
from hvd_sparse.sim import simulate

WORLD_SIZE = 4


@dataclass(frozen=True)
class Config:
    """One configuration of the runs: a method, its options and how it is trained."""

    method: str
    options: dict = field(default_factory=dict)
    momentum: float | None = None   # the optimizer's momentum; None: the task's
    density_scale: float = 1.0      # runs at ρ × this (the table keeps ρ)
    base: str | None = None         # the plain configuration a corrected one is compared with
    quick: bool = True              # part of --quick


TRACKING = {"threshold_scaling": "tracking"}
# The corrections recommended for every method, chosen with ExDyna tracking on the char-LSTM (2000
# steps) and the digits CNN (1000 steps, 3 seeds) at ρ = 0.001: the momentum correction in
# Nesterov's form (the optimizer then runs without momentum), a warm-up of 200 steps from dense
# to ρ, and tensors under 1024 entries (biases, the digits CNN's first convolution and last layer)
# averaged densely. Without the dense small tensors a warm-up left 1 of 3 digits seeds at chance
# (the same with a 50-step warm-up); the warm-up is what the char-LSTM gains most from. All three
# cost exchange: see the quality-against-exchange table, which shows each lever's price.
RECIPE = dict(RECOMMENDED)
# Each correction alone, on ExDyna tracking (the recipe's value; dense_steps is not in it).
LEVERS = {
    "momentum": {"momentum": 0.9, "nesterov": True},
    "warmup": {"warmup_steps": 200},
    "dense-steps": {"dense_steps": 100},
    "dense-below": {"dense_below": 1024},
}
SEED_METHODS = ("exdyna-tracking", "micro", "deft", "lags")
CORRECTED = (*SEED_METHODS, "topk", "dgc", "dgc-matched")

METHODS: dict[str, Config] = {
    "dense": Config("dense"),
    "exdyna": Config("exdyna"),
    "exdyna-tracking": Config("exdyna", TRACKING),
    "exdyna-tracking-histogram": Config("exdyna", {**TRACKING, "rebalance": "histogram"}),
    "micro": Config("micro"),
    "deft": Config("deft"),
    "lags": Config("lags"),
    "topk": Config("topk"),
    "randomk": Config("randomk"),
    "threshold": Config("threshold"),
    "gaussiank": Config("gaussiank"),
    "dgc": Config("dgc", momentum=0.0),
    "dgc-matched": Config("dgc", momentum=0.0, density_scale=1.0 / WORLD_SIZE),
}


def with_corrections(plain: str, corrections: dict, quick: bool = True) -> Config:
    """``plain`` with ``corrections`` added; no optimizer momentum under the momentum correction."""
    config = METHODS[plain]
    momentum = 0.0 if corrections.get("momentum") else config.momentum
    return Config(config.method, {**config.options, **corrections}, momentum, config.density_scale,
                  base=plain, quick=quick)


METHODS.update({f"{name}+corr": with_corrections(name, RECIPE) for name in CORRECTED})
METHODS.update({f"exdyna-tracking+{lever}": with_corrections("exdyna-tracking", options, quick=False)
                for lever, options in LEVERS.items()})

# More points on the curves of quality against aggregate density (the equal-density comparison of
# ExDyna tracking and DGC): a configuration at ρ × the scale after "@" (the table keeps ρ). Not in
# the default matrix: run them with --methods (char-LSTM, ρ = 0.001).
SCALED = {"exdyna-tracking+corr@2x": 2.0, "exdyna-tracking+corr@4x": 4.0,
          "exdyna-tracking+momentum@4x": 4.0, "dgc@0.125x": 0.125}
METHODS.update({name: replace(METHODS[name.split("@")[0]], quick=False,
                              density_scale=METHODS[name.split("@")[0]].density_scale * scale)
                for name, scale in SCALED.items()})
DEFAULT_METHODS = [m for m in METHODS if m not in SCALED]

# The training recipe of each task (identical for every method): SGD with momentum 0.9 on the
# averaged gradient, cosine decay of the learning rate to 0 over the budget.
TASKS = {
    "digits": {"metric": "accuracy", "lr": 0.1, "momentum": 0.9, "clip_norm": None, "batch_size": 16,
               "steps": 1000, "quick_steps": 300, "evaluate_every": 50, "seeds": 3},
    "lstm": {"metric": "perplexity", "lr": 2.0, "momentum": 0.9, "clip_norm": 1.0, "batch_size": 16,
             "steps": 2000, "quick_steps": 200, "evaluate_every": 250, "seeds": 1},
}
DENSITIES = (0.01, 0.001)
WARMUP_SHARE = 0.1   # statistics leave out the first 10% of steps (controllers settling)
# --long: the longer budget on the char-LSTM.
LONG = {"tasks": ["lstm"], "methods": ["dense", "exdyna-tracking+corr"], "densities": [0.001],
        "steps": 10_000, "out_dir": Path("bench/convergence-10k")}
# The targets on these runs.
ACCURACY_POINTS = 1.0          # digits: within 1 point of dense at ρ = 0.01 (and, corrected, 0.001)
PERPLEXITY_SHARE = 0.05        # LSTM: within 5% of dense at ρ = 0.01 (and after LONG's budget)
MOONSHOT_SHARE = 0.15          # LSTM ρ = 0.001, ExDyna tracking with corrections: within 15%
# Equal aggregate density: each curve of quality against aggregate density is every run of one
# configuration whatever its density (ρ × the configuration's scale, at every ρ: dgc, dgc-matched
# and dgc@0.125x are one curve); ExDyna tracking with the momentum correction alone and with the
# recipe, against DGC plain (its own momentum correction) and with the recipe.
CURVES = {"ExDyna tracking +momentum": "exdyna-tracking+momentum",
          "ExDyna tracking +corr": "exdyna-tracking+corr", "DGC": "dgc", "DGC +corr": "dgc+corr"}
RIVALS = ("DGC", "DGC +corr")
GAP_CLOSED = 0.20              # DEFT, LAGS: corrections close 20% of the gap to dense
PADDING_WASTE = 0.10           # ExDyna: imbalance ≤ 10% of the union
DENSITY_SHARE = 0.05           # ExDyna tracking: achieved density within 5% of target


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="short runs, one seed (make bench)")
    parser.add_argument("--long", action="store_true",
                        help=f"char-LSTM, {', '.join(LONG['methods'])} at ρ = 0.001 for "
                             f"{LONG['steps']} steps, into {LONG['out_dir']}")
    parser.add_argument("--out-dir", type=Path, default=None, help="default: bench, or bench/quick")
    parser.add_argument("--tasks", nargs="+", choices=sorted(TASKS), default=None)
    parser.add_argument("--methods", nargs="+", choices=list(METHODS), default=None)
    parser.add_argument("--densities", nargs="+", type=float, default=None)
    parser.add_argument("--seeds", type=int, default=None, help="seeds per configuration")
    parser.add_argument("--steps", type=int, default=None, help="override every task's budget")
    parser.add_argument("--lr", type=float, default=None, help="override every task's learning rate")
    parser.add_argument("--resume", action="store_true", help="keep runs already in the JSON")
    parser.add_argument("--remeasure", action="store_true",
                        help="with --resume: run again the runs saved without the exchange's bytes")
    args = parser.parse_args(argv)
    if args.quick and args.long:
        parser.error("--quick and --long exclude each other")
    if args.long:
        args.tasks = args.tasks or LONG["tasks"]
        args.methods = args.methods or LONG["methods"]
        args.densities = args.densities or LONG["densities"]
        args.steps = args.steps or LONG["steps"]
        args.out_dir = args.out_dir or LONG["out_dir"]
    args.tasks = args.tasks or sorted(TASKS)
    args.methods = args.methods or [m for m in DEFAULT_METHODS if METHODS[m].quick or not args.quick]
    args.densities = args.densities or list(DENSITIES)
    return args


def run_key(task: str, method: str, density: float, seed: int) -> str:
    return f"{task}/{method}/{density:g}/{seed}"


# --- what a step exchanges --------------------------------------------------------------------------
def wire_bytes(op: str, sizes: list[float], root: int = 0) -> tuple[list[float], list[float]]:
    """Bytes each rank sends and receives in one collective whose input on rank r is
    ``sizes[r]`` bytes, on the ring algorithms of NCCL, Gloo and MPI's large messages:

    * allgather: rank r receives every other rank's block and forwards all but the block of
      rank r+1 (which ends its journey there): sent Σ − b[r+1], received Σ − b[r];
    * allreduce of M bytes: reduce-scatter then allgather, 2(N−1)/N·M sent and received;
    * broadcast of M bytes along the ring from the root: every rank but the root receives M,
      every rank but the last one (root − 1) sends M;
    * neighbours: a rank's tensor to r−1 and r+1, theirs back.
    """
    n = len(sizes)
    if n == 1:
        return [0.0], [0.0]
    if op == ALLGATHER:
        total = float(sum(sizes))
        return [total - sizes[(r + 1) % n] for r in range(n)], [total - sizes[r] for r in range(n)]
    if op == ALLREDUCE:
        moved = [2.0 * (n - 1) / n * size for size in sizes]
        return moved, list(moved)
    if op == BROADCAST:
        size = float(sizes[root])
        return ([0.0 if r == (root - 1) % n else size for r in range(n)],
                [0.0 if r == root else size for r in range(n)])
    if op == NEIGHBOURS:
        return [2.0 * size for size in sizes], [float(sizes[(r - 1) % n] + sizes[(r + 1) % n])
                                                 for r in range(n)]
    raise ValueError(f"unknown collective op {op!r}")


class WireGroup(LocalGroup):
    """The simulator's lockstep group, counting on the way what every collective puts on the wire
    (``wire_bytes``) per rank, until ``take`` hands the totals over and starts again."""

    def __init__(self, size: int, backend):
        super().__init__(size, backend)
        self.collectives = 0
        self._sent = [0.0] * size
        self._received = [0.0] * size

    def _collective(self, first, tensors: list) -> list:
        b = self.backend
        sizes = [b.numel(t) * ITEMSIZE[b.dtype_name(t)] for t in tensors]
        sent, received = wire_bytes(first.op, sizes, first.root)
        self.collectives += 1
        self._sent = [a + x for a, x in zip(self._sent, sent, strict=True)]
        self._received = [a + x for a, x in zip(self._received, received, strict=True)]
        return super()._collective(first, tensors)

    def take(self) -> tuple[list[float], list[float]]:
        taken = self._sent, self._received
        self._sent, self._received = [0.0] * self.size, [0.0] * self.size
        return taken


def simulate_counted(method: str, world_size: int, steps: int, **kwargs) -> list[dict]:
    """``simulate``, with each record's ``wire_sent`` and ``wire_received`` (per rank: bytes on
    the wire during the step) counted by a ``WireGroup`` in place of the simulator's group."""
    groups: list[WireGroup] = []

    def make_group(size: int, backend) -> WireGroup:
        groups.append(WireGroup(size, backend))
        return groups[-1]

    def on_record(record: dict) -> None:
        record["wire_sent"], record["wire_received"] = groups[-1].take()

    with mock.patch.object(sim_module, "LocalGroup", make_group):
        records = simulate(method, world_size, steps, on_record=on_record, **kwargs)
    if not groups or (world_size > 1 and not groups[-1].collectives):
        raise RuntimeError("hvd_sparse.sim no longer builds its group as hvd_sparse.sim.LocalGroup: "
                           "the bytes on the wire were not counted (update simulate_counted)")
    return records


def exchange_figures(records: list[dict]) -> dict:
    """What the run exchanged per step, averaged over every step (warm-up and dense steps
    included: they are part of the run's cost) and over ranks; ``wire_busiest``: the rank that
    moved the most, sent + received."""
    def per_step(field: str) -> np.ndarray:
        return np.array([r[field] for r in records], dtype=float)   # steps × ranks

    out = {"aggregate_density": float(np.mean([r["density_actual"] for r in records])),
           "aggregate_density_steady": float(np.mean([r["density_actual"]
                                                      for r in records[len(records) // 2:]])),
           "payload_sent": float(per_step("bytes_sent").mean()),
           "payload_received": float(per_step("bytes_received").mean())}
    if all("wire_sent" in r for r in records):
        sent, received = per_step("wire_sent"), per_step("wire_received")
        out.update({"wire_sent": float(sent.mean()), "wire_received": float(received.mean()),
                    "wire_busiest": float((sent + received).mean(axis=0).max())})
    return out


@functools.cache
def model_entries(task: str, dense_below: int = 0) -> tuple[int, int]:
    """Entries of the task's model, and those in tensors under ``dense_below`` entries (the
    ones ``dense_below`` averages densely)."""
    sizes = [p.numel() for p in sim_module.TASKS[task]().model.parameters() if p.requires_grad]
    return sum(sizes), sum(n for n in sizes if n < dense_below)


def sparse_part(record: dict, total: int, dense: int) -> dict:
    """A step's density/target, build-up and imbalance over the sparse part of the model: with
    ``dense_below`` the union, k and every rank's count also hold the ``dense`` entries of the
    small tensors (the same on every rank), which would hide the sparse part's figures. The
    aggregate density (what the step costs) keeps them."""
    counts = [c - dense for c in record["counts"]]
    selected = sum(counts)
    union = record["union"] - dense
    return {"ratio": union / (record["density_target"] * (total - dense)),
            "buildup": union / max(record["k"] - dense, 1),
            "imbalance": len(counts) * max(counts) / selected - 1.0 if selected > 0 else 0.0}


def condense(records: list[dict], task: str, method: str, density: float, seed: int,
             seconds: float) -> dict:
    """What the report keeps of one run: curves and the statistics the targets are about (with
    ``dense_below``, density/target, build-up and imbalance of the sparse part: ``sparse_part``)."""
    spec = TASKS[task]
    steps = len(records)
    dense_below = METHODS[method].options.get("dense_below", 0) if method in METHODS else 0
    if dense_below:
        total, dense = model_entries(task, dense_below)
        records = [dict(r, **sparse_part(r, total, dense)) for r in records]
    else:
        records = [dict(r, ratio=r["density_actual"] / r["density_target"]) for r in records]
    body = records[int(WARMUP_SHARE * steps):]
    ratio = np.array([r["ratio"] for r in body])
    imbalance = np.array([r["imbalance"] for r in body])
    metric = spec["metric"]
    curve = [[r["step"] + 1, r[metric]] for r in records if metric in r]
    every = max(1, steps // 200)
    return {
        "task": task, "method": method, "density": density, "seed": seed, "steps": steps,
        "metric": metric, "final": curve[-1][1], "curve": curve,
        "loss": [[r["step"] + 1, round(float(np.mean([q["loss"] for q in records[i:i + every]])), 5)]
                 for i, r in enumerate(records) if i % every == 0],
        "density_ratio": [round(r["ratio"], 5) for r in records],
        "imbalance": [round(r["imbalance"], 5) for r in records],
        "density_ratio_mean": float(ratio.mean()),
        "density_ratio_all_steps": float(np.mean([r["ratio"] for r in records])),
        "buildup_mean": float(np.mean([r["buildup"] for r in body])),
        "imbalance_mean": float(imbalance.mean()),
        "imbalance_p90": float(np.quantile(imbalance, 0.9)),
        "bytes_sent_mean": float(np.mean([np.mean(r["bytes_sent"]) for r in body])),
        **exchange_figures(records),
        "dense_entries": model_entries(task, dense_below)[1] if dense_below else 0,
        "seconds": seconds,
    }


def config_of(name: str) -> dict:
    return {**asdict(METHODS[name]), "options": dict(METHODS[name].options)}


def run_all(args: argparse.Namespace, out_json: Path) -> dict:
    report = {"runs": {}}
    if args.resume and out_json.exists():
        report = json.loads(out_json.read_text())
    report["config"] = {
        "world_size": WORLD_SIZE, "quick": args.quick,
        "tasks": {t: dict(TASKS[t], lr=args.lr or TASKS[t]["lr"]) for t in TASKS},
        "methods": {m: config_of(m) for m in METHODS},
        "recipe": RECIPE, "levers": LEVERS,
        "densities": args.densities, "warmup_share": WARMUP_SHARE,
        "python": platform.python_version(), "torch": torch.__version__,
    }
    for task in args.tasks:
        spec = report["config"]["tasks"][task]
        steps = args.steps or (spec["quick_steps"] if args.quick else spec["steps"])
        seeds = args.seeds or (1 if args.quick else spec["seeds"])
        for density in args.densities:
            for name in args.methods:
                if name == "dense" and density != args.densities[0]:
                    continue   # one dense baseline per task
                config = METHODS[name]
                for seed in range(seeds):
                    key = run_key(task, name, 1.0 if name == "dense" else density, seed)
                    kept = report["runs"].get(key)
                    if kept and kept["steps"] == steps and not (args.remeasure and "wire_sent" not in kept):
                        continue
                    started = time.perf_counter()
                    records = simulate_counted(
                        config.method, WORLD_SIZE, steps, density=density * config.density_scale,
                        task=task, options=config.options, batch_size=spec["batch_size"], lr=spec["lr"],
                        momentum=spec["momentum"] if config.momentum is None else config.momentum,
                        clip_norm=spec["clip_norm"], schedule="cosine", seed=seed,
                        evaluate_every=spec["evaluate_every"])
                    seconds = time.perf_counter() - started
                    run = condense(records, task, name, 1.0 if name == "dense" else density, seed, seconds)
                    report["runs"][key] = run
                    print(f"{key:<40} {run['metric']} {run['final']:.4f}  density/target "
                          f"{run['density_ratio_mean']:.3f}  buildup {run['buildup_mean']:.2f}  "
                          f"imbalance {run['imbalance_mean']:.3f}  aggregate density "
                          f"{run['aggregate_density']:.5f}  wire {run['wire_sent']:.0f}/"
                          f"{run['wire_received']:.0f} B  {seconds:.0f}s", flush=True)
                    out_json.write_text(json.dumps(report))
    return report


# --- the report -------------------------------------------------------------------------------------
def group_runs(report: dict) -> dict:
    """(task, method, density) -> the runs over seeds."""
    groups: dict = {}
    for run in report["runs"].values():
        groups.setdefault((run["task"], run["method"], run["density"]), []).append(run)
    return groups


def methods_present(groups: dict) -> list[str]:
    return [m for m in METHODS if any(key[1] == m for key in groups)]


def mean_of(runs: list[dict], field: str) -> float:
    return float(np.mean([r[field] for r in runs]))


def judge(report: dict) -> list[dict]:
    """The issue's targets on these runs, each met or not, with the numbers."""
    groups = group_runs(report)
    targets = []
    for task, share in (("digits", None), ("lstm", PERPLEXITY_SHARE)):
        dense = groups.get((task, "dense", 1.0))
        if not dense:
            continue
        base = mean_of(dense, "final")
        for method in ("exdyna", "exdyna-tracking", "exdyna-tracking-histogram", "exdyna-tracking+corr"):
            runs = groups.get((task, method, 0.01))
            if not runs:
                continue
            value = mean_of(runs, "final")
            if share is None:   # being better than dense also meets "within"
                delta = 100.0 * (value - base)
                met = delta >= -ACCURACY_POINTS
                text = f"accuracy {100 * value:.2f}% vs dense {100 * base:.2f}% ({delta:+.2f} points)"
                target = (f"digits accuracy within {ACCURACY_POINTS:g} point of dense at ρ=0.01 after "
                          f"{runs[0]['steps']} steps")
            else:
                delta = value / base - 1.0
                met = delta <= share
                text = f"perplexity {value:.3f} vs dense {base:.3f} ({100 * delta:+.1f}%)"
                target = (f"LSTM perplexity within {100 * share:g}% of dense at ρ=0.01 after "
                          f"{runs[0]['steps']} steps")
            targets.append({"target": target, "method": method, "met": bool(met), "measured": text})
    targets += judge_corrections(groups)
    targets += judge_equal_density(groups)
    for (task, method, density), runs in sorted(groups.items()):
        label = f"{method} ({task}, ρ={density:g}, {runs[0]['steps']} steps)"
        if method.startswith("exdyna"):
            waste = mean_of(runs, "imbalance_mean")
            targets.append({"target": f"ExDyna padding waste ≤ {100 * PADDING_WASTE:g}% of the union",
                            "method": label, "met": waste <= PADDING_WASTE,
                            "measured": f"mean imbalance {100 * waste:.1f}% (90th percentile "
                                        f"{100 * mean_of(runs, 'imbalance_p90'):.1f}%)"})
        if method.startswith("exdyna-tracking"):
            ratio = mean_of(runs, "density_ratio_mean")
            targets.append({"target": f"achieved density within {100 * DENSITY_SHARE:g}% of target "
                                      "(tracking)",
                            "method": label,
                            "met": abs(ratio - 1.0) <= DENSITY_SHARE,
                            "measured": f"mean achieved/target {ratio:.3f}"
                                        + (" (sparse part)" if runs[0].get("dense_entries") else "")})
    return targets


def exchanged(runs: list[dict]) -> str:
    """A configuration's aggregate density and bytes on the wire, for a target's figures."""
    if "aggregate_density" not in runs[0]:
        return "exchange not measured"
    text = f"aggregate density {mean_of(runs, 'aggregate_density'):.5f}"
    if "wire_sent" in runs[0]:
        text += (f", {mean_of(runs, 'wire_sent') + mean_of(runs, 'wire_received'):,.0f} B/rank/step sent + "
                 "received")
    return text


def judge_corrections(groups: dict) -> list[dict]:
    """The targets of the corrections (issue 18), at ρ = 0.001."""
    targets = []

    def final(task: str, method: str) -> tuple[float | None, list | None]:
        runs = groups.get((task, method, 1.0 if method == "dense" else 0.001))
        return (mean_of(runs, "final"), runs) if runs else (None, None)

    base, _ = final("lstm", "dense")
    ours, runs = final("lstm", "exdyna-tracking+corr")
    if ours is not None:
        steps = runs[0]["steps"]
        if base is not None:
            gap = ours / base - 1.0
            share = PERPLEXITY_SHARE if steps >= LONG["steps"] else MOONSHOT_SHARE
            targets.append({
                "target": f"LSTM perplexity within {100 * share:g}% of dense at ρ=0.001 after {steps} "
                          "steps, ExDyna tracking with corrections",
                "met": gap <= share,
                "measured": f"perplexity {ours:.3f} vs dense {base:.3f} ({100 * gap:+.1f}%)"})
    if base is not None:
        for method in ("deft", "lags"):
            plain, plain_runs = final("lstm", method)
            fixed, _ = final("lstm", f"{method}+corr")
            if plain is None or fixed is None:
                continue
            closed = (plain - fixed) / (plain - base) if plain != base else 0.0
            targets.append({
                "target": f"LSTM ρ=0.001 after {plain_runs[0]['steps']} steps: corrections close "
                          f"≥ {100 * GAP_CLOSED:g}% of the gap to dense",
                "method": method, "met": closed >= GAP_CLOSED,
                "measured": f"perplexity {plain:.3f} plain, {fixed:.3f} with corrections, dense "
                            f"{base:.3f}: {100 * closed:.0f}% of the gap closed"})
    base, _ = final("digits", "dense")
    for method in SEED_METHODS:
        value, runs = final("digits", f"{method}+corr")
        if base is None or value is None:
            continue
        delta = 100.0 * (value - base)
        targets.append({
            "target": f"digits accuracy within {ACCURACY_POINTS:g} point of dense at ρ=0.001 after "
                      f"{runs[0]['steps']} steps, every seed method with corrections",
            "method": method, "met": delta >= -ACCURACY_POINTS,
            "measured": f"accuracy {100 * value:.2f}% vs dense {100 * base:.2f}% ({delta:+.2f} points)"})
    return targets


# --- equal aggregate density ------------------------------------------------------------------------
def same_configuration(a: str, b: str) -> bool:
    """Whether two configurations differ at most in their density's scale."""
    x, y = METHODS[a], METHODS[b]
    return (x.method, x.options, x.momentum) == (y.method, y.options, y.momentum)


def curve_points(groups: dict, task: str, curve: str) -> list[dict]:
    """The runs of ``CURVES[curve]``'s configuration on ``task``, one point per configuration and
    ρ (seeds averaged), by aggregate density."""
    points = []
    for (t, method, density), runs in groups.items():
        if t != task or method not in METHODS or not same_configuration(method, CURVES[curve]):
            continue
        if "aggregate_density" not in runs[0]:
            continue
        points.append({"method": method, "rho": density, "density": density * METHODS[method].density_scale,
                       "x": mean_of(runs, "aggregate_density"), "y": mean_of(runs, "final"),
                       "steps": runs[0]["steps"]})
    return sorted(points, key=lambda p: p["x"])


def interpolate(points: list[dict], x: float) -> float | None:
    """The curve's quality at aggregate density ``x``: linear in log(aggregate density) between
    the two measured points around it (the quality itself interpolated linearly); None outside
    the measured range (no extrapolation)."""
    if not points or not points[0]["x"] <= x <= points[-1]["x"]:
        return None
    for left, right in itertools.pairwise(points):
        if left["x"] <= x <= right["x"]:
            if right["x"] == left["x"]:
                return min(left["y"], right["y"])
            share = (np.log(x) - np.log(left["x"])) / (np.log(right["x"]) - np.log(left["x"]))
            return float(left["y"] + share * (right["y"] - left["y"]))
    return points[0]["y"]   # a single point, at exactly x


def better(task: str, a: float, b: float) -> bool:
    """Whether quality ``a`` beats ``b`` (lower perplexity, higher accuracy)."""
    return a < b if TASKS[task]["metric"] == "perplexity" else a > b


def judge_equal_density(groups: dict) -> list[dict]:
    """Issue 18: ExDyna tracking with corrections against DGC at equal aggregate density (char-LSTM,
    ρ = 0.001): each ExDyna configuration's run at ρ = 0.001 against the best of DGC's curves
    interpolated at the same aggregate density."""
    targets = []
    rivals = {name: curve_points(groups, "lstm", name) for name in RIVALS}
    if not any(rivals.values()):   # no DGC run (e.g. --long): nothing to compare with
        return targets
    for name in CURVES:
        if name in RIVALS:
            continue
        for point in curve_points(groups, "lstm", name):
            if point["method"] != CURVES[name] or point["rho"] != 0.001:
                continue
            theirs = {rival: interpolate(points, point["x"]) for rival, points in rivals.items()}
            covered = {rival: y for rival, y in theirs.items() if y is not None}
            text = (f"perplexity {point['y']:.3f} at aggregate density {point['x']:.5f}; DGC there: "
                    + ", ".join(f"{rival} {y:.3f}" if y is not None else f"{rival} not measured that low"
                                f" (its lowest {rivals[rival][0]['x']:.5f})" if rivals[rival] else
                                f"{rival} not run" for rival, y in theirs.items()))
            best = min(covered.values()) if covered else None
            if best is not None:
                text += f" ({100 * (point['y'] / best - 1):+.1f}% against the best)"
            for other in CURVES:   # ExDyna's other configuration with corrections, at the same exchange
                if other in RIVALS or other == name:
                    continue
                value = interpolate(curve_points(groups, "lstm", other), point["x"])
                if value is not None:
                    text += f"; {other} at the same aggregate density: {value:.3f}"
            targets.append({
                "target": "ExDyna tracking with corrections beats DGC at equal aggregate density (LSTM, "
                          f"ρ=0.001, {point['steps']} steps; DGC's curves interpolated in log aggregate "
                          "density)",
                "method": name, "met": best is not None and point["y"] < best, "measured": text})
    return targets


def equal_density_table(groups: dict, task: str) -> list[str]:
    """Every point of every curve, with every curve's quality interpolated at its aggregate density
    (the measured one in bold; – outside a curve's measured range)."""
    curves = {name: curve_points(groups, task, name) for name in CURVES}
    curves = {name: points for name, points in curves.items() if points}
    if len(curves) < 2:
        return []
    accuracy = TASKS[task]["metric"] == "accuracy"

    def cell(value: float | None, own: bool = False) -> str:
        if value is None:
            return "–"
        text = f"{100 * value:.2f}%" if accuracy else f"{value:.3f}"
        return f"**{text}**" if own else text

    lines = ["| curve | run | density | aggregate density | " + " | ".join(curves) + " |",
             "|---|---|---|---|" + "---|" * len(curves)]
    rows = sorted(((p["x"], name, p) for name, points in curves.items() for p in points),
                  key=lambda row: row[0])
    for x, name, point in rows:
        values = [cell(point["y"], True) if other == name else cell(interpolate(curves[other], x))
                  for other in curves]
        lines.append(f"| {name} | {point['method']} ρ={point['rho']:g} | {point['density']:g} | {x:.5f} | "
                     + " | ".join(values) + " |")
    return lines


def fmt_bytes(value: float | None) -> str:
    return "–" if value is None else f"{value:,.0f}"


def exchange_table(report: dict, groups: dict, task: str, densities: list[float]) -> list[str]:
    """Quality against what a step exchanges: one row per configuration and density."""
    spec = report["config"]["tasks"][task]
    metric = spec["metric"]
    dense = groups.get((task, "dense", 1.0))
    base = mean_of(dense, "final") if dense else None
    base_wire = (mean_of(dense, "wire_sent") + mean_of(dense, "wire_received")
                 if dense and all("wire_sent" in r for r in dense) else None)
    lines = ["| configuration | ρ | " + metric + " | vs dense | aggregate density (run / 2nd half) | "
             "payload sent / received | wire sent / received | wire vs dense |",
             "|---|---|---|---|---|---|---|---|"]
    cells = [("dense", 1.0)] + [(m, d) for d in densities for m in methods_present(groups) if m != "dense"]
    for method, density in cells:
        runs = groups.get((task, method, density))
        if not runs:
            continue
        value = mean_of(runs, "final")
        if metric == "accuracy":
            quality = f"{100 * value:.2f}%"
            delta = f"{100 * (value - base):+.2f} pt" if base is not None else "–"
        else:
            quality = f"{value:.3f}"
            delta = f"{100 * (value / base - 1):+.1f}%" if base is not None else "–"
        if "aggregate_density" in runs[0]:
            density_cell = (f"{mean_of(runs, 'aggregate_density'):.5f} / "
                            f"{mean_of(runs, 'aggregate_density_steady'):.5f}")
            payload = (f"{fmt_bytes(mean_of(runs, 'payload_sent'))} / "
                       f"{fmt_bytes(mean_of(runs, 'payload_received'))}")
        else:
            density_cell, payload = "–", f"{fmt_bytes(mean_of(runs, 'bytes_sent_mean'))} / –"
        if all("wire_sent" in r for r in runs):
            sent, received = mean_of(runs, "wire_sent"), mean_of(runs, "wire_received")
            wire = f"{fmt_bytes(sent)} / {fmt_bytes(received)}"
            ratio = f"{(sent + received) / base_wire:.4f}" if base_wire else "–"
        else:
            wire, ratio = "not measured", "–"
        label = method if method == "dense" else f"{method}"
        lines.append(f"| {label} | {'–' if method == 'dense' else f'{density:g}'} | {quality} | {delta} | "
                     f"{density_cell} | {payload} | {wire} | {ratio} |")
    return lines


def markdown(report: dict, targets: list[dict], figures: list[str]) -> str:
    groups = group_runs(report)
    config = report["config"]
    densities = sorted({d for (_, m, d) in groups if m != "dense"}, reverse=True)
    tasks = [t for t in ("digits", "lstm") if any(k[0] == t for k in groups)]
    lines = [f"### Convergence ({'quick' if config['quick'] else 'full'} run, {WORLD_SIZE} simulated ranks)",
             ""]
    recipe = config.get("recipe")
    if recipe:
        levers = "; ".join(f"{name}: " + ", ".join(f"`{o}={v}`" for o, v in options.items())
                           for name, options in config.get("levers", {}).items())
        lines += [f"`+corr`: the corrections {', '.join(f'`{k}={v}`' for k, v in recipe.items())} "
                  "(hvd_sparse/algorithms/corrections.py); `exdyna-tracking+<lever>`: one of them alone "
                  f"({levers}). "
                  "Runs with the momentum correction, and DGC (whose own it is), use an optimizer "
                  "without momentum; every other run keeps the task's recipe, plain runs included. "
                  f"`dgc-matched`: DGC at ρ/{WORLD_SIZE}, whose build-up brings its aggregate density "
                  "to about ρ.", ""]
    for task in tasks:
        spec = config["tasks"][task]
        steps = next(r["steps"] for r in report["runs"].values() if r["task"] == task)
        seeds = len(groups.get((task, "dense", 1.0), [])) or 1
        metric = spec["metric"]
        title = "digits CNN: test accuracy" if task == "digits" else "char-LSTM: held-out perplexity"
        lines.append(f"**{title}** after {steps} steps (SGD lr {spec['lr']} cosine, momentum "
                     f"{spec['momentum']}"
                     f"{', clip ' + str(spec['clip_norm']) if spec['clip_norm'] else ''}, batch "
                     f"{spec['batch_size']} per rank; mean of {seeds} seed{'s' if seeds > 1 else ''}).")
        lines.append("")
        header = "| method | " + " | ".join(
            f"{metric} ρ={d:g} | vs dense | density/target | build-up | imbalance" for d in densities) + " |"
        lines += [header, "|---" * (1 + 5 * len(densities)) + "|"]
        dense = groups.get((task, "dense", 1.0))
        base = mean_of(dense, "final") if dense else None
        for method in methods_present(groups):
            if not any(k[0] == task and k[1] == method for k in groups):
                continue
            cells = [method]
            for d in densities:
                runs = groups.get((task, method, 1.0 if method == "dense" else d))
                if not runs:
                    cells += ["–"] * 5
                    continue
                value = mean_of(runs, "final")
                spread = np.std([r["final"] for r in runs]) if len(runs) > 1 else None
                if metric == "accuracy":
                    cell = f"{100 * value:.2f}%" + (f" ± {100 * spread:.2f}" if spread is not None else "")
                    delta = f"{100 * (value - base):+.2f} pt" if base is not None else "–"
                else:
                    cell = f"{value:.3f}" + (f" ± {spread:.3f}" if spread is not None else "")
                    delta = f"{100 * (value / base - 1):+.1f}%" if base is not None else "–"
                cells += [cell, delta, f"{mean_of(runs, 'density_ratio_mean'):.3f}",
                          f"{mean_of(runs, 'buildup_mean'):.2f}", f"{mean_of(runs, 'imbalance_mean'):.3f}"]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    lines += [f"density/target, build-up (union/k) and imbalance (N·max count/Σ counts − 1, the padding "
              f"waste of a padded index allgather) are means over the steps after the first "
              f"{100 * WARMUP_SHARE:g}%; with `dense_below` (`+corr`, `+dense-below`) they are taken "
              "over the sparse part of the model (the dense tensors' entries, on every rank, left out); "
              "the exchange table counts everything.", ""]
    lines += ["**Quality against what a step exchanges.** Per configuration: the aggregate density "
              "(distinct aggregated indices / entries) averaged over every step of the run (warm-up "
              "and dense steps included) and over its second half; bytes per rank per step, averaged "
              "over every step and rank: the payload the engine counts (`bytes_sent`/"
              "`bytes_received`: what a rank puts into and gets out of its collectives) and what goes "
              "over the wire on ring collectives (an allgather's forwarded blocks, both halves of an "
              "allreduce, broadcasts and every other collective of the step); the last column is the "
              "wire's sent + received relative to dense.", ""]
    for task in tasks:
        title = "digits CNN" if task == "digits" else "char-LSTM"
        lines += [f"*{title}*", "", *exchange_table(report, groups, task, densities), ""]
    lines += lags_note(groups)
    for task in tasks:
        table = equal_density_table(groups, task)
        if not table:
            continue
        title = "digits CNN (accuracy)" if task == "digits" else "char-LSTM (perplexity)"
        lines += [f"**Equal aggregate density, {title}.** One curve per configuration, through its runs "
                  "at every density it was run at (the density column: ρ × the configuration's scale; "
                  "`dgc-matched` is DGC at ρ/4, `@2x` twice ρ); each row is one run, the bold cell its "
                  "measured quality, the others every other curve interpolated at the same aggregate "
                  "density (linear in log aggregate density between the two runs around it; – outside "
                  "the range a curve was measured over). Means over seeds: the table above gives their "
                  "number (a spread where there are several).", "", *table, ""]
    lines += ["**Targets on these runs**", "", "| target | method | measured | met |", "|---|---|---|---|"]
    for t in targets:
        lines.append(f"| {t['target']} | {t.get('method', '')} | {t['measured']} | "
                     f"{'yes' if t['met'] else 'NO'} |")
    lines += [""] + [f"![{Path(f).stem}]({Path(f).name})" for f in figures] + [""]
    return "\n".join(lines)


def lags_note(groups: dict) -> list[str]:
    """Why ``lags+corr`` and ``topk+corr`` coincide, when they do (every run's quality and exchange
    equal; the bytes on the wire differ by under one per step): with ``dense_below`` every LAGS
    group holds a single tensor on these models."""
    pairs = [(key, groups.get((key[0], "topk+corr", key[2]))) for key in groups if key[1] == "lags+corr"]
    fields = ("final", "aggregate_density", "payload_sent", "payload_received")
    if not pairs or not all(topk and all(a.get(f) == b.get(f) for a, b in zip(groups[key], topk, strict=True)
                                         for f in fields) for key, topk in pairs):
        return []
    groups_of = {}
    for task in sorted({key[0] for key, _ in pairs}):
        named = [(name, p.numel()) for name, p in sim_module.TASKS[task]().model.named_parameters()
                 if p.requires_grad]
        lags = sim_module.make_algorithm("lags", 0.001, METHODS["lags+corr"].options)
        plan = plan_buckets(lags, [name for name, _ in named], [n for _, n in named])
        groups_of[task] = [members for key, members in plan if key != "dense_below"]
    single = all(len(members) == 1 for plans in groups_of.values() for members in plans)
    listed = "; ".join(f"{task}: " + ", ".join("+".join(members) for members in plans)
                       for task, plans in groups_of.items())
    same = ("`lags+corr` and `topk+corr` coincide exactly (quality, aggregate density and payload, "
            "every run; the bytes on the wire differ by under one per step)")
    if not single:
        return [f"{same}, although some LAGS groups hold several tensors ({listed}): unexpected.", ""]
    return [f"{same}: with `dense_below={METHODS['lags+corr'].options['dense_below']}` every tensor "
            f"left sparse is in a LAGS group of its own ({listed}; walking from the last tensor, a "
            "group closes once it holds 8192 entries, every sparse tensor but the first is larger, "
            "and the first is what is left), and a one-tensor LAGS group takes the same top-k "
            "(k = ⌊ρ·n⌋, at least 1) through the same allgather as TopK's per-tensor scope. "
            "Expected, not a bug; the plain runs differ because there the biases share groups "
            "with the weights.", ""]


def family(method: str) -> str:
    """The plain configuration a configuration belongs to (for colours)."""
    return method.split("@", 1)[0].split("+", 1)[0]


def style(method: str) -> str:
    method = method.split("@", 1)[0]
    return "--" if method == "dense" else "-" if "+" not in method else \
        "-." if method.endswith("+corr") else ":"


def plot(report: dict, out_dir: Path) -> list[str]:
    plt = pyplot()
    if plt is None:
        return []
    groups = group_runs(report)
    config = report["config"]
    tasks = [t for t in ("digits", "lstm") if any(k[0] == t for k in groups)]
    densities = sorted({d for (_, m, d) in groups if m != "dense"}, reverse=True)
    if not tasks or not densities:
        return []
    methods = methods_present(groups)
    families = list(dict.fromkeys(family(m) for m in methods))
    palette = {f: plt.cm.tab20(i / max(1, len(families))) for i, f in enumerate(families)}
    colors = {m: "black" if m == "dense" else palette[family(m)] for m in methods}
    fig, axes = plt.subplots(len(tasks), len(densities), figsize=(6 * len(densities), 4.2 * len(tasks)),
                             squeeze=False)
    for row, task in enumerate(tasks):
        for col, density in enumerate(densities):
            ax = axes[row][col]
            for method in methods:
                runs = groups.get((task, method, 1.0 if method == "dense" else density))
                if not runs:
                    continue
                steps = [s for s, _ in runs[0]["curve"]]
                values = np.mean([[v for _, v in r["curve"]] for r in runs], axis=0)
                if config["tasks"][task]["metric"] == "accuracy":
                    values = 100 * values
                ax.plot(steps, values, label=method, color=colors[method],
                        linewidth=2.2 if method in ("dense", "exdyna-tracking", "exdyna-tracking+corr")
                        else 1.1, linestyle=style(method))
            if config["tasks"][task]["metric"] == "accuracy":
                ax.set_ylabel("test accuracy (%)")
                ax.set_ylim(80, 100)
                ax.set_title(f"digits CNN, ρ = {density:g}, N = {WORLD_SIZE}")
            else:
                ax.set_ylabel("held-out perplexity")
                ax.set_yscale("log")
                ax.set_title(f"char-LSTM, ρ = {density:g}, N = {WORLD_SIZE}")
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=6, ncol=2)
    written = [save(fig, out_dir / "convergence.png")]

    exdyna = [(k, runs) for k, runs in sorted(groups.items())
              if k[1].startswith("exdyna") and (k[1].endswith(("+corr", "+momentum")) or "+" not in k[1])]
    if exdyna:
        fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
        for (task, method, density), runs in exdyna:
            label = f"{method}, {task}, ρ={density:g}"
            top.plot(np.arange(1, runs[0]["steps"] + 1), runs[0]["density_ratio"], label=label, linewidth=0.8)
            bottom.plot(np.arange(1, runs[0]["steps"] + 1), runs[0]["imbalance"], label=label, linewidth=0.8)
        top.axhspan(1 - DENSITY_SHARE, 1 + DENSITY_SHARE, color="green", alpha=0.15)
        top.set_yscale("log")
        top.set_ylabel("achieved / target density")
        top.set_title(f"ExDyna on the convergence runs (seed 0, N = {WORLD_SIZE})")
        bottom.axhline(PADDING_WASTE, color="green", linestyle="--", linewidth=1)
        bottom.set_ylabel("imbalance (padding waste / union)")
        bottom.set_xlabel("step")
        bottom.set_yscale("symlog", linthresh=0.1)
        bottom.set_ylim(bottom=0)
        for ax in (top, bottom):
            ax.grid(alpha=0.3)
        top.legend(fontsize=7, ncol=2)
        written.append(save(fig, out_dir / "convergence_exdyna.png"))
    written += plot_exchange(report, groups, tasks, out_dir, plt)
    written += plot_equal_density(report, groups, tasks, out_dir, plt)
    return written


ACCURACY_FLOOR = 85.0   # the exchange plot's lowest accuracy; runs below it sit on the axis


def plot_exchange(report: dict, groups: dict, tasks: list[str], out_dir: Path, plt) -> list[str]:
    """Quality against the bytes a rank moves per step (on the wire, sent + received): one point
    per configuration, one panel per task and density; circles plain, stars with corrections,
    triangles a single correction; the dashed line is dense."""
    measured = {k: runs for k, runs in groups.items() if all("wire_sent" in r for r in runs)}
    tasks = [t for t in tasks if any(k[0] == t for k in measured)]
    densities = sorted({d for (_, m, d) in measured if m != "dense"}, reverse=True)
    if not tasks or not densities:
        return []
    families = list(dict.fromkeys(family(m) for m in methods_present(measured) if m != "dense"))
    palette = {f: plt.cm.tab10(i % 10) for i, f in enumerate(families)}
    fig, axes = plt.subplots(len(tasks), len(densities), figsize=(7 * len(densities), 4.8 * len(tasks)),
                             squeeze=False)
    for row, task in enumerate(tasks):
        accuracy = report["config"]["tasks"][task]["metric"] == "accuracy"
        scale = 100 if accuracy else 1
        dense = measured.get((task, "dense", 1.0))
        for col, density in enumerate(densities):
            ax = axes[row][col]
            if dense:
                x = mean_of(dense, "wire_sent") + mean_of(dense, "wire_received")
                y = mean_of(dense, "final") * scale
                ax.axhline(y, color="black", linestyle="--", linewidth=1)
                ax.plot([x], [y], marker="D", color="black", linestyle="none", label="dense")
            for method in methods_present(measured):
                runs = measured.get((task, method, density))
                if method == "dense" or not runs:
                    continue
                x = mean_of(runs, "wire_sent") + mean_of(runs, "wire_received")
                y = mean_of(runs, "final") * scale
                marker = "o" if "+" not in method else "*" if method.endswith("+corr") else "^"
                label = method if method.startswith(("exdyna-tracking", "dgc-matched")) else None
                if accuracy and y < ACCURACY_FLOOR:   # off the axis: at its bottom, with the value
                    marker, label, y = "v", f"{method} {y:.1f}%", ACCURACY_FLOOR + 0.3
                ax.plot([x], [y], marker=marker, markersize=12 if marker == "*" else 7, linestyle="none",
                        color=palette[family(method)])
                if label:
                    ax.annotate(label, (x, y), fontsize=6, xytext=(4, 3), textcoords="offset points")
            for fam, color in palette.items():
                ax.plot([], [], marker="s", linestyle="none", color=color, label=fam)
            ax.set_xscale("log")
            if accuracy:
                ax.set_ylabel("test accuracy (%)")
                ax.set_ylim(ACCURACY_FLOOR, 100)
            else:
                ax.set_ylabel("held-out perplexity")
                ax.set_yscale("log")
                for axis in (ax.yaxis.set_major_formatter, ax.yaxis.set_minor_formatter):
                    axis(plt.FuncFormatter(lambda value, _: f"{value:g}"))
            title = "digits CNN" if accuracy else "char-LSTM"
            ax.set_title(f"{title}, ρ = {density:g}, N = {WORLD_SIZE}: quality against exchange")
            ax.set_xlabel("bytes per rank per step on the wire, sent + received (ring collectives)")
            ax.grid(alpha=0.3, which="both")
            ax.legend(fontsize=6, ncol=2, title="○ plain  ★ +corr  △ one correction", title_fontsize=6)
    return [save(fig, out_dir / "convergence_exchange.png")]


def plot_equal_density(report: dict, groups: dict, tasks: list[str], out_dir: Path, plt) -> list[str]:
    """Quality against aggregate density, one line per curve of ``CURVES`` through its runs (the
    equal-density comparison); the dashed line is dense."""
    panels = [(task, {name: curve_points(groups, task, name) for name in CURVES}) for task in tasks]
    panels = [(task, curves) for task, curves in panels if sum(len(p) >= 2 for p in curves.values()) >= 2]
    if not panels:
        return []
    fig, axes = plt.subplots(1, len(panels), figsize=(7 * len(panels), 4.8), squeeze=False)
    for ax, (task, curves) in zip(axes[0], panels, strict=True):
        accuracy = report["config"]["tasks"][task]["metric"] == "accuracy"
        scale = 100 if accuracy else 1
        dense = groups.get((task, "dense", 1.0))
        if dense:
            ax.axhline(mean_of(dense, "final") * scale, color="black", linestyle="--", linewidth=1,
                       label="dense")
        for i, (name, points) in enumerate(curves.items()):
            if not points:
                continue
            ax.plot([p["x"] for p in points], [p["y"] * scale for p in points], marker="o*^s"[i % 4],
                    markersize=8, linestyle="-" if name in RIVALS else "-.", color=plt.cm.tab10(i),
                    label=name)
            for p in points:
                ax.annotate(f"{p['density']:g}", (p["x"], p["y"] * scale), fontsize=6, xytext=(3, 3),
                            textcoords="offset points")
        ax.set_xscale("log")
        ax.set_xlabel("aggregate density (distinct entries exchanged per step / entries, whole run)")
        ax.set_ylabel("test accuracy (%)" if accuracy else "held-out perplexity")
        title = "digits CNN" if accuracy else "char-LSTM"
        ax.set_title(f"{title}, N = {WORLD_SIZE}: quality at equal aggregate density "
                     "(labels: density run at)", fontsize=9)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
    return [save(fig, out_dir / "convergence_equal_density.png")]


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    out_dir = output_dir(args.out_dir, args.quick)
    out_json = out_dir / "convergence.json"
    report = run_all(args, out_json)
    targets = judge(report)
    report["targets"] = targets
    figures = plot(report, out_dir)
    out_json.write_text(json.dumps(report))
    (out_dir / "convergence.md").write_text(markdown(report, targets, figures))
    for t in targets:
        print(f"{'met' if t['met'] else 'NOT MET'}: {t['target']} -- {t.get('method', '')}: {t['measured']}")
    print(f"wrote {out_json}, {out_dir / 'convergence.md'}" + "".join(f", {f}" for f in figures))


if __name__ == "__main__":
    main()
