"""One rank of a real training run to a target (started by scripts/time_to_accuracy.py).

The simulator's task and recipe in a real Horovod job: every rank builds the task from the same
seed (identical weights, no broadcast) and trains on its own minibatches (``batch(rank, step)``,
the simulator's), SGD with the recipe's constant learning rate and momentum through stock
``hvd.DistributedOptimizer`` (dense, Horovod's fp16 compression, or an hvd_sparse method), the
averaged gradient's norm clipped between ``synchronize()`` and ``step()``. Every
``evaluate_every`` steps rank 0 measures the held-out perplexity; the run stops when it is at or
below ``--target`` or after ``--max-steps``. Rank 0 writes the curve with the training clock
(wall-clock seconds of the steps, evaluations excluded) to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import time


def build_parser() -> argparse.ArgumentParser:
    """The worker's command line (time_to_accuracy.py builds it)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--method", required=True, help="dense, horovod-fp16 or an hvd_sparse method")
    parser.add_argument("--options", default="{}", help="the method's options (JSON)")
    parser.add_argument("--density", type=float, required=True)
    parser.add_argument("--momentum", type=float, required=True, help="the optimizer's momentum")
    parser.add_argument("--recipe", required=True, help="lr, clip_norm, batch_size, evaluate_every (JSON)")
    parser.add_argument("--task", required=True)
    parser.add_argument("--target", type=float, required=True)
    parser.add_argument("--max-steps", type=int, required=True)
    parser.add_argument("--out", required=True)
    return parser


def distributed_optimizer(args, recipe: dict, model, hvd, torch):
    """SGD wrapped in ``hvd.DistributedOptimizer`` with the configuration's compression."""
    import hvd_sparse

    named = list(model.named_parameters())
    optimizer = torch.optim.SGD(model.parameters(), lr=recipe["lr"], momentum=args.momentum)
    if args.method in ("dense", "horovod-fp16"):
        compression = hvd.Compression.fp16 if args.method == "horovod-fp16" else hvd.Compression.none
    else:
        compression = hvd_sparse.create(args.method, framework="torch", density=args.density,
                                        named_parameters=named, **json.loads(args.options))
    return hvd.DistributedOptimizer(optimizer, named_parameters=named, compression=compression)


def train(args, task, optimizer, hvd, torch, recipe: dict) -> dict:
    """Steps until the target or the budget; the curve as (step, training seconds, perplexity)."""
    params = list(task.model.parameters())
    curve, clock, reached = [], 0.0, None
    for step in range(args.max_steps):
        began = time.perf_counter()
        optimizer.zero_grad()
        task.loss(task.model, task.batch(hvd.rank(), step)).backward()
        optimizer.synchronize()
        if recipe.get("clip_norm"):
            torch.nn.utils.clip_grad_norm_(params, recipe["clip_norm"])
        with optimizer.skip_synchronize():
            optimizer.step()
        clock += time.perf_counter() - began
        if (step + 1) % recipe["evaluate_every"] == 0 or step + 1 == args.max_steps:
            value = task.evaluate(task.model)["perplexity"] if hvd.rank() == 0 else 0.0
            value = float(hvd.broadcast_object(value, root_rank=0, name=f"tta.eval.{step}"))
            curve.append([step + 1, clock, value])
            print(f"[tta_worker] step {step + 1} {clock:.1f} s perplexity {value:.2f}", flush=True)
            if value <= args.target:
                reached = step + 1
                break
    return {"steps": reached, "steps_run": curve[-1][0] if curve else 0,
            "seconds": curve[-1][1] if reached else None, "curve": curve}


def main() -> None:
    """Train this rank; rank 0 writes the run."""
    args = build_parser().parse_args()
    import horovod.torch as hvd
    import torch

    from hvd_sparse.sim.tasks import TASKS

    hvd.init()
    torch.set_num_threads(1)
    recipe = json.loads(args.recipe)
    task = TASKS[args.task](batch_size=recipe["batch_size"], seed=0)
    optimizer = distributed_optimizer(args, recipe, task.model, hvd, torch)
    run = train(args, task, optimizer, hvd, torch, recipe)
    if hvd.rank() == 0:
        run.update(target=args.target, method=args.method, density=args.density)
        with open(args.out, "w") as f:
            json.dump(run, f, indent=1)
    hvd.shutdown()


if __name__ == "__main__":
    main()
