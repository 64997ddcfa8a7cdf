"""Command line of the N-rank simulator (hvd_sparse/sim/__init__.py).

    python -m hvd_sparse.sim --method exdyna --world-size 64 --density 0.001 --model lstm \\
        --steps 500 --out run.json
    python -m hvd_sparse.sim --method exdyna --option threshold_scaling=tracking \\
        --option rebalance=neighbour ...
    python -m hvd_sparse.sim --method dense --model digits --steps 1000 --evaluate-every 100

Writes one JSON object: ``config`` (the arguments, the method's hyper-parameters, the Python and
torch versions), ``records`` (one per step, fields in ``hvd_sparse.sim.RECORD_FIELDS``: target
and achieved density, union/k build-up, per-rank counts, imbalance, threshold, partition table,
bytes per rank, residual norms; plus ``accuracy`` or ``perplexity`` on evaluated steps) and
``summary`` (means after ``--skip`` warm-up steps, the last evaluation). Prints a progress line
every ``--log-every`` steps.

Each simulated rank computes its own gradient on its own minibatch, so a step costs about N
times one rank's forward and backward pass, and gather-pattern methods (top-k, DGC, ...) hold
every rank's copy of everything gathered: about 8·N²·k bytes (k: one rank's count). On a 2-core,
24 GiB machine (torch on one thread) every model runs up to N = 1024 at ρ = 0.001; see the
measured seconds per step and peak memory in bench/sim_scale.md (scripts/sim_scale.py).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path
from typing import Any

import torch

from . import OPTIMIZERS, SCHEDULES, OptimizerRecipe, make_algorithm, methods, simulate, summarize_run
from .tasks import TASKS, task_info


def parse_value(text: str) -> Any:
    """An option value from the command line: true/false/none, an int, a float, else the string."""
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered in ("none", "null"):
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def parse_options(pairs: list[str]) -> dict:
    """``--option`` pairs (key=value) as keyword arguments."""
    options = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"--option expects key=value (e.g. threshold_scaling=tracking), got {pair!r}")
        options[key.strip().replace("-", "_")] = parse_value(value.strip())
    return options


def build_parser() -> argparse.ArgumentParser:
    """The command line (module docstring)."""
    parser = argparse.ArgumentParser(
        prog="python -m hvd_sparse.sim", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--method", required=True, choices=methods(),
                        help="a registered method, or 'dense' (the plain average)")
    parser.add_argument("--world-size", type=int, default=4, help="simulated ranks N")
    parser.add_argument("--density", type=float, default=0.01, help="target density ρ")
    parser.add_argument("--model", default="digits", choices=sorted(TASKS), help="task and model")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                        help="a hyper-parameter of the method, e.g. threshold_scaling=tracking (repeatable)")
    parser.add_argument("--batch-size", type=int, default=16, help="per rank")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--momentum", type=float, default=0.9,
                        help="SGD momentum on the average (use 0 with DGC, whose momentum is inside)")
    parser.add_argument("--optimizer", choices=OPTIMIZERS, default="sgd",
                        help="sgd: SGD(lr, momentum); adamw: AdamW(lr, weight decay)")
    parser.add_argument("--weight-decay", type=float, default=0.01, help="AdamW's (decoupled)")
    parser.add_argument("--adam-path", action="store_true",
                        help="run the method on the Adam path of the AdamW (docs/methods.md#adam-and-adamw)")
    parser.add_argument("--schedule", choices=SCHEDULES, default="constant")
    parser.add_argument("--clip-norm", type=float, default=None, help="clip the averaged gradient")
    parser.add_argument("--seed", type=int, default=0, help="model initialisation and data order")
    parser.add_argument("--evaluate-every", type=int, default=0,
                        help="evaluate every so many steps and at the end (0: never)")
    parser.add_argument("--skip", type=int, default=0, help="warm-up steps left out of the summary")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--log-every", type=int, default=50, help="progress line every so many steps")
    parser.add_argument("--out", type=Path, default=None, help="JSON file to write")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the simulator from the command line; the exit status."""
    args = build_parser().parse_args(argv)
    if args.world_size < 1 or args.steps < 1:
        raise SystemExit("--world-size and --steps must be at least 1")
    torch.set_num_threads(args.threads)
    options = parse_options(args.option)
    adam = OptimizerRecipe(args.optimizer).adam_path() if args.adam_path else None
    algorithm = make_algorithm(args.method, args.density, options, adam)   # fails early on a bad option

    def progress(record: dict) -> None:
        step = record["step"]
        if args.log_every and ((step + 1) % args.log_every == 0 or step == args.steps - 1):
            extra = "".join(f" {key}={record[key]:.4f}" for key in ("accuracy", "perplexity")
                            if key in record)
            print(f"step {step + 1:>6}  loss {record['loss']:.4f}  density "
                  f"{record['density_actual']:.5f} (target {record['density_target']:.5f})  buildup "
                  f"{record['buildup']:.3f}  imbalance {record['imbalance']:.3f}  "
                  f"{record['seconds']:.2f}s/step{extra}", flush=True)

    records = simulate(algorithm, args.world_size, args.steps, density=args.density, task=args.model,
                       batch_size=args.batch_size, lr=args.lr, momentum=args.momentum, seed=args.seed,
                       evaluate_every=args.evaluate_every, schedule=args.schedule,
                       clip_norm=args.clip_norm, optimizer=args.optimizer, weight_decay=args.weight_decay,
                       adam_path=args.adam_path, on_record=progress)
    summary = summarize_run(records, skip=min(args.skip, args.steps - 1))
    config = {key: (str(value) if isinstance(value, Path) else value) for key, value in vars(args).items()}
    config.update(options=options, hyperparameters=_jsonable(algorithm.describe()),
                  python=platform.python_version(), torch=torch.__version__,
                  data=task_info(args.model))
    print(json.dumps(summary))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"config": config, "records": records, "summary": summary}))
    return 0


def _jsonable(value: Any) -> Any:
    try:
        json.dumps(value)
        return value
    except TypeError:
        return repr(value)


if __name__ == "__main__":
    sys.exit(main())
