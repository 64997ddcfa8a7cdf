"""Training step time of real torchrun jobs through PyTorch DDP: the default allreduce, PyTorch's
fp16 hook and hvd_sparse's hooks, on loopback (Gloo).

    python scripts/bench_ddp.py --quick      # ~3 min: mlp7m, 2 ranks -> bench/quick/ddp.{json,md}
    python scripts/bench_ddp.py --model mlp25m --size 2 --repeats 5 --out-dir bench

One torchrun job runs every configuration side by side (the end-to-end benchmark's method,
scripts/bench_e2e_worker.py): per repeat, the configurations run in blocks, in an order rotated
from repeat to repeat; a block builds a fresh model from seed 0, wraps it in DDP with the
configuration's hook, runs ``--warmup`` untimed steps (DDP rebuilds its buckets after the first),
then ``--steps`` timed steps. A step is ``zero_grad``,
forward, backward (the hook's communication) and ``optimizer.step()``; its time is the slowest
rank's. Ratios to dense are taken within each repeat, and their median reported. "local" trains
without DDP: what the computation alone costs under the same contention.

Only loopback: on an emulated network (scripts/netns.sh) DDP's ranks would each need a namespace
of their own and a rendezvous reachable from all of them, which this script does not set up.
PyTorch's PowerSGD hooks are not measured: on Gloo (torch 2.13, CPU) ``powerSGD_hook`` and
``batched_powerSGD_hook`` hang in their first steps that compress (seen with the cnn and mlp7m
models at 2 ranks), so that comparison needs NCCL and GPUs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench_e2e_worker import MODELS, block_order, build_model
from results import machine_info, output_dir

HERE = Path(__file__).resolve().parent
# name -> (hvd_sparse method or one of PyTorch's, options)
CONFIGS: dict[str, tuple[str, dict]] = {
    "dense": ("torch", {}),
    "fp16": ("torch", {"hook": "fp16"}),
    "exdyna": ("exdyna", {}),
    "exdyna-tracking": ("exdyna", {"threshold_scaling": "tracking"}),
    "deft": ("deft", {}),
    "lags": ("lags", {}),
    "topk": ("topk", {}),
    "dgc": ("dgc", {}),
    "local": ("local", {}),
}
QUICK = {"model": "mlp7m", "size": 2, "configs": "dense,fp16,exdyna,exdyna-tracking,topk,local",
         "repeats": 2, "steps": 3, "warmup": 3}


def hook_for(config: str, model, density: float):
    """(state, hook) to register for ``config``, or None for DDP's own allreduce."""
    method, options = CONFIGS[config]
    if method == "torch":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        return (None, default_hooks.fp16_compress_hook) if options.get("hook") == "fp16" else None
    import hvd_sparse
    import hvd_sparse.torch.ddp as ddp

    state = hvd_sparse.create(method, framework="ddp", density=density,
                              named_parameters=model.named_parameters(), **options)
    return state, ddp.hook


def run_block(config: str, args, rank: int) -> dict:
    """One block of one configuration on this rank: its step times and statistics."""
    import torch
    from torch.nn.parallel import DistributedDataParallel

    model, shape = build_model(args.model)
    trained = model
    state = None
    if config != "local":
        trained = DistributedDataParallel(model)
        hook = hook_for(config, model, args.density)
        if hook is not None:
            state = hook[0]
            trained.register_comm_hook(*hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(rank)
    times = []
    for step in range(args.warmup + args.steps):
        x = torch.randn(args.batch, *shape, generator=generator)
        y = torch.randint(0, 10, (args.batch,), generator=generator)
        started = time.perf_counter()
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(trained(x), y).backward()
        optimizer.step()
        if step >= args.warmup:
            times.append(time.perf_counter() - started)
    record = {"config": config, "times": times}
    if state is not None and hasattr(state, "stats"):
        stats = state.stats()
        record.update({key: stats[key] for key in ("density_actual", "bytes_sent", "comm_wait_seconds")})
    return record


def worker(args) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    configs = args.configs.split(",")
    records = []
    for repeat in range(args.repeats):
        for config in block_order(configs, repeat):
            mine = run_block(config, args, rank)
            everyone: list = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, mine)
            records.append(merge_ranks(everyone, repeat))
            if rank == 0:
                took = 1e3 * records[-1]["step_seconds"]
                print(f"repeat {repeat} {config}: {took:.1f} ms/step", flush=True)
    if rank == 0:
        Path(args.records).write_text(json.dumps(records))
    dist.destroy_process_group()


