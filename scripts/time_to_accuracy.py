"""Time to accuracy: how much sooner each method reaches the quality dense training reaches.

Two studies (``--task``), each one task measured both ways and composed:

* ``word`` (default): the word-level LSTM with SGD, ρ = 0.001, at 2 and 4 ranks, every method
  plain and with the recommended corrections (``+corr``);
* ``gpt``: the transformer task (hvd_sparse/sim/gpt.py) with AdamW, ρ = 0.01, at 2 ranks on
  1 Gbit/s, every seed method, TopK and DGC on the Adam path (``+adam``), ExDyna and TopK plain.

* **quality per step** -- training curves of the task (held-out perplexity) in the N-rank
  simulator (hvd_sparse.sim: the engine and the methods' own code, every rank its own
  minibatches). Dense trains the study's ``dense_steps``; the **target** is its final perplexity
  plus ``TOLERANCE`` (2%). Every other configuration trains until its held-out perplexity is at
  or below the target, or for the study's ``budget`` times dense's steps (then it is reported as
  not reaching it, with the best perplexity it reached). The learning rate is constant (a
  schedule that decays over a budget would tie quality to the budget). Horovod's fp16
  compression is dense training whose allreduce casts to half precision and sums there
  (``Fp16Group``).
* **time per step** -- real Horovod jobs in emulated networks (scripts/bench_e2e.py with the same
  model and optimizer, every configuration side by side): the median step. A corrected
  configuration (``+corr``) is timed in its steady state (momentum correction, dense small
  tensors), and the Adam path (``+adam``) after its dense steps; warm-up steps, whose density
  falls from dense to ρ, and the path's dense steps are charged at dense's step time.

time to target = steps to target x seconds per step (warm-up steps at dense's). Speedup over
dense = dense's time / the method's. ``--validate CONFIG@NET`` (the word study) trains CONFIG in
a real Horovod job on that network at 2 ranks all the way to the target (scripts/workers/tta_worker.py)
and prints its wall-clock time beside the composed estimate.

    OMP_NUM_THREADS=1 python scripts/time_to_accuracy.py --curves          # simulator curves
    python scripts/time_to_accuracy.py --step-times                         # bench_e2e jobs (root)
    OMP_NUM_THREADS=1 python scripts/time_to_accuracy.py --task gpt --curves --step-times
    python scripts/time_to_accuracy.py --validate exdyna-tracking@1gbit     # a real run (root)
    python scripts/time_to_accuracy.py                                      # report from saved runs

Writes bench/time-to-accuracy/{tta.json, tta.md, tta.png} (``--task gpt``:
bench/time-to-accuracy-gpt/; ``--out-dir``), after every run:
an interrupted run keeps what it measured and ``--curves`` resumes from it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

from results import pyplot, save
from workers.bench_e2e_worker import ADAM_PATH, REFRESH, SHARED_V, SHARED_V_EVERY

from hvd_sparse.algorithms.corrections import ADAM_DENSE_STEPS
from hvd_sparse.sim import words

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

SPARSE = ("exdyna-tracking", "micro", "deft", "lags", "topk", "dgc")
SEED_METHODS = ("exdyna-tracking", "micro", "deft", "lags")
BUDGET = 5.0
TOLERANCE = 0.02


@dataclass(frozen=True)
class Setup:
    """One time-to-accuracy study: the simulator's task and the bench_e2e model that is the same
    network, the training recipe every configuration shares, the configurations, where they are
    timed, and the target (dense's perplexity after ``dense_steps`` + ``TOLERANCE``)."""

    name: str
    task: str
    e2e_model: str
    recipe: dict
    density: float
    configs: tuple[str, ...]
    world_sizes: tuple[int, ...]
    nets: tuple[str, ...]
    dense_steps: int
    budget: float
    out_dir: Path
    optimizer: str = "sgd"        # what the step-time jobs step (bench_e2e.py --optimizer)
    settle: int = 0               # bench_e2e.py --settle: steps a threshold may take to settle
    judged_suffix: str = ""       # the seed methods' variant judged alone ("+adam"); "": the better

    def training(self, name: str) -> tuple[str, dict, float, dict]:
        """(simulator method, options, density, the simulator's optimizer arguments) of a
        configuration; fp16 is dense (its transport is emulated by ``Fp16Group``)."""
        if self.optimizer == "adamw":
            return adamw_training(self, name)
        return sgd_training(self, name)

    def warmup_steps(self, name: str) -> int:
        """Steps of a configuration's warm-up or dense steps (denser than ρ): charged at dense's
        step time."""
        if adam_variant(name)[1] is not None:
            return int(self.training(name)[1].get("dense_steps", ADAM_DENSE_STEPS))
        return int(self.training(name)[1].get("warmup_steps", 0)) if name != "fp16" else 0


def sgd_training(setup: Setup, name: str) -> tuple[str, dict, float, dict]:
    """The word task's configurations: the convergence runs' own definitions
    (scripts/convergence.py), so both scripts mean the same thing by a name."""
    from convergence import METHODS

    config = METHODS["dense" if name == "fp16" else name]
    recipe = {key: setup.recipe[key] for key in ("lr", "clip_norm", "batch_size")}
    recipe["momentum"] = setup.recipe["momentum"] if config.momentum is None else config.momentum
    return config.method, dict(config.options), setup.density * config.density_scale, recipe


def adamw_training(setup: Setup, name: str) -> tuple[str, dict, float, dict]:
    """The transformer task's configurations: scripts/adam_quality.py's methods, plain (torch's
    AdamW on the sparse average) or on the Adam path (``+adam``)."""
    from adam_quality import METHODS

    base, path = adam_variant(name)
    method, options = ("dense", {}) if base in ("dense", "fp16") else METHODS[base]
    recipe = {key: setup.recipe[key] for key in ("lr", "batch_size", "optimizer", "weight_decay")}
    return method, {**options, **(path or {})}, setup.density, {**recipe, "adam_path": path is not None}


# The Adam path ("+adam"), and with the shared second moment ("+adam-shared-v",
# docs/methods.md#adam-and-adamw), refreshed every SHARED_V_EVERY sparse steps: 5% of dense's
# bytes on top of the path's. The names are bench_e2e's configurations.


def adam_variant(name: str) -> tuple[str, dict | None]:
    """(the method of configuration ``name``, its Adam path's own options, or None when it is not
    on the path)."""
    if name.endswith(SHARED_V):
        return name.removesuffix(SHARED_V), {"second_moment_refresh": SHARED_V_EVERY}
    if name.endswith(ADAM_PATH):
        return name.removesuffix(ADAM_PATH), {}
    return name, None
OUT_DIR = REPO / "bench" / "time-to-accuracy"
# The word-level LSTM with SGD (hvd_sparse/sim/words.py's recipe: momentum 0.9 at a constant
# learning rate of 4, the averaged gradient's norm clipped to 1, 16 windows of 32 tokens per
# rank), evaluated every 50 steps; dense trains 500 steps, half the task's 1000-step budget:
# every curve at 2 ranks fits in about two hours here.
WORD = Setup(
    name="word", task="word-lstm", e2e_model="word-lstm",
    recipe={**{key: words.RECIPE[key] for key in ("lr", "momentum", "clip_norm", "batch_size")},
            "evaluate_every": 50},
    density=0.001, configs=("dense", "fp16", *SPARSE, *(f"{m}+corr" for m in SPARSE)),
    world_sizes=(2, 4), nets=("1gbit", "10gbit"), dense_steps=500, budget=BUDGET, out_dir=OUT_DIR)
# The transformer task with AdamW (scripts/adam_quality.py's recipe: lr 1e-3, weight decay 0.01,
# 8 windows of 32 tokens per rank) at ρ = 0.01, every seed method, TopK and DGC on the Adam path
# and ExDyna and TopK plain beside them; dense trains 1000 steps.
GPT = Setup(
    name="gpt", task="gpt", e2e_model="word-gpt",
    recipe={"lr": 1e-3, "batch_size": 8, "optimizer": "adamw", "weight_decay": 0.01,
            "evaluate_every": 50},
    density=0.01, configs=("dense", "fp16", *(f"{m}{ADAM_PATH}" for m in SPARSE), "exdyna-tracking",
                           "topk", *(f"{m}{SHARED_V}" for m in SPARSE)),
    world_sizes=(2,), nets=("1gbit",), dense_steps=1000, budget=3.0,
    out_dir=REPO / "bench" / "time-to-accuracy-gpt", optimizer="adamw", settle=300,
    judged_suffix=ADAM_PATH)
SETUPS = {setup.name: setup for setup in (WORD, GPT)}


class ReachedTargetError(Exception):
    """Raised from the simulator's record callback: the curve has reached the target."""


# --- quality per step: the simulator's curves ------------------------------------------------------
def fp16_group_class():
    """The simulator's lockstep group with Horovod's fp16 compression on its allreduces: every
    rank's tensor cast to half precision, summed in half precision, cast back (what
    ``hvd.Compression.fp16`` does around a float32 allreduce)."""
    from hvd_sparse.comm.local import LocalGroup
    from hvd_sparse.comm.protocol import ALLREDUCE

    class Fp16Group(LocalGroup):
        def _collective(self, first, tensors: list) -> list:
            if first.op != ALLREDUCE:
                return super()._collective(first, tensors)
            total = tensors[0].half()
            for t in tensors[1:]:
                total = total + t.half()
            return [total.to(tensors[0].dtype) for _ in range(self.size)]

    return Fp16Group


def train_curve(setup: Setup, name: str, world_size: int, steps: int, target: float | None) -> dict:
    """One configuration's held-out perplexity every ``recipe['evaluate_every']`` steps, for
    ``steps`` steps or until it is at or below ``target``."""
    import hvd_sparse.sim as sim

    method, options, density, optimizer = setup.training(name)
    curve: list[list[float]] = []

    def on_record(record: dict) -> None:
        if "perplexity" in record:
            curve.append([record["step"] + 1, float(record["perplexity"])])
            if target is not None and record["perplexity"] <= target:
                raise ReachedTargetError

    began = time.perf_counter()
    transport = (mock.patch.object(sim, "LocalGroup", fp16_group_class()) if name == "fp16"
                 else contextlib.nullcontext())
    with transport, contextlib.suppress(ReachedTargetError):
        sim.simulate(method, world_size, steps, density=density, task=setup.task, options=options,
                     schedule="constant", evaluate_every=setup.recipe["evaluate_every"],
                     on_record=on_record, **optimizer)
    return {"config": name, "world_size": world_size, "steps_allowed": steps, "curve": curve,
            "seconds": round(time.perf_counter() - began, 1)}


def steps_to_target(curve: list[list[float]], target: float) -> int | None:
    """The first evaluated step at or below ``target`` (None: never)."""
    return next((int(step) for step, value in curve if value <= target), None)


def curve_key(name: str, world_size: int) -> str:
    return f"{name}/{world_size}"


def run_curves(setup: Setup, report: dict, configs: list[str], sizes: list[int], save_report) -> None:
    """Dense first at each world size (it sets the target), then every configuration until it
    reaches the target or its budget; runs already in the report are kept."""
    for world_size in sizes:
        dense_key = curve_key("dense", world_size)
        if dense_key not in report["curves"]:
            report["curves"][dense_key] = train_curve(setup, "dense", world_size, setup.dense_steps, None)
            save_report()
        target = target_of(report, world_size)
        print(f"[tta] {world_size} ranks: dense {report['curves'][dense_key]['curve'][-1][1]:.2f} "
              f"after {setup.dense_steps} steps; target {target:.2f}", flush=True)
        for name in configs:
            key = curve_key(name, world_size)
            if name == "dense" or key in report["curves"]:
                continue
            run = train_curve(setup, name, world_size, int(setup.budget * setup.dense_steps), target)
            report["curves"][key] = run
            reached = steps_to_target(run["curve"], target)
            print(f"[tta] {key:28s} {'reached at step ' + str(reached) if reached else 'not reached'}"
                  f" (best {min(v for _, v in run['curve']):.2f}, {run['seconds']:.0f} s)", flush=True)
            save_report()


def target_of(report: dict, world_size: int) -> float:
    """Dense's final held-out perplexity at ``world_size`` ranks, plus the tolerance."""
    return report["curves"][curve_key("dense", world_size)]["curve"][-1][1] * (1.0 + TOLERANCE)


# --- time per step: real Horovod jobs ---------------------------------------------------------------
def e2e_configs(name: str) -> list[str]:
    """The bench_e2e configurations that time ``name``: for the shared second moment its own (a
    step between refreshes) and the one that refreshes every step."""
    if name.endswith(SHARED_V):
        return [name, name.removesuffix(SHARED_V) + REFRESH]
    return [name]


def step_seconds(name: str, steps: dict) -> float | None:
    """A configuration's mean step from the measured ones (``steps``: bench_e2e configuration ->
    median seconds). With the shared second moment: a step between refreshes, and every
    ``SHARED_V_EVERY``-th step a refresh step, both measured."""
    measured = [steps.get(config) for config in e2e_configs(name)]
    if any(step is None for step in measured):
        return None
    if not name.endswith(SHARED_V):
        return measured[0]
    between, refresh = measured
    return between + (refresh - between) / SHARED_V_EVERY


def measure_step_times(setup: Setup, out_dir: Path, configs: list[str], sizes: list[int],
                       nets: list[str], repeats: int) -> Path:
    """Run scripts/bench_e2e.py on the task's model; returns its JSON."""
    out = out_dir / "step-times"
    cmd = [sys.executable, str(HERE / "bench_e2e.py"), "--models", setup.e2e_model,
           "--nets", *nets, "--sizes", *map(str, sizes),
           "--configs", ",".join(dict.fromkeys(["local", *(c for name in configs
                                                           for c in e2e_configs(name))])),
           "--density", repr(setup.density), "--optimizer", setup.optimizer,
           "--settle", str(setup.settle),
           "--repeats", str(repeats), "--out", str(out)]
    print("[tta] " + " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    return Path(f"{out}.json")


def load_step_times(setup: Setup, paths: list[Path]) -> dict:
    """{net: {world size: {configuration: median step seconds}}} from bench_e2e JSONs (a later
    file's job replaces an earlier one's)."""
    times: dict = {}
    for path in paths:
        for job in json.loads(path.read_text())["jobs"]:
            if job.get("model") != setup.e2e_model or job.get("framework", "torch") != "torch":
                continue
            rows = {c: row["step_seconds"]["median"] for c, row in job["summary"].items()}
            times.setdefault(job["net"], {})[str(job["size"])] = rows
    return times


# --- composition -----------------------------------------------------------------------------------
def compose_one(curve: list[list[float]], target: float, step: float | None, dense_step: float,
                warmup: int) -> dict:
    """Steps and seconds to the target for one configuration on one network (warm-up steps at
    dense's step time)."""
    reached = steps_to_target(curve, target)
    row: dict = {"steps": reached, "best": min(v for _, v in curve), "steps_run": int(curve[-1][0]),
                 "step_seconds": step}
    if reached is not None and step is not None:
        warm = min(warmup, reached)
        row["seconds"] = warm * dense_step + (reached - warm) * step
    return row


def compose(setup: Setup, report: dict) -> dict:
    """{net: {world size: {configuration: row}}} with each row's speedup over dense."""
    table: dict = {}
    for net, by_size in report.get("step_times", {}).items():
        for size, steps in by_size.items():
            dense_key = curve_key("dense", int(size))
            if dense_key not in report["curves"] or "dense" not in steps:
                continue
            target = target_of(report, int(size))
            rows = {}
            for name in setup.configs:
                run = report["curves"].get(curve_key(name, int(size)))
                if run and run["curve"]:
                    rows[name] = compose_one(run["curve"], target, step_seconds(name, steps),
                                             steps["dense"], setup.warmup_steps(name))
            dense_seconds = rows.get("dense", {}).get("seconds")
            for row in rows.values():
                if dense_seconds and row.get("seconds"):
                    row["speedup"] = dense_seconds / row["seconds"]
            table.setdefault(net, {})[size] = {"target": target, "rows": rows,
                                               "local_step_seconds": steps.get("local")}
    return table


def best_variant(rows: dict, method: str) -> tuple[str, float]:
    """The faster of ``method`` and ``method+corr`` that has a curve (speedup 0 when it does not
    reach the target); the name says "(no curve)" when neither has one."""
    options = [(name, rows[name].get("speedup", 0.0)) for name in (method, f"{method}+corr")
               if name in rows]
    return max(options, key=lambda item: item[1]) if options else (f"{method} (no curve)", 0.0)


def judge(setup: Setup, table: dict) -> list[dict]:
    """The issues' targets of the study, met or not, with the figures."""
    return judge_adam(setup, table) if setup.judged_suffix else judge_sgd(table)


def judge_adam(setup: Setup, table: dict) -> list[dict]:
    """Issue 35's target: at 2 ranks and 1 Gbit/s, each seed method on the Adam path reaches
    dense's perplexity, and sooner than dense; the path with its own second moment or the shared
    one, whichever gets there sooner."""
    out = []
    rows = table.get("1gbit", {}).get("2", {}).get("rows", {})
    if not rows:
        return out
    for method in SEED_METHODS:
        variants = [f"{method}{setup.judged_suffix}", f"{method}{SHARED_V}"]
        name = max((v for v in variants if v in rows), key=lambda v: rows[v].get("speedup", 0.0),
                   default=variants[0])
        row = rows.get(name)
        measured = ("no curve" if row is None else f"not reached in {row['steps_run']} steps "
                    f"(best {row['best']:.2f})" if row["steps"] is None
                    else f"step {row['steps']}, {row.get('speedup', 0.0):.2f}x dense's speed")
        out.append({"target": f"2 ranks, 1 Gbit/s: {name} reaches dense's perplexity, sooner than dense",
                    "measured": measured,
                    "met": row is not None and row.get("speedup", 0.0) > 1.0})
    return out


def judge_sgd(table: dict) -> list[dict]:
    """Issue 20's targets (moonshots) on the word task, met or not, with the figures; each seed
    method, TopK and fp16 at its better variant (plain or with the recipe)."""
    out = []
    one = table.get("1gbit", {})
    if "2" in one:
        rows = one["2"]["rows"]
        topk, fp16 = best_variant(rows, "topk")[1], rows.get("fp16", {}).get("speedup", 0.0)
        for method in SEED_METHODS:
            name, speedup = best_variant(rows, method)
            need = 3.0 if method == "exdyna-tracking" else 2.0
            out.append({"target": f"2 ranks, 1 Gbit/s: {method} at least {need:g}x sooner than dense, "
                                  "and sooner than TopK and fp16",
                        "measured": f"{name} {speedup:.2f}x (TopK {topk:.2f}x, fp16 {fp16:.2f}x)",
                        "met": speedup >= need and speedup > topk and speedup > fp16})
    if "2" in one and "4" in one:
        two, four = (best_variant(one[s]["rows"], "exdyna-tracking")[1] for s in ("2", "4"))
        out.append({"target": "4 ranks, 1 Gbit/s: ExDyna's speedup over dense above its 2-rank one",
                    "measured": f"{four:.2f}x at 4 ranks, {two:.2f}x at 2", "met": four > two})
    for size, entry in table.get("10gbit", {}).items():
        variants = [best_variant(entry["rows"], m) for m in SEED_METHODS]
        missing = [name.split()[0] for name, _ in variants if "(no curve)" in name]
        measured = [v for v in variants if "(no curve)" not in v[0]]
        if not measured:
            continue
        worst = min(measured, key=lambda item: item[1])
        out.append({"target": f"10 Gbit/s, {size} ranks: no seed method later than dense",
                    "measured": f"slowest: {worst[0]} {worst[1]:.2f}x"
                                + (f"; not judged without a curve: {', '.join(missing)}" if missing else ""),
                    "met": worst[1] >= 1.0 and not missing})
    return out


# --- the report ------------------------------------------------------------------------------------
def markdown(setup: Setup, report: dict, table: dict, targets: list[dict], figure: str | None) -> str:
    """Tables (one per network and world size), the validation runs and the targets."""
    lines = [f"# Time to accuracy (`{setup.task}` task)", "",
             f"Task `{setup.task}` (held-out perplexity), ρ = {setup.density:g}, recipe {setup.recipe}; "
             f"target: dense's perplexity after {setup.dense_steps} steps + {TOLERANCE:.0%}; budget "
             f"{setup.budget:g}x dense's steps. Curves from the simulator, step times from real "
             f"Horovod jobs (scripts/bench_e2e.py, model `{setup.e2e_model}`); warm-up steps and the "
             "Adam path's dense steps charged at dense's step time. `+adam-shared-v`: the path with "
             f"`second_moment_refresh={SHARED_V_EVERY}`, its mean step from two measured ones: the "
             f"median step of that configuration, one between refreshes, and of `+adam-refresh`, which "
             f"refreshes every step; one step in {SHARED_V_EVERY} is a refresh.", ""]
    for size in sorted({size for by_size in table.values() for size in by_size}, key=int):
        lines += size_table(setup, size, {net: by_size[size] for net, by_size in table.items()
                                          if size in by_size})
    if report.get("validations"):
        lines += ["## Real runs to the target (2 ranks)", "",
                  "| configuration | network | steps to target | wall-clock s | composed estimate s |",
                  "|---|---|---|---|---|"]
        for v in report["validations"]:
            estimate = table.get(v["net"], {}).get("2", {}).get("rows", {}).get(v["config"], {})
            est = f"{estimate['seconds']:.0f}" if estimate.get("seconds") else "-"
            steps = v["steps"] if v["steps"] is not None else f"not in {v['steps_run']}"
            seconds = f"{v['seconds']:.0f}" if v.get("seconds") else "-"
            lines.append(f"| {v['config']} | {v['net']} | {steps} | {seconds} | {est} |")
        lines.append("")
    lines += ["## Targets", ""] + [f"- {'met' if t['met'] else 'NOT met'}: {t['target']} -- "
                                   f"{t['measured']}" for t in targets]
    if figure:
        lines += ["", f"![perplexity against wall-clock time]({Path(figure).name})"]
    return "\n".join(lines) + "\n"


def size_table(setup: Setup, size: str, by_net: dict) -> list[str]:
    """One world size: every configuration's steps and best perplexity, then per network its step
    time, its time to the target and its speedup over dense."""
    first = next(iter(by_net.values()))
    targets = sorted({f"{entry['target']:.2f}" for entry in by_net.values()})
    lines = [f"## {size} ranks (target perplexity {', '.join(targets)})", ""]
    local = [f"{net} {entry['local_step_seconds'] * 1e3:.0f} ms" for net, entry in by_net.items()
             if entry.get("local_step_seconds")]
    if local:
        lines += [f"The same steps without communication (`local`, in the step-time job) took "
                  f"{', '.join(local)}: on a machine with fewer cores than ranks, that includes their "
                  "sharing the cores.", ""]
    lines += ["| configuration | steps to target | best perplexity | "
              + " | ".join(f"{net} step ms | {net} time s (speedup)" for net in by_net) + " |",
              "|---|---|---|" + "---|---|" * len(by_net)]
    for name, row in first["rows"].items():
        steps = row["steps"] if row["steps"] is not None else f"not in {row['steps_run']}"
        cells = []
        for entry in by_net.values():
            timed = entry["rows"].get(name, {})
            cells.append(f"{timed['step_seconds'] * 1e3:.0f}" if timed.get("step_seconds") else "-")
            cells.append(f"{timed['seconds']:.0f} ({timed['speedup']:.2f}x)" if timed.get("speedup")
                         else "-")
        lines.append(f"| {name} | {steps} | {row['best']:.2f} | " + " | ".join(cells) + " |")
    missing = [name for name in setup.configs if name not in first["rows"]]
    if missing:
        lines.append(f"\nNo curve at {size} ranks yet: {', '.join(missing)}.")
    return [*lines, ""]


def wall_clock(curve: list[list[float]], step: float, dense_step: float, warmup: int) -> list[float]:
    """Seconds at each evaluated step of a curve (warm-up steps at dense's step time)."""
    return [min(s, warmup) * dense_step + max(0.0, s - warmup) * step for s, _ in curve]


def plot(setup: Setup, report: dict, table: dict, out_dir: Path) -> str | None:
    """Perplexity against wall-clock time, one panel per network and world size, one curve per
    configuration; the target as a dotted line."""
    plt = pyplot()
    panels = [(net, size) for net, by_size in table.items() for size in sorted(by_size)]
    if plt is None or not panels:
        return None
    figure, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.2), squeeze=False)
    for ax, (net, size) in zip(axes[0], panels, strict=True):
        steps = report["step_times"][net][size]
        for name in setup.configs:
            run = report["curves"].get(curve_key(name, int(size)))
            if not run or step_seconds(name, steps) is None:
                continue
            x = wall_clock(run["curve"], step_seconds(name, steps), steps["dense"],
                           setup.warmup_steps(name))
            ax.plot(x, [v for _, v in run["curve"]], label=name,
                    linestyle="--" if name.endswith(("+corr", ADAM_PATH)) else "-", linewidth=1.2)
        ax.axhline(table[net][size]["target"], color="grey", linestyle=":", linewidth=1)
        ax.set(title=f"{net}, {size} ranks", xlabel="wall-clock seconds (composed)",
               ylabel="held-out perplexity", xscale="log", yscale="log")
    axes[0][-1].legend(fontsize=7, ncol=2)
    return save(figure, out_dir / "tta.png")