def merge_ranks(ranks: list[dict], repeat: int) -> dict:
    """One block over every rank: each step lasts as long as its slowest rank; statistics averaged."""
    steps = [max(times) for times in zip(*(r["times"] for r in ranks), strict=True)]
    merged = {"config": ranks[0]["config"], "repeat": repeat, "step_seconds": statistics.mean(steps)}
    for key in ("density_actual", "bytes_sent", "comm_wait_seconds"):
        if key in ranks[0]:
            merged[key] = statistics.mean(r[key] for r in ranks)
    return merged


def summarize(records: list[dict]) -> dict[str, dict]:
    """Per configuration: the median step time, and the median over repeats of its ratio to dense
    within the repeat (with the lowest and highest)."""
    dense = {r["repeat"]: r["step_seconds"] for r in records if r["config"] == "dense"}
    summary: dict[str, dict] = {}
    for config in dict.fromkeys(r["config"] for r in records):
        mine = [r for r in records if r["config"] == config]
        row = {"step_ms": 1e3 * statistics.median(r["step_seconds"] for r in mine)}
        ratios = [r["step_seconds"] / dense[r["repeat"]] for r in mine if r["repeat"] in dense]
        if ratios:
            row.update(ratio=statistics.median(ratios), ratio_low=min(ratios), ratio_high=max(ratios))
        for key in ("density_actual", "bytes_sent"):
            if key in mine[0]:
                row[key] = statistics.median(r[key] for r in mine)
        summary[config] = row
    return summary


def markdown(job: dict) -> str:
    lines = [f"# DDP step time, {job['model']}, {job['size']} ranks on loopback", "",
             f"`{job['command']}`; {job['repeats']} repeats of {job['steps']} timed steps per "
             f"configuration, batch {job['batch']} per rank, density {job['density']}; "
             f"{job['machine']['cpus']} CPUs ({job['machine']['cpu_model']}).", "",
             "| configuration | ms / step | × dense (median, range) | density | bytes sent / rank |",
             "|---|---|---|---|---|"]
    for config, row in job["summary"].items():
        ratio = (f"{row['ratio']:.2f} ({row['ratio_low']:.2f}-{row['ratio_high']:.2f})"
                 if "ratio" in row else "-")
        density = f"{row['density_actual']:.4f}" if "density_actual" in row else "-"
        sent = f"{row['bytes_sent']:.0f}" if "bytes_sent" in row else "-"
        lines.append(f"| {config} | {row['step_ms']:.1f} | {ratio} | {density} | {sent} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the short run `make bench` would make")
    parser.add_argument("--model", choices=MODELS, default="mlp25m")
    parser.add_argument("--size", type=int, default=2, help="ranks")
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--density", type=float, default=0.001)
    parser.add_argument("--batch", type=int, default=8, help="samples per rank per step")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out-dir", type=Path)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--records", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    unknown = [c for c in args.configs.split(",") if c not in CONFIGS]
    if unknown:
        parser.error(f"unknown configurations {unknown}; choose from {sorted(CONFIGS)}")
    folder = output_dir(args.out_dir, args.quick)
    records_path = folder / "ddp-records.json"
    command = [str(Path(sys.executable).parent / "torchrun"), "--standalone", f"--nproc_per_node={args.size}",
               str(Path(__file__).resolve()), "--worker", "--records", str(records_path),
               *(f"--{key}={getattr(args, key)}" for key in
                 ("model", "configs", "density", "batch", "repeats", "steps", "warmup"))]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "PYTHONPATH": os.pathsep.join([str(HERE), str(HERE.parent), os.environ.get("PYTHONPATH", "")])}
    subprocess.run(command, env=env, check=True)
    records = json.loads(records_path.read_text())
    records_path.unlink()
    given = argv if argv is not None else sys.argv[1:]
    job = {"model": args.model, "size": args.size, "repeats": args.repeats, "steps": args.steps,
           "batch": args.batch, "density": args.density, "machine": machine_info(),
           "command": " ".join(["python scripts/bench_ddp.py", *given]),
           "records": records, "summary": summarize(records)}
    (folder / "ddp.json").write_text(json.dumps(job, indent=1))
    (folder / "ddp.md").write_text(markdown(job))
    print(markdown(job))


if __name__ == "__main__":
    main()