# --- validation: a real Horovod run to the target ------------------------------------------------------
def validate(setup: Setup, spec: str, report: dict, timeout: float) -> dict:
    """Train ``CONFIG@NET`` in a real 2-rank Horovod job in that emulated network until the
    2-rank target (or the budget): steps and wall-clock seconds of training (evaluations
    excluded), from scripts/workers/tta_worker.py."""
    import tempfile

    import bench_e2e

    name, _, net = spec.partition("@")
    if name not in setup.configs or bench_e2e.rate_bits(net) is None:
        raise SystemExit(f"--validate expects CONFIG@RATE with CONFIG in {', '.join(setup.configs)} "
                         f"and a tc rate such as 1gbit, got {spec!r}")
    method, options, density, optimizer = setup.training(name)
    workdir = Path(tempfile.mkdtemp(prefix="tta."))
    out = workdir / "run.json"
    worker_args = ["--config", name, "--method", "horovod-fp16" if name == "fp16" else method,
                   "--options", json.dumps(options), "--density", repr(density),
                   "--momentum", repr(optimizer["momentum"]), "--recipe", json.dumps(setup.recipe),
                   "--task", setup.task, "--target", repr(target_of(report, 2)),
                   "--max-steps", str(int(setup.budget * setup.dense_steps)), "--out", str(out)]
    print("[tta] " + bench_e2e.netns("up", "2", net), flush=True)
    try:
        bench_e2e.launch_gloo(2, worker_args, workdir, timeout, namespaces=True,
                              worker=HERE / "workers" / "tta_worker.py")
    finally:
        bench_e2e.netns("down")
    run = json.loads(out.read_text())
    run.update(config=name, net=net)
    return run


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line; ``--configs``, ``--sizes``, ``--nets`` and ``--out-dir`` default to the
    study's (``--task``)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", choices=sorted(SETUPS), default=WORD.name,
                        help="word: the word LSTM with SGD; gpt: the transformer with AdamW")
    parser.add_argument("--curves", action="store_true", help="train the simulator's curves")
    parser.add_argument("--step-times", action="store_true", help="time every configuration in "
                        "real Horovod jobs (scripts/bench_e2e.py; emulated networks need root)")
    parser.add_argument("--step-times-from", nargs="+", type=Path, default=[],
                        help="bench_e2e JSONs to take the step times from instead")
    parser.add_argument("--merge-from", nargs="+", type=Path, default=[], metavar="JSON",
                        help="take the curves and real runs of other runs of this script (e.g. "
                             "another world size trained in parallel into another --out-dir) "
                             "into this report")
    parser.add_argument("--validate", nargs="+", default=[], metavar="CONFIG@NET")
    parser.add_argument("--configs", nargs="+")
    parser.add_argument("--sizes", nargs="+", type=int)
    parser.add_argument("--nets", nargs="+")
    parser.add_argument("--repeats", type=int, default=5, help="bench_e2e visits per configuration")
    parser.add_argument("--job-timeout", type=float, default=7200)
    parser.add_argument("--out-dir", type=Path)
    args = parser.parse_args(argv)
    args.setup = SETUPS[args.task]
    unknown = sorted(set(args.configs or ()) - set(args.setup.configs))
    if unknown:
        parser.error(f"--task {args.task} has no configurations {unknown}; it has "
                     f"{', '.join(args.setup.configs)}")
    if args.validate and args.setup.optimizer != "sgd":
        parser.error("--validate trains with SGD (scripts/workers/tta_worker.py): only --task word")
    args.configs = args.configs or list(args.setup.configs)
    args.sizes = args.sizes or list(args.setup.world_sizes)
    args.nets = args.nets or list(args.setup.nets)
    args.out_dir = args.out_dir or args.setup.out_dir
    return args


def merge(report: dict, paths: list[Path]) -> None:
    """Take the curves and real runs of other reports (``--merge-from``) into ``report``."""
    for path in paths:
        other = json.loads(path.read_text())
        for key, run in other["curves"].items():
            report["curves"].setdefault(key, run)
        known = {(v["config"], v["net"]) for v in report.get("validations", [])}
        report.setdefault("validations", []).extend(
            v for v in other.get("validations", []) if (v["config"], v["net"]) not in known)


def main() -> None:
    """Measure what was asked (curves, step times, real runs), then write the report from
    everything measured so far."""
    args = parse_args()
    setup = args.setup
    args.out_dir.mkdir(parents=True, exist_ok=True)
    out_json = args.out_dir / "tta.json"
    report = json.loads(out_json.read_text()) if out_json.exists() else {"curves": {}}
    report.update(task=setup.task, recipe=setup.recipe, density=setup.density,
                  dense_steps=setup.dense_steps, budget=setup.budget, tolerance=TOLERANCE,
                  python=platform.python_version())

    def save_report() -> None:
        out_json.write_text(json.dumps(report, indent=1))

    merge(report, args.merge_from)
    if args.curves:
        import torch

        torch.set_num_threads(1)
        run_curves(setup, report, args.configs, args.sizes, save_report)
    sources = list(args.step_times_from)
    if args.step_times:
        sources.append(measure_step_times(setup, args.out_dir, args.configs, args.sizes, args.nets,
                                          args.repeats))
    if sources:
        report["step_times"] = {**report.get("step_times", {}), **load_step_times(setup, sources)}
        report["step_time_sources"] = [str(p) for p in sources]
    for spec in args.validate:
        report.setdefault("validations", []).append(validate(setup, spec, report, args.job_timeout))
        save_report()
    table = compose(setup, report)
    targets = judge(setup, table)
    report.update(table=table, targets=targets)
    save_report()
    figure = plot(setup, report, table, args.out_dir)
    (args.out_dir / "tta.md").write_text(markdown(setup, report, table, targets, figure))
    for t in targets:
        print(f"[tta] {'met' if t['met'] else 'NOT met'}: {t['target']} -- {t['measured']}")
    print(f"[tta] wrote {out_json} and {args.out_dir / 'tta.md'}", flush=True)


if __name__ == "__main__":
    main()
